"""W4A16 GEMM: dequant_matmul(a, qweight, scales, group_size=128, zeros=None) = a @ W for int4 weights.

a (M, K) in float16 / bfloat16 (or float32); qweight (K / 8, N) int32 holds W's 4-bit codes packed 8 per int32 along
K (GPTQ / AWQ layout): code k = 8 i + j of column n is bits 4j .. 4j + 3 of qweight[i, n], unsigned 0 .. 15; scales
and zeros (K / group_size, N) in a's dtype:
    W[k, n] = (code[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]     (zeros = 8 when None)
Returns (M, N) in a's dtype. Not differentiable (inference).

Kernel: one program per (BLOCK_M rows, BLOCK_N columns) output tile, streaming K in BLOCK_K steps: the step's packed
codes (BLOCK_K / 8, BLOCK_N) are read once (a coalesced row of N int32 per 8 k), unpacked in registers by shifts,
scaled in fp32 and rounded to a's dtype, then multiplied on the tensor cores with fp32 accumulation. When BLOCK_K
divides group_size each step reads one row of scales (and zeros); otherwise a scale per (k, n). The weights are read
once per row block: at decode sizes (M <= 16, one row block) the kernel streams the int4 weights, a quarter of fp16's
bytes. Design limits: K a multiple of 8 (whole int32 words) and of group_size; no split-K yet (N / BLOCK_N programs at
M <= 16 should cover the SMs: BLOCK_N shrinks to 32 for narrow N).
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from . import checks
from .flash_attention import dot
from .host import interpreting
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "dequant_matmul"
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_ZERO = 8  # the code of 0 when no zeros are given (symmetric int4)


@triton.jit
def dequant_matmul_kernel(
    A, QW, S, Z, M, N, K, group_size, stride_a, stride_qw, stride_s, stride_z,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ONE_GROUP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). OUT (M, N) compact = A @ W (the module's formula)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    a_rows = A + rows[:, None].to(tl.int64) * stride_a
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_rows = k0 // 8 + words
        packed = tl.load(QW + w_rows[:, None].to(tl.int64) * stride_qw + cols[None, :],
                         mask=(w_rows < K // 8)[:, None] & col_ok[None, :], other=0)  # fmt: skip
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # (BLOCK_K / 8, 8, BLOCK_N): k = 8 i + j
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if ONE_GROUP:  # the step lies in one group: one row of scales (and zeros)
            group = k0 // group_size
            s = tl.load(S + group * stride_s + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                z = tl.load(Z + group * stride_z + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            else:
                z = 8.0
        else:
            group = ((k0 + kk) // group_size).to(tl.int64)[:, None]
            mask = k_ok[:, None] & col_ok[None, :]
            s = tl.load(S + group * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(Z + group * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                z = 8.0
        w = ((codes - z) * s).to(A.dtype.element_ty)
        acc += dot(a, w, IEEE)
    out = OUT + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def check(a, qweight, scales, group_size=128, zeros=None) -> None:
    dtype = checks.check_float(NAME, "a", a)
    if len(a.shape) != 2:
        raise ValueError(f"{NAME}: a must be 2-D (M, K), got shape {tuple(a.shape)}")
    m, k = a.shape
    checks.check_same_dtype(NAME, "qweight", qweight, "int32", "8 int4 codes a word")
    if len(qweight.shape) != 2:
        raise ValueError(f"{NAME}: qweight must be 2-D (K / 8, N), got shape {tuple(qweight.shape)}")
    if k % 8 or qweight.shape[0] != k // 8:
        raise ValueError(f"{NAME}: qweight must have K / 8 rows for a's K = {k} (a multiple of 8), got shape "
                         f"{tuple(qweight.shape)}")  # fmt: skip
    group_size = checks.check_int(NAME, "group_size", group_size, "an int > 0 that divides K")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{NAME}: group_size must be an int > 0 that divides K = {k}, got {group_size}")
    groups = (k // group_size, qweight.shape[1])
    checks.check_same_dtype(NAME, "scales", scales, dtype, "that of a")
    checks.check_shape(NAME, "scales", scales, groups, "(K / group_size, N)")
    if zeros is not None:
        checks.check_same_dtype(NAME, "zeros", zeros, dtype, "that of a")
        checks.check_shape(NAME, "zeros", zeros, groups, "(K / group_size, N)")


def _blocks(m: int, n: int, group_size: int, dtype: str, target: Target) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): decode-sized M in 16-row tiles, with BLOCK_N small enough for
    two programs an SM; prefill-sized M in 128 x 128 tiles (16 x 32 in float32). BLOCK_K the largest of 128 .. 16
    that divides the group. Wavefront-64 (AMD) targets, 64 KiB of LDS: one software-pipelining stage."""
    block_k = next((b for b in (128, 64, 32, 16) if group_size % b == 0), 32)
    stages = 1 if target.warp_size == 64 else 3
    if dtype == "float32":  # IEEE products (no TF32) hold more registers: small tiles
        return 16, 32, min(block_k, 32), 4, min(stages, 2)
    if m <= 64:
        block_m = 16 if m <= 16 else 64
        block_n = next((b for b in (128, 64) if cdiv(n, b) >= 2 * target.num_sms), 32)
        return block_m, block_n, block_k, 4, stages
    return 128, 128, min(block_k, 64), 8, stages


