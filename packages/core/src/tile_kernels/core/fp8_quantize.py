"""FP8 block quantization, the cast that feeds fp8_matmul: fp8_quantize(x, block_rows=1) -> (codes, scales).

x (R, K) in float32 / float16 / bfloat16, K a multiple of 128, R of block_rows (1: per token and 128 channels, an
activation's blocks; 128: 128 x 128 blocks, a weight's). Each block's scale is amax / 448 in float32 (448: e4m3's
largest magnitude; 1 for an all-zero block), and its codes x / scale rounded to the nearest e4m3:

    scales[i, j] = max |x[block (i, j)]| / 448      codes[r, k] = rne_e4m3(x[r, k] / scales[r // block_rows, k // 128])

Returns codes (R, K) float8_e4m3fn and scales (R / block_rows, K / 128) float32: fp8_matmul's a and a_scales
(block_rows 1) or b and b_scales (block_rows 128). Both divisions round as IEEE division (_divide) and the e4m3
rounding is done in float32 arithmetic, so a GPU, the interpreter and the NumPy reference give the same bits. Not
differentiable.

fp8_quantize_kernel: a (BLOCK_R, BLOCK_K) tile a program: ROW_TILE of per-row scales (store_row_blocks),
or one whole 128 x 128 block. rms_norm_fp8_quantize and swiglu_fp8_quantize fuse the per-token cast into the ops
that produce an fp8 GEMM's activations.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "fp8_quantize"
FP8 = "float8_e4m3fn"
BLOCK = 128  # the block's width along K
E4M3_MAX = 448.0
BLOCK_ROWS = (128, 1)
# (rows, columns, warps) of a program's tile with per-row scales: the fastest of benchmarks/sweep_fp8_casts.py on the
# H200 over widths 1024-16384 for both casts, within 3% of each width's best (2026-12-04)
ROW_TILE = (16, 256, 4)


def row_tile(k: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, warps) of a program that casts rows of width k with per-row scales (store_row_blocks):
    ROW_TILE, its columns cut to k rounded up to a power of 2."""
    rows, cols, warps = ROW_TILE
    return rows, min(cols, next_power_of_2(k)), warps


def e4m3_target(target: Target) -> bool:
    """Whether Triton has e4m3 (float8e4nv) on `target`: NVIDIA sm_89+ and the interpreter; not AMD's wavefront-64
    targets (their e4m3 before gfx950 is the fnuz variant), which the plans leave out."""
    return not (target.cuda_arch and target.cuda_arch < 89) and target.warp_size != 64


