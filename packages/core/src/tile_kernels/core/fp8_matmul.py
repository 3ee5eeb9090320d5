"""Block-scaled FP8 GEMM (DeepSeek-V3's layout): fp8_matmul(a, a_scales, b, b_scales, out_dtype="bfloat16").

    out[m, n] = sum_k (a[m, k] a_scales[m, k // 128]) (b[n, k] b_scales[n // 128, k // 128])

a (M, K) and b (N, K) in float8_e4m3fn, both K-major (a Linear weight's layout); a_scales (M, K / 128) float32, one
scale per 1 x 128 block of a (per token and 128 channels), either row- or column-major; b_scales (N / 128, K / 128)
float32, one per 128 x 128 block of b. K and N multiples of 128, M any. The output (M, N) in out_dtype (bfloat16,
float16 or float32). Not differentiable.

fp8_matmul_kernel: one (BLOCK_M, BLOCK_N) output tile a program (tiles grouped for L2 as matmul's), K streamed one
128-wide scale block a step. Each step's e4m3 product runs on the tensor cores into a fresh fp32 tile, which is
scaled by a's per-row and b's per-tile scale and added to the fp32 accumulator: the scales are applied once per
block. BLOCK_N <= 128 so that a tile's columns share one b scale block. Rows and columns past the ends read the last
one (clamped) and are never stored; K needs no mask.
Design limits: e4m3 products need NVIDIA sm_89+ (Ada, Hopper, Blackwell) or the CPU interpreter; no TMA, no
persistent scheduler, no split of K; the quantization that produces a and a_scales is the caller's: fp8_quantize.
backend="tilelang" runs fp8_matmul_tilelang's Hopper kernel (TMA, wgmma, a producer warp group).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from . import backends, checks, fp8_matmul_tilelang
from .backends import Call
from .fp8_quantize import BLOCK, FP8, dequantize, e4m3_target, quantize, require_e4m3
from .matmul import GROUP_M, grouped_tile
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, dtype_name, in_units
from .registry import BadInput, Cost, OpInfo, gemm_dims, not_arrays, register

NAME = "fp8_matmul"
MIN_TILELANG_ROWS = 128  # preferred_backend: fewer rows run the Triton kernel (one 128-row TileLang tile)
# backend="tilelang": fp8_matmul_tilelang's Hopper kernel; backend=None: preferred_backend
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.fp8_matmul_tilelang"})


@triton.jit
def fp8_matmul_kernel(
    A, A_SCALES, B, B_SCALES, M, N, K, lda, ldb, sa_m, sa_k, sb_n,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),). a[m, k] at A + m lda + k, b[n, k] at B + n ldb + k,
    a_scales[m, j] at A_SCALES + m sa_m + j sa_k, b_scales[i, j] at B_SCALES + i sb_n + j, OUT (M, N) compact."""
    BLOCK_K: tl.constexpr = 128
    K, lda, ldb = K * UNIT, lda * UNIT, ldb * UNIT  # plan.in_units
    row0, col0 = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # int32 offsets within the tile from 64-bit tile bases; rows and columns past the ends clamped to the last
    rm, cn, kk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    rows_in, cols_in = tl.minimum(rm, M - 1 - row0), tl.minimum(cn, N - 1 - col0)
    a_ptrs = A + row0.to(tl.int64) * lda + rows_in[:, None] * lda + kk[None, :]
    b_ptrs = B + col0.to(tl.int64) * ldb + kk[:, None] + cols_in[None, :] * ldb  # (BLOCK_K, BLOCK_N): b's transpose
    sa_ptrs = A_SCALES + row0.to(tl.int64) * sa_m + rows_in * sa_m
    sb_ptr = B_SCALES + (col0 // BLOCK_K) * sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        scale = tl.load(sa_ptrs + j * sa_k)[:, None] * tl.load(sb_ptr + j)
        acc += tl.dot(a, b) * scale
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = OUT + row0.to(tl.int64) * N + col0 + rm[:, None] * N + cn[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=(rm < M - row0)[:, None] & (cn < N - col0)[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def out_dtype_name(out_dtype) -> str:
    """'bfloat16' for "bfloat16", torch.bfloat16, jnp.bfloat16 and np.dtype alike."""
    if isinstance(out_dtype, str) or type(out_dtype).__module__ == "torch":  # np.dtype(torch's) fails under compile
        return dtype_name(out_dtype)
    try:
        return np.dtype(out_dtype).name
    except TypeError:
        return dtype_name(out_dtype)


def check(a, a_scales, b, b_scales, out_dtype="bfloat16") -> None:
    checks.check_same_dtype(NAME, "a", a, FP8, "e4m3 codes")
    if len(a.shape) != 2 or a.shape[1] % BLOCK:
        raise ValueError(f"{NAME}: a must be 2-D (M, K) with K a multiple of {BLOCK}, got shape {tuple(a.shape)}")
    (m, k), blocks_k = a.shape, a.shape[1] // BLOCK
    checks.check_same_dtype(NAME, "a_scales", a_scales, "float32", f"one scale per 1 x {BLOCK} block of a")
    checks.check_shape(NAME, "a_scales", a_scales, (m, blocks_k), f"(M, K / {BLOCK})")
    checks.check_same_dtype(NAME, "b", b, FP8, "e4m3 codes")
    if len(b.shape) != 2 or b.shape[1] != k or b.shape[0] % BLOCK:
        raise ValueError(f"{NAME}: b must be 2-D (N, K) with K = {k} (a's columns) and N a multiple of {BLOCK}, got "
                         f"shape {tuple(b.shape)}")  # fmt: skip
    checks.check_same_dtype(NAME, "b_scales", b_scales, "float32", f"one scale per {BLOCK} x {BLOCK} block of b")
    checks.check_shape(NAME, "b_scales", b_scales, (b.shape[0] // BLOCK, blocks_k), f"(N / {BLOCK}, K / {BLOCK})")
    if out_dtype_name(out_dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{NAME}: out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")


@dataclass(frozen=True)
class Blocks:
    block_m: int
    block_n: int
    warps: int
    stages: int


def blocks(m: int, target: Target) -> Blocks:
    """128 x 128 tiles, 8 warps, 4 stages (128 KiB of shared memory) at prefill sizes; 64 x 128 at M <= 64 and
    16 x 64 with 2 warps at M <= 16 (more programs over the weights; 4 warps spill on sm_100). The K step is the
    128-wide scale block. No spills on sm_90 / sm_100 (`tile-kernels aot --op fp8_matmul --report`); not yet swept
    on a GPU."""
    if m <= 16:
        return Blocks(16, 64, 2, 4)
    if m <= 64:
        return Blocks(64, 128, 4, 4)
    return Blocks(128, 128, 8, 4)


def forward(m: int, n: int, k: int, *, out_dtype: str, target: Target, lda: int | None = None,
            ldb: int | None = None, a_scales_strides: tuple[int, int] | None = None) -> Plan:  # fmt: skip
    """Inputs a (M, K) and b (N, K) row-major at row strides lda / ldb (None: compact), a_scales (M, K / 128) at
    a_scales_strides (None: row-major), b_scales (N / 128, K / 128) compact. Output out (M, N) compact in out_dtype
    (zeros when K = 0)."""
    require_e4m3(NAME, target)
    inputs = {"a": FP8, "a_scales": "float32", "b": FP8, "b_scales": "float32"}
    buffers = {"out": BufferSpec((m, n), out_dtype, zeroed=not (m and n and k))}
    if not (m and n and k):
        return Plan(inputs, buffers, (), ("out",))
    bl = blocks(m, target)
    sa_m, sa_k = a_scales_strides or (k // BLOCK, 1)
    reads = ("a", "a_scales", "b", "b_scales", m, n, k, lda or k, ldb or k, sa_m, sa_k, k // BLOCK)
    constexprs = dict(BLOCK_M=bl.block_m, BLOCK_N=bl.block_n, GROUP_M=GROUP_M)
    grid = (cdiv(m, bl.block_m) * cdiv(n, bl.block_n),)
    launch = Launch(fp8_matmul_kernel, grid, reads, ("out",), constexprs, bl.warps, bl.stages)
    return Plan(inputs, buffers, (in_units(launch, "K", "lda", "ldb", units=(16,)),), ("out",))


def preferred_backend(arch: int, m: int) -> str:
    """backend=None's choice on compute capability `arch` (0: not a CUDA device): "tilelang" on sm_90 from
    MIN_TILELANG_ROWS rows (H200, 2026-12-04, e4m3 in, bf16 out, device time: 8192^3 951 TFLOP/s, 4096 x 14336 x 4096
    910; the Triton kernel 754 / 736, torch._scaled_mm with the same block scales 1170 / 1119;
    benchmarks/results/h200/notes.md), else "triton"."""
    tilelang = arch in fp8_matmul_tilelang.ARCHS and m >= MIN_TILELANG_ROWS
    return "tilelang" if tilelang and not fp8_matmul_tilelang.unsupported(arch) else "triton"


def check_backend(backend: str, arch: int | None = None) -> None:
    """Raises ValueError naming what a resolved backend cannot run (fp8_matmul_tilelang.unsupported)."""
    if backend == "tilelang" and (why := fp8_matmul_tilelang.unsupported(arch)):
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")


def compiled_forward(backend: str, m: int, n: int, k: int, *, out_dtype: str, arch: int, target: Target,
                     tile_config: str | None = None) -> Plan:  # fmt: skip
    """The TileLang backend's forward for compute capability `arch` (90): a (M, K), a_scales (M, K / 128)
    row-major, b (N, K) and b_scales compact; out (M, N) compact in out_dtype. One Call; an empty product runs
    `forward`'s plan (zeros). `tile_config`: one of fp8_matmul_tilelang.CONFIGS (None: config_for the output)."""
    check_backend(backend, arch)
    if not (m and n and k):
        return forward(m, n, k, out_dtype=out_dtype, target=target)
    module = backends.module(NAME, backend)
    kernel = module.kernel_name(tile_config or module.config_for(m, n, target.num_sms))
    load = functools.partial(module.function, kernel, FP8, out_dtype, arch)
    inputs = {"a": FP8, "a_scales": "float32", "b": FP8, "b_scales": "float32"}
    steps = (Call(f"tile_kernels_{backend}_{kernel}_{out_dtype}_sm{arch}", load, tuple(inputs), ("out",)),)
    return Plan(inputs, {"out": BufferSpec((m, n), out_dtype)}, steps, ("out",))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(a, a_scales, b, b_scales, out_dtype="bfloat16"):
    return (dequantize(a, a_scales, 1) @ dequantize(b, b_scales, BLOCK).T,)


def slack(kwargs) -> tuple:
    """Hopper's tensor cores sum e4m3 products keeping ~14 significant bits, aligned to the largest product of each
    step (the reason DeepSeek-V3 scales each 128-deep block into an fp32 accumulator, as this kernel does): a block of
    similar products can lose ~128 x 2^-13 of its largest. Allowed: 2^-9 of sum_k |a b| per output (an H200 lost up
    to 2^-10.5 of it on x @ x.T, where every product of a diagonal element is positive)."""
    a = dequantize(np.abs(kwargs["a"].astype(np.float64)), kwargs["a_scales"], 1)
    b = dequantize(np.abs(kwargs["b"].astype(np.float64)), np.abs(kwargs["b_scales"]), BLOCK)
    return (2.0**-9 * (a @ b.T),)


def reference_vjp(kwargs, cotangents):
    return {}


def cost(kwargs) -> tuple[Cost, Cost]:
    """bytes: a, b, their scales and the output; flops 2 M N K."""
    a, b = kwargs["a"], kwargs["b"]
    (m, k), n = a.shape, b.shape[0]
    scales = 4 * (kwargs["a_scales"].size + kwargs["b_scales"].size)
    out = m * n * ITEMSIZE[out_dtype_name(kwargs["out_dtype"])]
    return Cost(a.size + b.size + scales + out, 2 * m * n * k), Cost(0, 0)


def sample(rng: np.random.Generator, shape, dtype: str) -> dict:
    """out_dtype = dtype. (M, K, N) as registry.gemm_dims gives them when they are multiples of 128 (a benchmark's
    shape); else M = the product of the leading dims, N = 0, 128 or 256 after the last dim (0, up to 128, more), K
    one to three blocks (rarely 0). Normal values with each scale block multiplied by a random power of 2 (scales
    that differ by block, so a misplaced scale shows), quantized by fp8_quantize."""
    m, k, n = gemm_dims(shape)
    if k is None or k % BLOCK or n % BLOCK:
        n = BLOCK * min(2, cdiv(tuple(shape)[-1], BLOCK))
        k = BLOCK * int(rng.choice([0, 1, 2, 3], p=[0.05, 0.35, 0.3, 0.3]))

    def values(rows: int, block_rows: int) -> np.ndarray:
        x = rng.standard_normal((rows, k)) / np.sqrt(max(k, 1))
        octaves = 2.0 ** rng.integers(-3, 4, (max(rows // block_rows, 1), k // BLOCK))
        return x * np.repeat(np.repeat(octaves, block_rows, 0)[:rows], BLOCK, 1)

    a, a_scales = quantize(values(m, 1), 1)
    b, b_scales = quantize(values(n, BLOCK), BLOCK)
    return {"a": a, "a_scales": a_scales, "b": b, "b_scales": b_scales, "out_dtype": dtype}


def bad_inputs(kwargs) -> list[BadInput]:
    a, sa, b, sb = kwargs["a"], kwargs["a_scales"], kwargs["b"], kwargs["b_scales"]
    return [
        BadInput({"a": a.astype(np.float16)}, TypeError, f"{NAME}: a must have dtype {FP8}"),
        BadInput({"a": a[None]}, ValueError, f"{NAME}: a must be 2-D"),
        BadInput({"a": a[:, :-1]}, ValueError, f"{NAME}: a must be 2-D .* K a multiple of 128"),
        BadInput({"a_scales": sa.astype(np.float16)}, TypeError, f"{NAME}: a_scales must have dtype float32"),
        BadInput({"a_scales": sa[:, :0]}, ValueError, f"{NAME}: a_scales must have shape"),
        BadInput({"b": b.astype(np.float32)}, TypeError, f"{NAME}: b must have dtype {FP8}"),
        BadInput({"b": b[:-1]}, ValueError, f"{NAME}: b must be 2-D .* N a multiple of 128"),
        BadInput({"b_scales": sb[:, :0]}, ValueError, f"{NAME}: b_scales must have shape"),
        BadInput({"out_dtype": "int8"}, ValueError, f"{NAME}: out_dtype must be one of"),
        *not_arrays(NAME, "a", "a_scales", "b", "b_scales"),
    ]


def plans(target: Target):
    """bfloat16 and float32 outputs at decode (M 1, 16), mid (64) and prefill (4096) sizes of a 4096 x 4096 weight,
    the prefill one with column-major a_scales, on e4m3 targets (fp8_quantize.e4m3_target)."""
    if not e4m3_target(target):
        return
    for out_dtype in ("bfloat16", "float32"):
        for m in (1, 16, 64, 4096):
            yield forward(m, 4096, 4096, out_dtype=out_dtype, target=target)
        yield forward(4096, 4096, 4096, out_dtype=out_dtype, target=target, a_scales_strides=(1, 4096))


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
        slack=slack,
    )
)