def forward(m: int, n: int, k: int, *, dtype: str, group_size: int, has_zeros: bool, target: Target,
            stride_a: int | None = None, stride_qw: int | None = None, stride_s: int | None = None,
            stride_z: int | None = None) -> Plan:  # fmt: skip
    """Inputs a (M, K), qweight (K / 8, N), scales [and zeros] (K / group_size, N), each at its row stride (None:
    compact) with a unit column stride. Output out (M, N) compact in a's dtype (zeros when K = 0)."""
    inputs = {"a": dtype, "qweight": "int32", "scales": dtype} | ({"zeros": dtype} if has_zeros else {})
    launches = ()
    if m and n and k:
        block_m, block_n, block_k, warps, stages = _blocks(m, n, group_size, dtype, target)
        ieee = dtype == "float32" or (dtype == "bfloat16" and interpreting())  # see flash_attention._shared
        strides = (k if stride_a is None else stride_a, *(n if s is None else s for s in (stride_qw, stride_s)),
                   (n if stride_z is None else stride_z) if has_zeros else 0)  # fmt: skip
        launches = (
            Launch(dequant_matmul_kernel, (cdiv(n, block_n), cdiv(m, block_m)),
                   ("a", "qweight", "scales", "zeros" if has_zeros else None, m, n, k, group_size, *strides), ("out",),
                   dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_ZEROS=has_zeros,
                        ONE_GROUP=group_size % block_k == 0, IEEE=ieee), warps, stages),
        )  # fmt: skip
    return Plan(inputs, {"out": BufferSpec((m, n), dtype, zeroed=not launches)}, launches, ("out",))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def codes(qweight: np.ndarray) -> np.ndarray:
    """The (K, N) unsigned 4-bit codes packed in qweight (K / 8, N) int32."""
    words = np.asarray(qweight).astype(np.int64) & 0xFFFFFFFF
    nibbles = (words[:, None, :] >> (4 * np.arange(8))[None, :, None]) & 0xF
    return nibbles.reshape(8 * words.shape[0], words.shape[1])


