"""grouped_matmul beyond the registry-driven suite: rows past the sizes' sum, groups cut at T and empty groups, the
tile scan over uneven groups, the adapters' guarantees (JAX jit / vmap / grad, torch opcheck and torch.compile), and
the benchmark peers."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_tilelang, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import grouped_matmul as gm

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")


@pytest.mark.parametrize("sizes", [[0, 70, 0, 1, 129], [300, 0], [10, 20], [0, 0, 0]])
def test_uneven_groups_short_and_long_sums(driver, sizes):
    """Groups of 0, 1, one tile + 1 and several tiles; a sum past T (the last group cut at T) and short of it (the
    rows past it 0); the forward and both gradients against the float64 reference."""
    rng = np.random.default_rng(len(sizes))
    t, k, n = 200, 40, 24
    kwargs = {"x": rng.standard_normal((t, k)).astype(np.float32),
              "weights": (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(np.float32),
              "group_sizes": np.array(sizes, np.int32)}  # fmt: skip
    (out,) = driver.call(gm.NAME, kwargs)
    (ref,) = gm.reference(**kwargs)
    if sum(sizes) < t:
        assert not np.any(ref[sum(sizes) :]) and not np.any(out[sum(sizes) :])
    assert_close("grouped_matmul", np.asarray(out, np.float64), ref, "float32")
    dy = rng.standard_normal(ref.shape).astype(np.float32)
    _, grads = driver.vjp(gm.NAME, kwargs, ("x", "weights"), (dy,))
    want = gm.reference_vjp(kwargs, (dy,))
    for name in ("x", "weights"):
        assert_close(f"d{name}", np.asarray(grads[name], np.float64), want[name], "float32")


@needs_torch
@pytest.mark.parametrize("panel", [1, 4])
def test_panel_order_covers_every_tile(monkeypatch, panel):
    """grouped_rows_kernel and grouped_weight_grad_kernel with PANEL (tiles visited in panels across the column
    tiles, for L2 reuse): the forward's 10 x 7 tiles of 16 x 16 (9 row tiles hold rows), its last panel of 4 two tiles
    wide and holding rows; dW's 6 x 7 a group, its last panel of 4 two K tiles wide; the forward, dx and dW against
    the float64 reference."""
    import torch

    from tile_kernels.core.plan import Target
    from tile_kernels.torch._runtime import Executor

    monkeypatch.setattr(gm, "blocks", lambda *a: gm.Blocks(16, 16, 16, 4, 1, panel))
    rng = np.random.default_rng(panel)
    t, k, n, sizes = 117, 88, 100, [17, 100]
    kwargs = {"x": rng.standard_normal((t, k)).astype(np.float32),
              "weights": (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(np.float32),
              "group_sizes": np.array(sizes, np.int32)}  # fmt: skip
    dy = rng.standard_normal((t, n)).astype(np.float32)
    dev = "cuda" if DEVICE == "gpu" else "cpu"
    x, w, g = (torch.from_numpy(kwargs[name]).to(dev) for name in ("x", "weights", "group_sizes"))
    target = Target(num_sms=4)
    (out,) = Executor(gm.forward(t, k, n, len(sizes), dtype="float32", target=target))(x, w, g, device=x.device)
    assert_close("grouped_matmul", out.double().cpu().numpy(), gm.reference(**kwargs)[0], "float32")
    plan = gm.backward(t, k, n, len(sizes), dtype="float32", target=target)
    dx, dw = Executor(plan)(torch.from_numpy(dy).to(dev), x, w, g, device=x.device)
    want = gm.reference_vjp(kwargs, (dy,))
    assert_close("dx", dx.double().cpu().numpy(), want["x"], "float32")
    assert_close("dweights", dw.double().cpu().numpy(), want["weights"], "float32")


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
def test_torch_opcheck_tilelang():
    """The TileLang ops (grouped_matmul_fwd / bwd with backend "tilelang", and the compiled ops they call) through
    opcheck on Hopper."""
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 64, 24, device="cuda", dtype=torch.bfloat16) / 8
    sizes, dy = torch.tensor([17, 0, 20], device="cuda", dtype=torch.int32), torch.randn_like(x[:, :24])
    ops, tl = torch.ops.tile_kernels, "tilelang"
    for op, args in [(ops.grouped_matmul_fwd.default, (x.requires_grad_(), w.requires_grad_(), sizes, tl, tl)),
                     (ops.grouped_matmul_fwd_compiled.default, (x.detach(), w.detach(), sizes, tl)),
                     (ops.grouped_matmul_bwd_compiled.default, (dy, x.detach(), w.detach(), sizes, tl))]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_jax
def test_jax_jit_vmap_and_grad():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 30, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4, 16, 8)), jnp.float32)
    sizes = jnp.asarray([[10, 0, 15, 5], [30, 0, 0, 0], [1, 2, 3, 4]], jnp.int32)
    one = (x[0], w[0], sizes[0])
    np.testing.assert_array_equal(jax.jit(tk.grouped_matmul)(*one), tk.grouped_matmul(*one))
    batched = jax.vmap(tk.grouped_matmul)(x, w, sizes)
    for i in range(3):
        ref = gm.reference(np.asarray(x[i]), np.asarray(w[i]), np.asarray(sizes[i]))[0]
        assert_close("grouped_matmul vmap", np.asarray(batched[i], np.float64), ref, "float32")
    dx, dw = jax.grad(lambda x, w: tk.grouped_matmul(x, w, sizes[2]).sum(), argnums=(0, 1))(x[2], w[2])
    want = gm.reference_vjp({"x": np.asarray(x[2]), "weights": np.asarray(w[2]), "group_sizes": np.asarray(sizes[2])},
                            (np.ones((30, 8)),))  # fmt: skip
    assert_close("dx", np.asarray(dx, np.float64), want["x"], "float32")
    assert_close("dweights", np.asarray(dw, np.float64), want["weights"], "float32")


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    utils = OPCHECK_UTILS
    kwargs = gm.sample(np.random.default_rng(3), (24, 16), "float16", experts=3)
    x, w, sizes = (torch.from_numpy(kwargs[k]).to(dev) for k in ("x", "weights", "group_sizes"))
    dy = torch.randn(24, 16, device=dev, dtype=torch.float16)
    ops = torch.ops.tile_kernels
    for op, args in [(ops.grouped_matmul_fwd.default, (x.requires_grad_(), w.requires_grad_(), sizes)),
                     (ops.grouped_matmul_bwd.default, (dy, x.detach(), w.detach(), sizes)),
                     (ops.grouped_matmul.default, (x, w, sizes))]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch.compile cannot compile Triton kernels in the interpreter")
def test_torch_compile_fullgraph_matches_eager():
    import torch

    import tile_kernels.torch as tk

    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16) / 23).requires_grad_()
    sizes = torch.tensor([300, 0, 450, 250], device="cuda", dtype=torch.int32)

    def layer(x, w):
        return torch.nn.functional.silu(tk.grouped_matmul(x, w, sizes)).sum()

    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(layer, fullgraph=True)(x, w), (x, w))
    torch.testing.assert_close(compiled, torch.autograd.grad(layer(x, w), (x, w)))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_bench_peers(framework):
    """The benchmark's torch eager (a GEMM per group) and jax.jit (ragged_dot) peers compute the same op, empty
    groups and a short sum included."""
    from test_bench import _peer

    peer = _peer(framework, gm.NAME)
    for seed in range(3):
        kwargs = gm.sample(np.random.default_rng(seed), (3, 40), "float32", experts=4)
        kwargs["group_sizes"][-1] = max(0, kwargs["group_sizes"][-1] - 2)  # the last 2 rows in no group
        np.testing.assert_allclose(peer(kwargs)[0], gm.reference(**kwargs)[0], rtol=2e-5, atol=1e-5)


def test_tilelang_backend_plan_and_refusals():
    """backend="tilelang": clear errors for float32, unaligned K or N and GPUs other than Hopper; its forward one Call
    that reads and writes the zeroed output (rows outside every group stay 0, also in JAX), or the Triton plan for an
    empty product; its backward the Triton plan's inputs and outputs, dx one Call of the transposed-b kernel into the
    zeroed dx, dW the Triton kernel; backend=None picks it on Hopper from MIN_TILELANG_ROWS tokens for the inputs it
    runs, for the forward and dx at any K and N."""
    from tile_kernels.core import backends
    from tile_kernels.core.backends import Call
    from tile_kernels.core.plan import Target

    for args, match in [
        (("float32", 64, 64), "supports float16 / bfloat16 only"),
        (("bfloat16", 60, 64), "needs K and N multiples of 8"),
        (("bfloat16", 64, 64, 80), "runs on sm_90 .* got sm_80"),
    ]:
        with pytest.raises(ValueError, match=f"grouped_matmul: backend 'tilelang' {match}.*; backend='triton' runs"):
            gm.check_backend("tilelang", *args)
    assert backends.resolve(gm.NAME, None, "cuda") == "triton"  # the platform default; per call: preferred_backend
    for k, n in ((4096, 14336), (14336, 4096)):  # up and down projections
        assert gm.preferred_backend(90, "bfloat16", gm.MIN_TILELANG_ROWS, k, n) == "tilelang"
    for args in [(90, "bfloat16", gm.MIN_TILELANG_ROWS - 1, 4096, 14336), (90, "float32", 16384, 4096, 14336),
                 (90, "bfloat16", 16384, 4100, 14336), (80, "bfloat16", 16384, 4096, 14336),
                 (0, "bfloat16", 16384, 4096, 14336)]:  # fmt: skip
        assert gm.preferred_backend(*args) == "triton", args
    # dx (backward=True) on TileLang from MIN_TILELANG_ROWS tokens on sm_90, whichever of K and N is wider
    for k, n in ((4096, 14336), (14336, 4096)):
        assert gm.preferred_backend(90, "bfloat16", gm.MIN_TILELANG_ROWS, k, n, True) == "tilelang"
    for args in [(90, "bfloat16", gm.MIN_TILELANG_ROWS - 1, 4096, 14336), (90, "float32", 16384, 4096, 14336),
                 (90, "bfloat16", 16384, 4096, 14340), (80, "bfloat16", 16384, 4096, 14336)]:  # fmt: skip
        assert gm.preferred_backend(*args, True) == "triton", args
    target = Target(num_sms=132, cuda_arch=90)
    plan = gm.compiled_forward("tilelang", 300, 256, 512, 8, dtype="bfloat16", arch=90, target=target)
    (call,) = plan.launches
    assert type(call) is Call and call.reads == ("x", "weights", "group_sizes", "out") and call.writes == ("out",)
    assert plan.buffers["out"].zeroed and call.key == "tile_kernels_tilelang_grouped_rows_bfloat16_sm90"
    empty = gm.compiled_forward("tilelang", 300, 0, 512, 8, dtype="bfloat16", arch=90, target=target)
    assert all(type(s) is not Call for s in empty.launches)
    backward = gm.compiled_backward("tilelang", 300, 256, 512, 8, dtype="bfloat16", arch=90, target=target)
    triton = gm.backward(300, 256, 512, 8, dtype="bfloat16", target=target)
    assert (backward.inputs, backward.buffers, backward.outputs) == (triton.inputs, triton.buffers, triton.outputs)
    call, weight_grad = backward.launches
    assert type(call) is Call and call.reads == ("dy", "weights", "group_sizes", "dx") and call.writes == ("dx",)
    assert call.key == "tile_kernels_tilelang_grouped_rows_bcol_bfloat16_sm90" and backward.buffers["dx"].zeroed
    assert weight_grad == triton.launches[1] and weight_grad.kernel is gm.grouped_weight_grad_kernel
    for k, n in ((256, 0), (0, 512)):  # no product to reduce (dx 0), no dx columns: Triton's plan
        empty = gm.compiled_backward("tilelang", 300, k, n, 8, dtype="bfloat16", arch=90, target=target)
        assert all(type(s) is not Call for s in empty.launches)
    with pytest.raises(ValueError, match="grouped_matmul: backend 'tilelang' needs K and N multiples of 8"):
        gm.compiled_backward("tilelang", 300, 256, 500, 8, dtype="bfloat16", arch=90, target=target)


@needs_tilelang
@pytest.mark.parametrize("b_col", [False, True])
def test_tilelang_kernel_lowers_to_warp_specialized_hopper_code(b_col):
    """TMA loads of a and of b_e (a 3-D tensor map, the group as its outer coordinate), wgmma, the group scan in both
    the producer and the consumers, a TMA store of tiles inside their group and stores guarded by the group's end
    for the others."""
    from tile_kernels.core import grouped_matmul_tilelang as tl_gm

    source = tl_gm.lower(tl_gm.kernel_name(b_col), "bfloat16", "bfloat16", tl_gm.target(90)).kernel_source
    for feature in ("tma_load(A_desc", "tma_load(B_desc", "wgmma", "SIZES["):
        assert feature in source, feature
    assert source.count("SIZES[") == 2 and "tma_store(OUT_desc" in source and "OUT[" in source


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("config", sorted(gm.grouped_matmul_tilelang.CONFIGS))
def test_every_tilelang_configuration_matches_the_reference(config):
    """Each TileLang tile configuration (what benchmarks/sweep_grouped_matmul.py times), forward and dx, against the
    float64 reference: groups of 0, 1 and several tiles, K and N past a whole tile of every configuration."""
    import torch

    from tile_kernels.core.registry import round_to
    from tile_kernels.torch import _runtime

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    rng = np.random.default_rng(3)
    sizes, t, k, n = [0, 70, 1, 0, 300], 600, 264, 392
    kwargs = {"x": round_to(rng.standard_normal((t, k)), "bfloat16"),
              "weights": round_to(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), "bfloat16"),
              "group_sizes": np.array(sizes, np.int32)}  # fmt: skip
    dy = round_to(rng.standard_normal((t, n)), "bfloat16")
    x, w, dy_t = (torch.tensor(np.float32(a), device="cuda").bfloat16() for a in (kwargs["x"], kwargs["weights"], dy))
    group_sizes = torch.tensor(kwargs["group_sizes"], device="cuda")
    settings = dict(dtype="bfloat16", arch=90, target=_runtime.target(x.device), tile_config=config)
    forward = _runtime.executor(gm.compiled_forward, "tilelang", t, k, n, len(sizes), **settings)
    backward = _runtime.executor(gm.compiled_backward, "tilelang", t, k, n, len(sizes), **settings)
    (out,) = forward(x, w, group_sizes, device=x.device)
    dx, _ = backward(dy_t, x, w, group_sizes, device=x.device)
    assert_close(f"grouped_matmul {config}", out.double().cpu().numpy(), gm.reference(**kwargs)[0], "bfloat16")
    want = gm.reference_vjp(kwargs, (dy,))["x"]
    assert_close(f"dx {config}", dx.double().cpu().numpy(), want, "bfloat16")


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("framework", sorted(DRIVERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sizes", [[0, 70, 0, 1, 129], [300, 0], [1000, 24, 0, 513], [0, 0, 0]])
def test_tilelang_matches_the_reference(framework, dtype, sizes):
    """Groups of 0, 1, a tile + 1 and several tiles, sums past T and short of it (those rows 0), both frameworks:
    the forward against the float64 reference, and the gradients (dx through the TileLang kernel, dW Triton's)
    through autograd / vjp."""
    import torch

    from tile_kernels.core.registry import round_to

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    rng = np.random.default_rng(sum(sizes))
    t, k, n = 600, 264, 136
    kwargs = {"x": round_to(rng.standard_normal((t, k)), dtype),
              "weights": round_to(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype),
              "group_sizes": np.array(sizes, np.int32)}  # fmt: skip
    driver = DRIVERS[framework]("gpu")
    (out,) = driver.call(gm.NAME, {**kwargs, "backend": "tilelang"})
    (ref,) = gm.reference(**kwargs)
    assert_close("grouped_matmul tilelang", np.asarray(out, np.float64), ref, dtype)
    dy = round_to(rng.standard_normal(ref.shape), dtype)
    _, grads = driver.vjp(gm.NAME, {**kwargs, "backend": "tilelang"}, ("x", "weights"), (dy,))
    want = gm.reference_vjp(kwargs, (dy,))
    for name in ("x", "weights"):
        assert_close(f"d{name}", np.asarray(grads[name], np.float64), want[name], dtype)
