"""dequant_matmul beyond the registry-driven suite: the packing convention (code k = 8 i + j in bits 4j .. 4j + 3,
unsigned, high nibbles included), the weights themselves recovered through an identity, and the adapters' guarantees
(JAX jit / vmap, torch opcheck and torch.compile), and the benchmark peers on every option."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, assert_in_order, needs_tilelang, needs_torch
from drivers import DRIVERS

from tile_kernels.core import dequant_matmul as dm
from tile_kernels.core.registry import round_to

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")


def test_packing_convention():
    """0x76543210 holds codes 0 .. 7 low nibble first; 0xFEDCBA98 (negative as int32) holds 8 .. 15."""
    qweight = np.array([[0x76543210, 0], [np.uint32(0xFEDCBA98).view(np.int32), 0]], np.int32)
    assert dm.codes(qweight)[:, 0].tolist() == list(range(16))
    codes = np.random.default_rng(0).integers(0, 16, (24, 5))
    assert np.array_equal(dm.codes(dm.pack(codes)), codes)


@pytest.mark.parametrize("zeros, group_size", [(False, 8), (True, 16), (True, 32)])
def test_identity_recovers_the_weights(driver, zeros, group_size):
    """a = I (K x K): the output is W itself, exactly (each output sums one product), for every code and group."""
    rng = np.random.default_rng(1)
    k, n = 32, 40
    groups = (k // group_size, n)
    kwargs = dict(a=round_to(np.eye(k), "bfloat16"), qweight=dm.pack(rng.integers(0, 16, (k, n))),
                  scales=round_to(rng.uniform(-2, 2, groups), "bfloat16"), group_size=group_size,
                  zeros=round_to(rng.integers(0, 16, groups).astype(float), "bfloat16") if zeros else None)  # fmt: skip
    (out,) = driver.call(dm.NAME, kwargs)
    np.testing.assert_array_equal(out, dm.weight(kwargs["qweight"], kwargs["scales"], group_size, kwargs["zeros"]))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "m, group_size, zeros",
    [
        (1, 128, False),
        (1, 8, True),
        (2, 64, True),
        (3, 64, True),
        (4, 128, False),
        (16, 256, True),
        (16, 8, False),
        (17, 128, True),
    ],
)
def test_decode_sizes_split_k(driver, dtype, m, group_size, zeros):
    """Decode-sized rows: the FMA kernel (one or two rows) and the tensor-core one (a product per nibble where steps
    are 128 deep), K split over programs (partial products summed after) and not, against the float64 reference;
    which plan each size gets (the CPU's target has 4 SMs)."""
    from tile_kernels.core.plan import Target

    k, n = 512, 200
    b = dm.blocks(m, n, k, group_size, dtype, Target(32, 4))
    assert b.gemv == (m <= 2), b
    assert (b.split_k > 1) == (m <= 2 or (m <= 16 and dtype != "float32" and group_size % b.block_k == 0)), b
    kwargs = dm.sample(np.random.default_rng(m), (m, k, n), dtype, zeros=zeros, group_size=group_size)
    (out,) = driver.call(dm.NAME, kwargs)
    (ref,) = dm.reference(**kwargs)
    tol = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("dtype, zeros", [("bfloat16", False), ("float16", True)])
def test_prefill_rows_dequantize_first(driver, dtype, zeros):
    """From DEQUANTIZE_FIRST_ROWS rows the default plan forms W, then runs the framework's GEMM (torch.mm, XLA's
    dot): against the float64 reference through each framework."""
    m, k, n = dm.DEQUANTIZE_FIRST_ROWS, 256, 200
    kwargs = dm.sample(np.random.default_rng(m), (m, k, n), dtype, zeros=zeros, group_size=64)
    (out,) = driver.call(dm.NAME, kwargs)
    (ref,) = dm.reference(**kwargs)
    tol = {"float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


def _run_tiles(tiles, m, k, n, group_size, dtype, zeros, seed, tol):
    """dequant_matmul with the launch configuration `tiles` against the float64 reference (relative to its largest
    entry); returns the plan's first launch. On a GPU the plan is built for its target, else for a 4-SM one."""
    import torch

    from tile_kernels.core.plan import Target
    from tile_kernels.torch import _runtime

    kwargs = dm.sample(np.random.default_rng(seed), (m, k, n), dtype, zeros=zeros, group_size=group_size)
    dev = "cuda" if DEVICE == "gpu" else "cpu"
    names = ("a", "qweight", "scales") + (("zeros",) if zeros else ())
    args = [torch.from_numpy(kwargs[n] if n == "qweight" else np.asarray(kwargs[n], np.float32)) for n in names]
    args = [(t if t.dtype == torch.int32 else t.to(getattr(torch, dtype))).to(dev) for t in args]
    target = _runtime.target(args[0].device) if DEVICE == "gpu" else Target(num_sms=4)
    plan = dm.forward(m, n, k, dtype=dtype, group_size=group_size, has_zeros=zeros, target=target, tiles=tiles)
    (out,) = _runtime.Executor(plan)(*args, device=args[0].device)
    (ref,) = dm.reference(**kwargs)
    np.testing.assert_allclose(out.double().cpu().numpy(), ref, rtol=tol, atol=tol * np.abs(ref).max())
    return plan.launches[0]


@needs_torch
@pytest.mark.parametrize("dtype, zeros", [("bfloat16", False), ("float16", True), ("float32", True)])
@pytest.mark.parametrize("m, rows, block_n, warps, split_k", [(1, 1, 128, 1, 3), (3, 2, 256, 1, 1), (3, 4, 128, 2, 5)])
def test_gemv_tiles(dtype, zeros, m, rows, block_n, warps, split_k):
    """dequant_gemv_kernel at 4 and 8 columns a thread, 1, 2 or 4 rows a program (3 rows of `a`: a program with rows
    past M), 2 steps a group, K split unevenly (14 steps over 3 or 5 programs: the last takes fewer), N not a
    multiple of the tile, against the float64 reference."""
    tiles = dm.Blocks(rows, block_n, 32, warps, 1, split_k, gemv=True)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    launch = _run_tiles(tiles, m, 448, 200, 64, dtype, zeros, block_n + split_k, tol)
    assert launch.kernel is dm.dequant_gemv_kernel and launch.constexprs["SPLIT_K"] == split_k


@needs_torch
@pytest.mark.parametrize("dtype, zeros", [("bfloat16", False), ("float16", True), ("float32", True)])
@pytest.mark.parametrize("m, block_n, block_k, group_size", [(1, 64, 128, 64), (37, 128, 64, 64), (5, 32, 32, 64)])
def test_dequantize_first_tiles(dtype, zeros, m, block_n, block_k, group_size):
    """dequantize_kernel then the framework's GEMM: W's tiles past K (448 rows: the last block part-filled) and past
    N (200 columns), groups narrower, as wide as and wider than a tile, against the float64 reference; the default
    from DEQUANTIZE_FIRST_ROWS rows of 16-bit a."""
    from tile_kernels.core.plan import Gemm, Target

    tiles = dm.Blocks(m, block_n, block_k, 4, 1, dequantize_first=True)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    launch = _run_tiles(tiles, m, 448, 200, group_size, dtype, zeros, m + block_n, tol)
    assert launch.kernel is dm.dequantize_kernel
    plan = dm.forward(m, 200, 448, dtype=dtype, group_size=64, has_zeros=zeros, target=Target(num_sms=4), tiles=tiles)
    assert isinstance(plan.launches[1], Gemm) and plan.buffers["weight"].shape == (448, 200)
    rows = dm.DEQUANTIZE_FIRST_ROWS
    for d, first in [("bfloat16", True), ("float16", True), ("float32", False)]:
        assert dm.blocks(rows, 4096, 4096, 128, d, Target(num_sms=132)).dequantize_first == first, d
    assert not dm.blocks(rows - 1, 4096, 4096, 128, "bfloat16", Target(num_sms=132)).dequantize_first


@needs_torch
@pytest.mark.parametrize("dtype, zeros", [("bfloat16", False), ("float16", True), ("bfloat16", True)])
@pytest.mark.parametrize(
    "m, block_n, block_k, group_size, split_k",
    [(1, 64, 64, 64, 1), (5, 64, 64, 128, 3), (16, 128, 128, 128, 2), (19, 64, 64, 64, 5)],
)
def test_transposed_tiles(dtype, zeros, m, block_n, block_k, group_size, split_k):
    """dequant_matmul_t_kernel: one row of `a`, a part-filled and a full 16-row tile, rows past one tile (19),
    2 steps a group, K split unevenly (7 steps over 3 programs, or 5 with an empty last), N not a multiple of the
    tile (200: the last column block overlaps its neighbour), against the float64 reference; on a GPU its asm
    loads."""
    import torch

    tiles = dm.Blocks(16, block_n, block_k, 4, 1, split_k, transposed=True)
    k = 448 if group_size == 64 else 512
    launch = _run_tiles(
        tiles, m, k, 200, group_size, dtype, zeros, m + split_k, {"float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    )
    assert launch.kernel is dm.dequant_matmul_t_kernel and launch.constexprs["SPLIT_K"] == split_k
    assert launch.constexprs["ASM"] == (DEVICE == "gpu" and torch.version.hip is None)


def test_transposed_tiles_reject_float32():
    from tile_kernels.core.plan import Target

    tiles = dm.Blocks(16, 64, 64, 4, 1, transposed=True)
    with pytest.raises(ValueError, match="transposed tiles take 16-bit a.*got float32"):
        dm.forward(4, 64, 128, dtype="float32", group_size=64, has_zeros=False, target=Target(num_sms=4), tiles=tiles)


@needs_jax
def test_jax_jit_and_vmap():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    base = dm.sample(np.random.default_rng(2), (5, 48), "float32", zeros=True, group_size=32)
    problems = [
        {"a": base["a"] * (1 + i), "qweight": np.roll(base["qweight"], i, axis=1),
         "scales": base["scales"] * (1 - 0.25 * i), "zeros": np.roll(base["zeros"], i)}
        for i in range(3)
    ]  # fmt: skip
    stacked = {k: jnp.stack([p[k] for p in problems]) for k in ("a", "qweight", "scales", "zeros")}

    def f(a, qweight, scales, zeros):
        return tk.dequant_matmul(a, qweight, scales, 32, zeros)

    one = {k: v[0] for k, v in stacked.items()}
    np.testing.assert_array_equal(jax.jit(f)(**one), f(**one))
    batched = jax.vmap(f)(**stacked)
    for i in range(len(problems)):
        np.testing.assert_allclose(batched[i], f(**{k: v[i] for k, v in stacked.items()}), rtol=1e-6, atol=1e-6)


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    utils = OPCHECK_UTILS
    kwargs = dm.sample(np.random.default_rng(3), (5, 48), "float16", zeros=True, group_size=32)
    a, qweight, scales, zeros = (torch.from_numpy(kwargs[k]).to(dev) for k in ("a", "qweight", "scales", "zeros"))
    # W formed first (a plan Gemm step) from DEQUANTIZE_FIRST_ROWS rows
    wide = dm.sample(np.random.default_rng(3), (dm.DEQUANTIZE_FIRST_ROWS, 64, 24), "float16", group_size=32)
    a2, qweight2, scales2 = (torch.from_numpy(wide[k]).to(dev) for k in ("a", "qweight", "scales"))
    ops = torch.ops.tile_kernels
    for op, args in [(ops.dequant_matmul_fwd.default, (a, qweight, scales, 32, zeros)),
                     (ops.dequant_matmul.default, (a, qweight, scales, 32, None)),
                     (ops.dequant_matmul_fwd.default, (a2, qweight2, scales2, 32, None))]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch.compile cannot compile Triton kernels in the interpreter")
@pytest.mark.parametrize("m", [1, dm.DEQUANTIZE_FIRST_ROWS])
def test_torch_compile_fullgraph_matches_eager(m):
    """A GEMV and the W-formed-first plan (its Gemm step traced as torch.mm) under torch.compile(fullgraph=True)."""
    import torch

    import tile_kernels.torch as tk

    kwargs = dm.sample(np.random.default_rng(4), (m, 1024, 2048), "bfloat16", zeros=True, group_size=128)
    a, qweight, scales, zeros = (torch.from_numpy(np.asarray(kwargs[k], np.float32) if k != "qweight" else kwargs[k])
                                 for k in ("a", "qweight", "scales", "zeros"))  # fmt: skip
    a, scales, zeros = (t.to("cuda", torch.bfloat16) for t in (a, scales, zeros))
    qweight = qweight.cuda()

    def layer(a):
        return torch.nn.functional.silu(tk.dequant_matmul(a, qweight, scales, 128, zeros))

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(a), layer(a))


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("options", [dict(zeros=True, group_size=32), dict(zeros=False, group_size=8)])
def test_bench_peers_on_every_option(framework, options):
    """The benchmark's torch eager and jax.jit peers compute the same op with zeros and small groups too."""
    from test_bench import _peer

    peer = _peer(framework, dm.NAME)
    for seed in range(3):
        kwargs = dm.sample(np.random.default_rng(seed), (3, 40), "float32", **options)
        np.testing.assert_allclose(peer(kwargs)[0], dm.reference(**kwargs)[0], rtol=2e-5, atol=1e-5)


def test_round_to_models_the_kernels_weight_rounding():
    """The reference rounds W to a's dtype, as a dequantize-then-multiply does (and the prefill kernel)."""
    kwargs = dm.sample(np.random.default_rng(5), (2, 16), "bfloat16", group_size=8)
    w = dm.weight(kwargs["qweight"], kwargs["scales"], 8)
    assert np.array_equal(w, round_to(w, "bfloat16").astype(np.float64))


def test_tilelang_backend_plan_and_refusals():
    """backend="tilelang": clear errors for float32, N not a multiple of 8, group sizes that split a K step and GPUs
    other than Hopper; its plan one Call (the group size in its key), or Triton's zeros for an empty product;
    backend=None stays Triton (measured faster)."""
    from tile_kernels.core import backends
    from tile_kernels.core.backends import Call
    from tile_kernels.core.plan import Target

    for args, match in [
        (("float32", 256, 128), "supports float16 / bfloat16 only"),
        (("bfloat16", 260, 128), "needs N a multiple of 8"),
        (("bfloat16", 256, 32), "needs group_size a multiple of 64"),
        (("float16", 256, 128, 80), "runs on sm_90 .* got sm_80"),
    ]:
        with pytest.raises(ValueError, match=f"dequant_matmul: backend 'tilelang' {match}.*; backend='triton' runs"):
            dm.check_backend("tilelang", *args)
    assert backends.resolve(dm.NAME, None, "cuda") == "triton"
    target = Target(num_sms=132, cuda_arch=90)
    plan = dm.compiled_forward("tilelang", 4096, 512, 1024, dtype="bfloat16", group_size=64, has_zeros=True, arch=90,
                               target=target)  # fmt: skip
    assert [type(s) for s in plan.launches] == [Call]
    assert plan.launches[0].reads == tuple(plan.inputs) == ("a", "qweight", "scales", "zeros")
    assert plan.launches[0].key == "tile_kernels_tilelang_dequant_matmul_zeros_g64_bfloat16_sm90"
    empty = dm.compiled_forward("tilelang", 0, 512, 1024, dtype="float16", group_size=128, has_zeros=False, arch=90,
                                target=target)  # fmt: skip
    assert empty.launches == () and empty.buffers["out"].zeroed


@needs_tilelang
@pytest.mark.parametrize("zeros", [False, True])
def test_tilelang_kernel_lowers_to_warp_specialized_hopper_code(zeros):
    """TMA loads (a, the packed codes and the step's scales and zeros), wgmma of 64 x 128 from the dequantized shared
    tile, a producer warp group with register reallocation, a TMA store."""
    from tile_kernels.core import dequant_matmul_tilelang as tl_dm

    source = tl_dm.lower(tl_dm.kernel_name(zeros), "bfloat16", "bfloat16", tl_dm.target(90)).kernel_source
    for feature in ("tma_load", "kBFloat16, tl::DataType::kFloat32, 64, 128, 16", "warpgroup_reg_alloc", "tma_store",
                    "tma_load(S_desc") + ("tma_load(Z_desc",) * zeros:  # fmt: skip
        assert feature in source, feature


@needs_tilelang
def test_tilelang_paired_schedule_unpacks_beside_the_previous_steps_wgmma():
    """The PAIRED configuration (explicit warp-specialization schedule): per step, wait for all but the last wgmma
    (the one that read the step's consumer-owned tiles is in), copy a and unpack the codes into them, release the
    stage, issue the step's wgmma; no full wait inside the loop."""
    from tile_kernels.core import dequant_matmul_tilelang as tl_dm

    source = tl_dm.lower(tl_dm.kernel_name(True, "paired"), "bfloat16", "bfloat16", tl_dm.target(90)).kernel_source
    loop = source[source.index("for (int t = 0;") : source.index("tl::wait_wgmma<0>();")]
    steps = ("even_full[", "wait_wgmma<1>", "a_own", "even_empty[", "wgmma_ss<", "odd_full[", "wait_wgmma<1>", "a_odd",
             "odd_empty[", "wgmma_ss<")  # fmt: skip
    assert_in_order(loop, steps)
    assert loop.count("wait_wgmma<") == 2 and "warpgroup_wait<" not in loop


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("config", [c for c in sorted(dm.dequant_matmul_tilelang.CONFIGS) if c != "default"])
@pytest.mark.parametrize("m, k, n, group_size, zeros", [(300, 640, 520, 64, True), (129, 1024, 384, 128, False)])
def test_tilelang_configurations_match_the_reference(config, m, k, n, group_size, zeros):
    """Each non-default configuration (the sweep's candidates) against the float64 reference: rows and columns past
    a tile, an odd number of 64-deep K steps (the paired schedule's last step past K), groups of 64 and 128."""
    import torch
    from test_ops import assert_close

    from tile_kernels.torch._runtime import Executor, target
    from tile_kernels.torch.bench import _tensor

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    kwargs = dm.sample(np.random.default_rng(m + k + n), (m, k, n), "bfloat16", zeros=zeros, group_size=group_size)
    names = ("a", "qweight", "scales") + (("zeros",) if zeros else ())
    operands = [_tensor(kwargs[name], "cuda") for name in names]
    plan = dm.compiled_forward("tilelang", m, n, k, dtype="bfloat16", group_size=group_size, has_zeros=zeros,
                               arch=90, target=target(operands[0].device), tile_config=config)  # fmt: skip
    out = Executor(plan)(*operands, device=operands[0].device)[0]
    assert_close(f"dequant_matmul tilelang {config}", out.double().cpu().numpy(), dm.reference(**kwargs)[0],
                 "bfloat16")  # fmt: skip


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on Hopper GPUs")
@pytest.mark.parametrize("framework", sorted(DRIVERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "m, k, n, group_size, zeros",
    [(1, 128, 8, 128, False), (300, 640, 520, 64, True), (4096, 4096, 4096, 128, False), (129, 256, 384, 128, True)],
)
def test_tilelang_matches_the_reference(framework, dtype, m, k, n, group_size, zeros):
    """Rows and columns past a tile, one to many groups, with and without zeros, both frameworks; in torch also
    torch.compile."""
    import torch
    from test_ops import assert_close

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernel is written for sm_90")
    kwargs = dm.sample(np.random.default_rng(m + k + n), (m, k, n), dtype, zeros=zeros, group_size=group_size)
    want = dm.reference(**kwargs)[0]
    out = DRIVERS[framework]("gpu").call(dm.NAME, {**kwargs, "backend": "tilelang"})[0]
    assert_close("dequant_matmul tilelang", out, want, dtype)
    if framework == "torch":
        import tile_kernels.torch as tk
        from tile_kernels.torch.bench import _tensor

        args = {
            name: _tensor(kwargs[name], "cuda")
            for name in ("a", "qweight", "scales", "zeros")
            if kwargs[name] is not None
        }

        def layer(a):
            return tk.dequant_matmul(**{**args, "a": a}, group_size=group_size, backend="tilelang")

        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(args["a"]), layer(args["a"]))
