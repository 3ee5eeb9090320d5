"""matmul beyond the registry-driven suite: every operand layout read in place (a Linear weight's .t() is not copied),
the launch configuration per size, the 16-element units that let the loads pipeline, the adapters' guarantees (JAX
jit / vmap, torch opcheck and torch.compile) and the benchmark peers on every epilogue."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_tilelang, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import matmul as mm
from tile_kernels.core.plan import Target

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")


@needs_torch
@pytest.mark.parametrize("a_layout", ["row", "column", "padded"])
@pytest.mark.parametrize("b_layout", ["row", "column", "padded", "strided"])
def test_torch_layouts_read_in_place(a_layout, b_layout):
    """a and b row-major, column-major (transposed views), row-padded, or with no unit stride (copied): the same
    result as the float64 reference; the first three reach the kernel without a copy."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.torch.matmul import _operand

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    rng = np.random.default_rng(0)
    m, k, n = 37, 80, 48

    def laid_out(x: np.ndarray, layout: str):
        t = torch.from_numpy(x).to(dev, torch.float16)
        if layout == "column":
            return t.t().contiguous().t()
        if layout == "padded":
            return torch.nn.functional.pad(t, (0, 16))[:, : x.shape[1]]
        if layout == "strided":  # every other element of both dims: no unit stride
            return torch.from_numpy(np.repeat(np.repeat(x, 2, 0), 2, 1)).to(dev, torch.float16)[::2, ::2]
        return t

    kwargs = mm.sample(rng, (m, n), "float16", bias=True, activation="silu")
    kwargs["a"] = rng.standard_normal((m, k)).astype(np.float16)
    kwargs["b"] = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    a, b = laid_out(kwargs["a"], a_layout), laid_out(kwargs["b"], b_layout)
    for t, layout in ((a, a_layout), (b, b_layout)):
        read, column, _ = _operand(t)
        assert (read.data_ptr() == t.data_ptr()) == (layout != "strided")
        assert column == (layout == "column")
    out = tk.matmul(a, b, torch.from_numpy(kwargs["bias"]).to(dev), "silu")
    assert_close("matmul", out.float().cpu().numpy().astype(np.float64), mm.reference(**kwargs)[0], "float16")


def test_blocks_by_size_and_units():
    """Decode-, mid- and prefill-sized tiles; N, K and the leading dimensions pass in units of 16 when all of them
    allow (so the K mask is constant over 16 elements and the loads pipeline), else as they are."""
    h200 = Target(warp_size=32, num_sms=132, cuda_arch=90)
    assert mm.blocks(1, 4096, 4096, "bfloat16", h200).block_m == 16
    assert mm.blocks(64, 4096, 4096, "bfloat16", h200).block_m == 64
    assert mm.blocks(4096, 4096, 4096, "bfloat16", h200).block_m == 256
    assert mm.blocks(4096, 4096, 4096, "bfloat16", h200, epilogue=True).block_m == 128  # 256 rows spill there
    narrow = mm.blocks(4096, 40, 24, "bfloat16", h200)
    assert (narrow.block_n, narrow.block_k) == (64, 32)
    assert mm.blocks(4096, 4096, 4096, "bfloat16", Target(warp_size=64)).stages == 1

    def unit(**kw):
        (launch,) = mm.forward(dtype="bfloat16", target=h200, **kw).launches
        return launch.constexprs["UNIT"]

    assert unit(m=100, n=4096, k=4096, b_col=True) == 16
    assert unit(m=100, n=4096, k=4104) == 8
    assert unit(m=100, n=4096, k=4095) == 1
    assert mm.forward(0, 8, 8, dtype="float16", target=h200).launches == ()


