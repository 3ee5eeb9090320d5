"""fp8_matmul beyond the registry-driven suite: a_scales read in place in either layout
(column-major is common), a misplaced scale caught, the tiles per size, the GPUs it refuses, the adapters'
guarantees (JAX jit / vmap, torch opcheck and torch.compile) and the cuBLAS FP8 peers."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_tilelang, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import fp8_matmul as f8
from tile_kernels.core.plan import Target

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
DEV = "cuda" if DEVICE == "gpu" else "cpu"


def _torch(kwargs):
    from tile_kernels.torch.bench import _tensor

    return [_tensor(kwargs[x], DEV) for x in ("a", "a_scales", "b", "b_scales")]


@needs_torch
@pytest.mark.parametrize("scales_layout", ["row", "column"])
@pytest.mark.parametrize("a_layout", ["compact", "padded"])
def test_torch_layouts_read_in_place(scales_layout, a_layout):
    """a_scales row- or column-major and a with padded rows reach the kernel in place, with the reference's result."""
    import torch

    import tile_kernels.torch as tk

    kwargs = f8.sample(np.random.default_rng(1), (37, 256, 256), "float32")
    a, a_scales, b, b_scales = _torch(kwargs)
    if scales_layout == "column":
        a_scales = a_scales.t().contiguous().t()
        assert a_scales.stride() == (1, 37)
    if a_layout == "padded":
        wide = torch.zeros(37, 384, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        wide[:, :256] = a
        a = wide[:, :256]
    out = tk.fp8_matmul(a, a_scales, b, b_scales, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close("fp8_matmul", out.cpu().double().numpy(), f8.reference(**kwargs)[0], "float32", f8.slack(kwargs)[0])


def test_scales_are_applied_per_block():
    """A scale moved to the wrong block (a's second K block, b's second N block) changes the reference, so the
    suite's comparison would see a kernel that misplaced it."""
    kwargs = f8.sample(np.random.default_rng(3), (4, 256, 256), "float32")
    ref = f8.reference(**kwargs)[0]
    a_scales, b_scales = kwargs["a_scales"].copy(), kwargs["b_scales"].copy()
    a_scales[:, 1] *= 2.0
    b_scales[1, :] *= 2.0
    for moved in ({"a_scales": a_scales}, {"b_scales": b_scales}):
        assert not np.allclose(f8.reference(**{**kwargs, **moved})[0], ref)


def test_blocks_and_targets():
    h200 = Target(warp_size=32, num_sms=132, cuda_arch=90)
    assert [f8.blocks(m, h200).block_m for m in (1, 16, 64, 4096)] == [16, 16, 64, 128]
    (launch,) = f8.forward(300, 256, 512, out_dtype="bfloat16", target=h200).launches
    assert launch.constexprs["UNIT"] == 16 and launch.grid == (3 * 2,)
    assert f8.forward(300, 256, 0, out_dtype="bfloat16", target=h200).launches == ()
    with pytest.raises(RuntimeError, match="compute capability 8.9 or newer, got 8.0"):
        f8.forward(16, 128, 128, out_dtype="bfloat16", target=Target(cuda_arch=80))
    assert list(f8.plans(Target(cuda_arch=80))) == [] and list(f8.plans(Target(warp_size=64))) == []
    assert len(list(f8.plans(h200))) == 10


@needs_jax
def test_jax_jit_and_vmap():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    examples = [f8.sample(np.random.default_rng(s), (5, 256, 128), "float32") for s in range(3)]
    names = ("a", "a_scales", "b", "b_scales")
    stacked = {x: jnp.asarray(np.stack([e[x] for e in examples])) for x in names}

    def f(a, a_scales, b, b_scales):
        return tk.fp8_matmul(a, a_scales, b, b_scales, out_dtype=jnp.float32)

    one = {x: v[0] for x, v in stacked.items()}
    np.testing.assert_array_equal(jax.jit(f)(**one), f(**one))
    batched = jax.vmap(f)(**stacked)
    assert batched.dtype == jnp.float32
    for i, e in enumerate(examples):
        assert_close("fp8_matmul vmap", np.asarray(batched[i], np.float64), f8.reference(**e)[0], "float32",
                     f8.slack(e)[0])  # fmt: skip


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    a, a_scales, b, b_scales = _torch(f8.sample(np.random.default_rng(4), (5, 256, 128), "bfloat16"))
    ops = torch.ops.tile_kernels
    for op, args in [(ops.fp8_matmul_fwd.default, (a, a_scales.t().contiguous().t(), b, b_scales, "bfloat16")),
                     (ops.fp8_matmul.default, (a, a_scales, b, b_scales, torch.float16))]:  # fmt: skip
        # test_schema compares the inputs before and after by arithmetic torch lacks for float8 tensors
        result = torch.library.opcheck(op, args, test_utils=tuple(u for u in OPCHECK_UTILS if u != "test_schema"))
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch.compile cannot compile Triton kernels in the interpreter")
def test_torch_compile_fullgraph_matches_eager():
    import torch

    import tile_kernels.torch as tk

    a, a_scales, b, b_scales = _torch(f8.sample(np.random.default_rng(5), (300, 1024, 2048), "bfloat16"))

    def layer(a):
        return tk.fp8_matmul(a, a_scales, b, b_scales).float().sum(-1)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(a), layer(a))


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch._scaled_mm runs on GPUs")
def test_scaled_mm_peer_with_block_scales_matches():
    """The benchmark's cuBLAS peer computes the same op, so its time is comparable."""
    import torch

    from tile_kernels.torch.bench import _scaled_mm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("block-scaled torch._scaled_mm needs sm_90")
    kwargs = f8.sample(np.random.default_rng(6), (256, 512, 384), "bfloat16")
    out = _scaled_mm(True)(*_torch(kwargs), out_dtype="bfloat16")
    assert_close("torch._scaled_mm", out.double().cpu().numpy(), f8.reference(**kwargs)[0], "bfloat16")


def test_tilelang_backend_plan_and_refusals():
    """backend="tilelang": a clear error off Hopper; its plan one Call over the four operands, or Triton's zeros for
    an empty product; backend=None picks it on Hopper from MIN_TILELANG_ROWS rows."""
    from tile_kernels.core import backends
    from tile_kernels.core.backends import Call

    with pytest.raises(ValueError, match="fp8_matmul: backend 'tilelang' runs on sm_90 .* got sm_89; backend='triton'"):
        f8.check_backend("tilelang", 89)
    assert backends.resolve(f8.NAME, None, "cuda") == "triton"  # the platform default; per call: preferred_backend
    assert f8.preferred_backend(90, f8.MIN_TILELANG_ROWS) == "tilelang"
    for args in [(90, f8.MIN_TILELANG_ROWS - 1), (89, 4096), (100, 4096), (0, 4096)]:
        assert f8.preferred_backend(*args) == "triton", args
    target = Target(num_sms=132, cuda_arch=90)
    plan = f8.compiled_forward("tilelang", 300, 256, 512, out_dtype="float32", arch=90, target=target)
    assert [type(s) for s in plan.launches] == [Call] and plan.launches[0].reads == tuple(plan.inputs)
    assert plan.launches[0].key == "tile_kernels_tilelang_fp8_matmul_n128_float32_sm90"  # 3 x 2 tiles
    assert f8.compiled_forward("tilelang", 0, 256, 512, out_dtype="bfloat16", arch=90, target=target).launches == ()


@needs_tilelang
@pytest.mark.parametrize("config", sorted(f8.fp8_matmul_tilelang.CONFIGS))
def test_tilelang_kernel_lowers_to_warp_specialized_hopper_code(config):
    """TMA loads, e4m3 wgmma of 64 x 128 (a warp group per 64 rows; one per 128-column half of the tile), a producer
    warp group with register reallocation, a TMA store per half."""
    from tile_kernels.core import fp8_matmul_tilelang as tl_f8

    source = tl_f8.lower(tl_f8.kernel_name(config), "float8_e4m3fn", "bfloat16", tl_f8.target(90)).kernel_source
    halves = tl_f8.CONFIGS[config][0] // tl_f8.BLOCK
    for feature in ("tma_load", "warpgroup_reg_alloc"):
        assert feature in source, feature
    assert source.count("kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 128, 32") == halves
    assert source.count("tl::tma_store(") == halves


def test_tilelang_configuration_fills_the_sms():
    """128 x 128 tiles while they fit one wave of the SMs, 128 x 256 beyond."""
    from tile_kernels.core import fp8_matmul_tilelang as tl_f8

    assert tl_f8.config_for(256, 4096, 132) == tl_f8.config_for(1024, 2048, 132) == "n128"  # 64, 128 tiles
    assert tl_f8.config_for(1024, 4096, 132) == tl_f8.config_for(8192, 8192, 132) == tl_f8.DEFAULT_CONFIG == "n256"
    assert tl_f8.config_for(1024, 4096, 256) == "n128"


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("config", sorted(f8.fp8_matmul_tilelang.CONFIGS))
@pytest.mark.parametrize("shape, seed, blocks", [((300, 256), 2, 1), ((129, 384, 128), 0, 3), ((256, 1024, 384), 0, 8)])
def test_tilelang_configurations_match_the_reference(config, shape, seed, blocks):
    """Each configuration against the float64 reference: one (sample draws K for a 2-D shape: 128 with seed 2), an odd
    and an even number of K blocks, rows past a tile, a 256-column tile's right half past N (128 and 384 columns)."""
    import torch

    from tile_kernels.torch._runtime import Executor, target

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    kwargs = f8.sample(np.random.default_rng(seed), shape, "bfloat16")
    (m, k), n = kwargs["a"].shape, kwargs["b"].shape[0]
    assert k == blocks * f8.BLOCK, f"sample drew K = {k}: pick the seed again"
    operands = _torch(kwargs)
    plan = f8.compiled_forward("tilelang", m, n, k, out_dtype="bfloat16", arch=90, target=target(operands[0].device),
                               tile_config=config)  # fmt: skip
    out = Executor(plan)(*operands, device=operands[0].device)[0]
    want = f8.reference(**kwargs)[0]
    assert_close(f"fp8_matmul tilelang {config}", out.double().cpu().numpy(), want, "bfloat16", f8.slack(kwargs)[0])


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("framework", sorted(DRIVERS))
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("m, k, n", [(1, 128, 128), (300, 384, 256), (4096, 1024, 2048), (129, 256, 384)])
def test_tilelang_matches_the_reference(framework, out_dtype, m, k, n):
    """Rows past a tile (M not a multiple of 128), one to many K blocks and N tiles, both frameworks; in torch also a
    column-major a_scales (copied) and torch.compile."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    kwargs = f8.sample(np.random.default_rng(m + k + n), (m, k, n), out_dtype)
    want = f8.reference(**kwargs)[0]
    out = DRIVERS[framework]("gpu").call("fp8_matmul", {**kwargs, "backend": "tilelang"})[0]
    assert_close("fp8_matmul tilelang", out, want, out_dtype, f8.slack(kwargs)[0])
    if framework == "torch":
        import tile_kernels.torch as tk

        a, a_scales, b, b_scales = _torch(kwargs)
        a_scales = a_scales.t().contiguous().t()

        def layer(a):
            return tk.fp8_matmul(a, a_scales, b, b_scales, out_dtype=getattr(torch, out_dtype), backend="tilelang")

        got = layer(a).double().cpu().numpy()
        assert_close("fp8_matmul tilelang, column-major a_scales", got, want, out_dtype, f8.slack(kwargs)[0])
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(a), layer(a))