def pack(codes_kn: np.ndarray) -> np.ndarray:
    """codes (K, N) in 0 .. 15 -> qweight (K / 8, N) int32 (the layout `codes` reads)."""
    words = np.zeros((codes_kn.shape[0] // 8, codes_kn.shape[1]), np.uint32)
    for j in range(8):
        words |= codes_kn[j::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def weight(qweight, scales, group_size, zeros=None) -> np.ndarray:
    """W (K, N) in float64 as the kernel forms it: (code - zero) * scale, rounded to a's dtype."""
    c = codes(qweight).astype(np.float64)
    s = np.repeat(np.asarray(scales).astype(np.float64), group_size, axis=0)
    z = DEFAULT_ZERO if zeros is None else np.repeat(np.asarray(zeros).astype(np.float64), group_size, axis=0)
    return round_to((c - z) * s, str(scales.dtype)).astype(np.float64)


def reference(a, qweight, scales, group_size=128, zeros=None):
    return (a.astype(np.float64) @ weight(qweight, scales, group_size, zeros),)


def reference_vjp(kwargs, cotangents):
    return {}


def cost(kwargs) -> tuple[Cost, Cost]:
    """bytes: a, the packed codes, scales (and zeros), the output; flops 2 M N K."""
    a, qweight, scales = kwargs["a"], kwargs["qweight"], kwargs["scales"]
    (m, k), n, item = a.shape, qweight.shape[1], ITEMSIZE[str(a.dtype)]
    groups = scales.size * item * (2 if kwargs.get("zeros") is not None else 1)
    return Cost(a.size * item + qweight.size * 4 + groups + m * n * item, 2 * m * n * k), Cost(0, 0)


def sample(rng: np.random.Generator, shape, dtype: str, zeros=False, group_size=128) -> dict:
    """A benchmark's shape (M, K, N) as it is (K >= 256); else M = the product of the leading dims (1 without), N =
    the last dim (up to 512; wider ones folded to 256 .. 512), K = group_size x 1 .. 3. Random codes, scales of
    either sign around 0.02 (outputs of order 1), zeros among the 16 codes."""
    shape = tuple(shape)
    if len(shape) == 3 and shape[1] >= 256:
        m, k, n = shape
    else:
        m, n = math.prod(shape[:-1]), shape[-1]
        n = n if n <= 512 else 256 + n % 257
        k = group_size * int(rng.integers(1, 4))
    groups = (k // group_size, n)
    kwargs = {
        "a": round_to(rng.standard_normal((m, k)), dtype),
        "qweight": pack(rng.integers(0, 16, (k, n), dtype=np.uint8)),
        "scales": round_to(rng.uniform(0.01, 0.03, groups) * rng.choice([-1.0, 1.0], groups), dtype),
        "group_size": group_size,
        "zeros": round_to(rng.integers(0, 16, groups).astype(np.float64), dtype) if zeros else None,
    }
    return kwargs


def bad_inputs(kwargs) -> list[BadInput]:
    a, qweight, scales = kwargs["a"], kwargs["qweight"], kwargs["scales"]
    return [
        BadInput({"a": a[None]}, ValueError, f"{NAME}: a must be 2-D"),
        BadInput({"a": a.astype(np.int32)}, TypeError, f"{NAME}: a must have dtype"),
        BadInput({"qweight": qweight.astype(np.float32)}, TypeError, f"{NAME}: qweight must have dtype int32"),
        BadInput({"qweight": qweight[:-1]}, ValueError, f"{NAME}: qweight must have K / 8 rows"),
        BadInput(
            {"scales": scales.astype(np.float16 if a.dtype != np.float16 else np.float32)},
            TypeError,
            f"{NAME}: scales must have dtype",
        ),  # fmt: skip
        BadInput({"scales": scales[:, :-1]}, ValueError, f"{NAME}: scales must have shape"),
        BadInput({"zeros": scales[:, :-1]}, ValueError, f"{NAME}: zeros must have shape"),
        BadInput({"group_size": 7}, ValueError, f"{NAME}: group_size must be an int > 0 that divides K"),
        BadInput({"group_size": 64.0}, TypeError, f"{NAME}: group_size must be an int"),
        *not_arrays(NAME, "a", "qweight", "scales"),
    ]


def plans(target: Target):
    """Decode- and prefill-sized tiles for each dtype, with and without zeros, one-group and per-k scale steps."""
    for dtype in DTYPES:
        for m, group_size in ((1, 128), (16, 32), (256, 128), (256, 8)):
            for has_zeros in (False, True):
                k, n = 4 * max(group_size, 128), 4096
                yield forward(m, n, k, dtype=dtype, group_size=group_size, has_zeros=has_zeros, target=target)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"zeros": (False, True), "group_size": (8, 32, 128)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