def require_e4m3(op: str, target: Target) -> None:
    if target.cuda_arch and target.cuda_arch < 89:
        raise RuntimeError(f"{op}: e4m3 needs an NVIDIA GPU of compute capability 8.9 or newer, got "
                           f"{target.cuda_arch // 10}.{target.cuda_arch % 10}")  # fmt: skip


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32: the step of v's binade is
    2^(max(e, -6) - 3) (3 mantissa bits; subnormals below 2^-6), and |v| / step is rounded to an integer by adding
    and subtracting 1.5 * 2^23, the sign put back. Done in float32 so that every backend gives the same bits
    (Triton's interpreter rounds float32 -> e4m3 without carrying into the exponent); the cast to e4m3 is then
    exact."""
    bits = v.to(tl.int32, bitcast=True)
    step_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(v) * inverse + 12582912.0) - 12582912.0) * step
    # v's sign bit put back by bit ops (Triton's -m is 0 - m, which loses -0): tiny negatives give -0 as NumPy does
    return (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale(amax):
    """amax / 448 (e4m3's largest magnitude), 1 for an all-zero block, rounded correctly (div_rn)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _divide(y, scale):
    """y / scale rounded as IEEE division (div_rn) for a scale shared by many y: per-element division has a slow path
    for zero and subnormal operands (an all-zero block halves the cast's speed). One reciprocal r = RN(1 / s) a
    scale, q = RN(y r) (within 1.5 ulp), then two Newton-Markstein corrections q += (y - q s) r, each residual an
    exact FMA: the second starts within 1 ulp, so it rounds to RN(y / s) (Markstein's theorem) unless the quotient
    underflows, and quotients below 2^-126 round to a zero code anyway. Scales below 2^-64 (whose reciprocal
    would overflow) are scaled by 2^64 together with y, exactly. Zeros keep their sign."""
    f = tl.where(scale < 5.421010862427522e-20, 18446744073709551616.0, 1.0)  # 2^-64, 2^64
    s = scale * f
    r = tl.math.div_rn(1.0, s)
    y = y * f
    q = y * r
    q = tl.fma(tl.fma(q, -s, y), r, q)
    q = tl.fma(tl.fma(q, -s, y), r, q)
    return tl.where(y == 0, y, q)


@triton.jit
def quantize_block_rows(y):
    """y (rows, 128) float32, a 1 x 128 block a row -> (codes as float32 e4m3 values, scales (rows,)): scale = amax /
    448 (1 for an all-zero block), code = rne_e4m3(y / scale). The ops that fuse the cast (rms_norm_fp8_quantize,
    swiglu_fp8_quantize) call it on their output tile."""
    scale = _block_scale(tl.max(tl.abs(y), axis=1))
    return _round_to_e4m3(_divide(y, scale[:, None])), scale


@triton.jit
def store_row_blocks(y, CODES, SCALES, row0, R, K, col0, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantizes y (BLOCK_R, BLOCK_K) float32, rows row0... and columns col0... of an (R, K) tensor, in 1 x 128
    blocks (quantize_block_rows) and stores its codes to CODES (R, K) and its scales to SCALES (R, K / 128), both
    compact. A program's tile spans several blocks of a row: wide contiguous rows stream at the copy rate."""
    NB: tl.constexpr = BLOCK_K // 128
    codes, scales = quantize_block_rows(tl.reshape(y, (BLOCK_R * NB, 128)))
    rr, kk, bb = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_K), tl.arange(0, NB)
    row_ok = (rr < R - row0)[:, None]
    s_ptrs = SCALES + row0.to(tl.int64) * (K // 128) + rr[:, None] * (K // 128) + col0 // 128 + bb[None, :]
    tl.store(s_ptrs, tl.reshape(scales, (BLOCK_R, NB)), mask=row_ok & (bb < (K - col0) // 128)[None, :])
    c_ptrs = CODES + row0.to(tl.int64) * K + rr[:, None] * K + col0 + kk[None, :]
    codes = tl.reshape(codes, (BLOCK_R, BLOCK_K)).to(CODES.dtype.element_ty)
    tl.store(c_ptrs, codes, mask=row_ok & (kk < K - col0)[None, :])


@triton.jit
def fp8_quantize_kernel(
    X, R, K, ldx,
    CODES, SCALES,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROWS: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """x[r, k] at X + r ldx + k; CODES (R, K) and SCALES (R / BLOCK_ROWS, K / 128) compact."""
    K, ldx = K * UNIT, ldx * UNIT  # plan.in_units
    row0, col0 = tl.program_id(0) * BLOCK_R, tl.program_id(1) * BLOCK_K
    rr, kk = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_K)
    mask = (rr < R - row0)[:, None] & (kk < K - col0)[None, :]
    x = tl.load(X + row0.to(tl.int64) * ldx + rr[:, None] * ldx + col0 + kk[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if BLOCK_ROWS == 1:
        store_row_blocks(x, CODES, SCALES, row0, R, K, col0, BLOCK_R, BLOCK_K)
    else:  # BLOCK_R == BLOCK_ROWS, BLOCK_K == 128: the tile is one block
        scale = _block_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        tl.store(SCALES + tl.program_id(0).to(tl.int64) * (K // 128) + tl.program_id(1), scale)
        codes = _round_to_e4m3(_divide(x, scale))
        out = CODES + row0.to(tl.int64) * K + rr[:, None] * K + col0 + kk[None, :]
        tl.store(out, codes.to(CODES.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def check(x, block_rows=1) -> None:
    checks.check_float(NAME, "x", x)
    if block_rows not in BLOCK_ROWS:
        raise ValueError(f"{NAME}: block_rows must be one of {BLOCK_ROWS}, got {block_rows!r}")
    if len(x.shape) != 2 or x.shape[1] % BLOCK or x.shape[0] % block_rows:
        raise ValueError(f"{NAME}: x must be 2-D (R, K) with K a multiple of {BLOCK} and R of block_rows "
                         f"({block_rows}), got shape {tuple(x.shape)}")  # fmt: skip


def forward(r: int, k: int, *, dtype: str, target: Target, block_rows: int = 1, ldx: int | None = None) -> Plan:
    """Input x (R, K) row-major at row stride ldx (None: compact). Outputs codes (R, K) float8_e4m3fn and scales
    (R / block_rows, K / 128) float32, compact."""
    require_e4m3(NAME, target)
    empty = not (r and k)  # nothing to launch: the (empty) outputs count as zeroed
    buffers = {"codes": BufferSpec((r, k), FP8, zeroed=empty),
               "scales": BufferSpec((r // block_rows, k // BLOCK), "float32", zeroed=empty)}  # fmt: skip
    if empty:
        return Plan({"x": dtype}, buffers, (), ("codes", "scales"))
    if block_rows == 1:
        block_r, block_k, warps = row_tile(k)
    else:  # one 128 x 128 block
        block_r, block_k, warps = BLOCK, BLOCK, 8
    grid = (cdiv(r, block_r), cdiv(k, block_k))
    constexprs = dict(BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_ROWS=block_rows)
    launch = Launch(fp8_quantize_kernel, grid, ("x", r, k, ldx or k), ("codes", "scales"), constexprs, warps, 1)
    return Plan({"x": dtype}, buffers, (in_units(launch, "K", "ldx", units=(16,)),), ("codes", "scales"))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def quantize(x: np.ndarray, block_rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The op in NumPy, bit for bit: (codes (R, K) as ml_dtypes.float8_e4m3fn, scales float32)."""
    import ml_dtypes

    r, k = x.shape
    blocks = x.astype(np.float32).reshape(r // block_rows, block_rows, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    codes = (blocks / scales[:, None, :, None]).astype(np.float32)
    return codes.reshape(r, k).astype(ml_dtypes.float8_e4m3fn), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, block_rows: int) -> np.ndarray:
    """The values codes x scale per block, in float64: quantize's inverse up to e4m3's rounding."""
    return codes.astype(np.float64) * np.repeat(np.repeat(scales.astype(np.float64), block_rows, 0), BLOCK, 1)


def fused_cast_slack(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OpInfo.slack of an op that casts its own output (rms_norm_fp8_quantize, swiglu_fp8_quantize), given the
    reference's codes and scales: a code may be one e4m3 step (2^(e - 3) in binade e, 2^-9 below 2^-6) from the
    reference's and a scale 2^-6 of itself: the kernel's float32 output (and rms_norm's h before it) can round to
    the op's dtype one unit away from the float64 reference's, moving a code or a block's amax across a rounding
    boundary; two bfloat16 units are 2^-6."""
    magnitude = np.abs(codes.astype(np.float64))
    steps = 2.0 ** (np.floor(np.log2(np.maximum(magnitude, 2.0**-6))) - 3)
    return steps, 2.0**-6 * scales.astype(np.float64)


def reference(x, block_rows=1):
    codes, scales = quantize(x, block_rows)
    return codes.astype(np.float64), scales.astype(np.float64)


def reference_vjp(kwargs, cotangents):
    return {}


def cost(kwargs) -> tuple[Cost, Cost]:
    """bytes: x read once, the codes and the scales written."""
    x = kwargs["x"]
    return Cost(x.size * (ITEMSIZE[str(x.dtype)] + 1) + 4 * x.size // (BLOCK * kwargs["block_rows"]), 0), Cost(0, 0)


def sample(rng: np.random.Generator, shape, dtype: str, block_rows: int = 1) -> dict:
    """x (R, K): R the product of the leading dims (rounded up to block_rows), K the last dim rounded up to a
    multiple of 128 (at most 3 blocks for a test's width; a benchmark's (R, K) with K >= 1024 as it is). Normal values
    with each block multiplied by a random power of 2 (scales that differ by block) and one block in 8 all zero."""
    shape = tuple(shape)
    r, k = int(np.prod(shape[:-1])), shape[-1]
    if not (len(shape) == 2 and k >= 1024 and k % BLOCK == 0):
        k = BLOCK * min(3, cdiv(k, BLOCK))
    r = block_rows * cdiv(r, block_rows)
    blocks = (r // block_rows, k // BLOCK)
    octaves = 2.0 ** rng.integers(-6, 7, blocks) * (rng.random(blocks) >= 0.125)
    x = rng.standard_normal((r, k)) * np.repeat(np.repeat(octaves, block_rows, 0), BLOCK, 1)
    return {"x": round_to(x, dtype), "block_rows": block_rows}


def bad_inputs(kwargs) -> list[BadInput]:
    x = kwargs["x"]
    return [
        BadInput({"x": x.astype(np.int32)}, TypeError, f"{NAME}: x must have dtype"),
        BadInput({"x": x[None]}, ValueError, f"{NAME}: x must be 2-D"),
        BadInput({"x": x[:, :-1]}, ValueError, f"{NAME}: x must be 2-D .* K a multiple of 128"),
        BadInput({"x": np.zeros((3, 128), x.dtype), "block_rows": 128}, ValueError, f"{NAME}: x must be 2-D .* R of"),
        BadInput({"block_rows": 64}, ValueError, f"{NAME}: block_rows must be one of"),
        *not_arrays(NAME, "x"),
    ]


def plans(target: Target):
    """Each input dtype and block shape at 4096 x 7168 (DeepSeek-V3's hidden size), on e4m3 targets."""
    if not e4m3_target(target):
        return
    for dtype in ("float32", "float16", "bfloat16"):
        for block_rows in BLOCK_ROWS:
            yield forward(4096, 7168, dtype=dtype, target=target, block_rows=block_rows)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"block_rows": BLOCK_ROWS},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