@needs_jax
def test_jax_jit_and_vmap():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    rng = np.random.default_rng(2)
    shapes = {"a": (3, 6, 40), "b": (3, 40, 24), "bias": (3, 24), "residual": (3, 6, 24)}
    stacked = {x: jnp.asarray(rng.standard_normal(shape), jnp.float32) for x, shape in shapes.items()}

    def f(a, b, bias, residual):
        return tk.matmul(a, b, bias, "gelu", residual)

    one = {x: v[0] for x, v in stacked.items()}
    np.testing.assert_array_equal(jax.jit(f)(**one), f(**one))
    batched = jax.vmap(f)(**stacked)
    for i in range(3):
        ref = mm.reference(**{x: np.asarray(v[i]) for x, v in stacked.items()}, activation="gelu")[0]
        assert_close("matmul vmap", np.asarray(batched[i], np.float64), ref, "float32")


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    utils = OPCHECK_UTILS
    kwargs = mm.sample(np.random.default_rng(3), (5, 48), "float16", bias=True, residual=True)
    a, b, bias, residual = (torch.from_numpy(kwargs[x]).to(dev) for x in ("a", "b", "bias", "residual"))
    ops = torch.ops.tile_kernels
    for op, args in [(ops.matmul_fwd.default, (a, b.t().contiguous().t(), bias, "gelu_tanh", residual)),
                     (ops.matmul.default, (a, b, None, None, None))]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch.compile cannot compile Triton kernels in the interpreter")
def test_torch_compile_fullgraph_matches_eager():
    import torch

    import tile_kernels.torch as tk

    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 32
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def layer(x):
        return tk.matmul(x, w.t(), bias, "silu").sum(-1)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), layer(x))


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("activation", mm.ACTIVATIONS)
def test_bench_peers_on_every_epilogue(framework, activation):
    """The benchmark's torch eager and jax.jit peers compute the same op with every epilogue."""
    from test_bench import _peer

    peer = _peer(framework, mm.NAME)
    for seed in range(2):
        kwargs = mm.sample(np.random.default_rng(seed), (3, 40), "float32", bias=bool(seed), activation=activation,
                           residual=True)  # fmt: skip
        np.testing.assert_allclose(peer(kwargs)[0], mm.reference(**kwargs)[0], rtol=2e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ the TileLang backend


def test_tilelang_backend_refuses_what_it_cannot_run():
    """Clear errors (ValueError naming the backend and the feature) for float32, unaligned rows and GPUs other than
    Hopper; backend=None's choice; its plan: one Call reading the epilogue's operands, or the Triton plan for an empty
    product."""
    from tile_kernels.core.backends import Call
    from tile_kernels.core.plan import Launch

    for args, match in [
        (("float32", 64, 64), "supports float16 / bfloat16 only"),
        (("bfloat16", 60, 64), "needs K and N multiples of 8"),
        (("bfloat16", 64, 60), "needs K and N multiples of 8"),  # the output's TMA store, whatever b's layout
        (("bfloat16", 64, 64, 80), "runs on sm_90 \\(Hopper: wgmma, TMA\\) only, got sm_80"),
    ]:
        with pytest.raises(ValueError, match=f"matmul: backend 'tilelang' {match}.*; backend='triton' runs it"):
            mm.check_backend("tilelang", *args)
    mm.check_backend("tilelang", "bfloat16", 64, 64, 90)
    assert mm.preferred_backend(90, "bfloat16", 4096, 4096, 4096) == "tilelang"
    shape = (4096, 4096, 4096)
    for args in [(90, "bfloat16", 64, 4096, 4096), (90, "float32", *shape), (80, "bfloat16", *shape),
                 (90, "bfloat16", 4096, 4100, 4096), (90, "bfloat16", 4096, 4096, 50257),
                 (0, "bfloat16", *shape)]:  # fmt: skip
        assert mm.preferred_backend(*args) == "triton", args
    target = Target(num_sms=132, cuda_arch=90)
    plan = mm.compiled_forward("tilelang", 300, 2048, 1024, dtype="bfloat16", b_col=True, arch=90, target=target)
    assert [type(s) for s in plan.launches] == [Call] and plan.launches[0].reads == ("a", "b")
    assert plan.launches[0].key == "tile_kernels_tilelang_matmul_bcol_bfloat16_sm90"
    plan = mm.compiled_forward("tilelang", 300, 2048, 1024, dtype="float16", b_col=False, arch=90, target=target,
                               activation="gelu_tanh", has_bias=True, has_residual=True)  # fmt: skip
    assert plan.launches[0].reads == tuple(plan.inputs) == ("a", "b", "bias", "residual")
    assert plan.launches[0].key == "tile_kernels_tilelang_matmul_bias_gelutanh_res_float16_sm90"
    empty = mm.compiled_forward("tilelang", 300, 2048, 0, dtype="float16", b_col=False, arch=90, target=target,
                                activation="silu", has_residual=True)  # fmt: skip
    assert all(isinstance(s, Launch) for s in empty.launches)  # Triton's kernel writes act(0) + residual
    assert tuple(empty.inputs) == ("a", "b", "residual")


def test_tilelang_kernel_names_round_trip():
    from tile_kernels.core import matmul_tilelang as tl_mm

    for b_col, config, bias, activation, residual in itertools.product(
        (False, True), tl_mm.CONFIGS, (False, True), mm.ACTIVATIONS, (False, True)
    ):
        name = tl_mm.kernel_name(b_col, config, bias, activation, residual)
        assert tl_mm._parse(name) == (b_col, config, bias, activation, residual), name


@needs_torch
@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's error")
def test_tilelang_backend_on_the_cpu_is_a_clear_error():
    import torch

    import tile_kernels.torch as tk

    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="matmul: backend 'tilelang' cannot run on the CPU"):
        tk.matmul(a, a.t(), backend="tilelang")


@needs_tilelang
@pytest.mark.parametrize("b_col, epilogue", [(False, False), (True, False), (False, True)])
def test_tilelang_kernel_lowers_to_warp_specialized_hopper_code(b_col, epilogue):
    """TMA loads, wgmma and a producer warp group (register reallocation) in the lowered sm_90a source; with the
    epilogue (bias, gelu_tanh, residual), its exponential and the bias and residual reads."""
    from tile_kernels.core import matmul_tilelang as tl_mm

    kernel = tl_mm.kernel_name(b_col, tl_mm.DEFAULT_CONFIG, epilogue, "gelu_tanh" if epilogue else None, epilogue)
    source = tl_mm.lower(kernel, "bfloat16", "bfloat16", tl_mm.target(90)).kernel_source
    for feature in ("tma_load", "wgmma", "warpgroup_reg_alloc", "tma_store") + ("expf", "BIAS[", "RES[") * epilogue:
        assert feature in source, feature


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("framework", sorted(DRIVERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m, k, n", [(1, 256, 8), (300, 1032, 520), (4096, 4096, 4096), (129, 264, 256)])
@pytest.mark.parametrize("epilogue", [{}, {"bias": True, "activation": "silu", "residual": True},
                                      {"bias": True, "activation": "gelu"}, {"activation": "gelu_tanh"},
                                      {"residual": True}])  # fmt: skip
def test_tilelang_matches_the_reference(framework, dtype, m, k, n, epilogue):
    """Edges of every tile dimension (M, N, K not multiples of the tiles), each part of the epilogue, b row-major
    (both frameworks) and a Linear weight's .t() (torch)."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    kwargs = mm.sample(np.random.default_rng(m + k + n), (m, k, n), dtype, **epilogue)
    want = mm.reference(**kwargs)[0]
    out = DRIVERS[framework]("gpu").call("matmul", {**kwargs, "backend": "tilelang"})[0]
    assert_close("matmul tilelang", out, want, dtype)
    if framework == "torch":
        import tile_kernels.torch as tk

        a = torch.from_numpy(kwargs["a"].astype(np.float32)).to("cuda", getattr(torch, dtype))
        w = torch.from_numpy(kwargs["b"].T.astype(np.float32)).to("cuda", getattr(torch, dtype)).contiguous()
        extra = {name: torch.from_numpy(kwargs[name].astype(np.float32)).to("cuda", a.dtype)
                 for name in ("bias", "residual") if kwargs[name] is not None}  # fmt: skip
        extra["activation"] = kwargs["activation"]
        got = tk.matmul(a, w.t(), **extra, backend="tilelang").double().cpu().numpy()
        assert_close("matmul tilelang, b = W.t()", got, want, dtype)

        def layer(a):
            return tk.matmul(a, w.t(), **extra, backend="tilelang")

        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(a), layer(a))
