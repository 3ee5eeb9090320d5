"""Shared pieces of the row-wise kernels (norms, softmax, losses): sizing and the column reduction of partial sums.

A row-wise op sees its input as R rows of N elements. A row of up to `MAX_ROW_BLOCK` elements is held in registers
by one program (one read of the data). A wider row is streamed in `WIDE_ROW_BLOCK`-element chunks by one program
(softmax; cross-entropy only where fused_linear_cross_entropy writes the gradient in place: an online pass, then a
second pass that hits L2 only while the rows in flight fit in it), or split across programs in two launches (the
norms, norms.py; cross-entropy's forward, cross_entropy.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .plan import FLOAT_DTYPES, Launch, Target, cdiv, in_units, next_power_of_2

MAX_ROW_BLOCK = 16384  # elements held in registers per row (fp32 after upcast: 64 KiB per tensor per program)
WIDE_ROW_BLOCK = 4096  # chunk of a streamed row
ELEMENTS_PER_THREAD = 8  # one 16-byte vector of bf16 per thread per tensor
MAX_WARPS = 16  # 1024 threads on a 64-wide wavefront machine
# one width per BLOCK_N bucket of the in-register path (1, 2, 4, ..., 16384) and one streamed (or split) width, each
# also as a multiple of 16 where the bucket holds one (listed first: launched with UNIT = 16, plan.in_units): the
# row-wise ops' ahead-of-time compile matrix covers every configuration their heuristics can choose
WIDTH_BUCKETS = (1, 2, 3, 5) + tuple(w for k in range(4, 15) for w in (2**k, 2 ** (k - 1) + 1))
WIDTH_BUCKETS += (4 * MAX_ROW_BLOCK, 4 * MAX_ROW_BLOCK + 1)


def row_block(
    n: int, target: Target, max_block: int = MAX_ROW_BLOCK, per_thread: int = ELEMENTS_PER_THREAD
) -> tuple[int, bool, int]:
    """(BLOCK_N, ONE_BLOCK, num_warps) for rows of n elements, `per_thread` of a block's elements a thread."""
    one_block = n <= max_block
    block = next_power_of_2(n) if one_block else WIDE_ROW_BLOCK
    warps = min(MAX_WARPS, max(1, block // (target.warp_size * per_thread)))
    return block, one_block, warps


def row_op_plans(forward, backward, target: Target):
    """Every configuration of a row-wise op whose plan builders take (rows, n, dtype=, target=): the AOT matrix."""
    for dtype in FLOAT_DTYPES:
        for n in WIDTH_BUCKETS:
            yield forward(4, n, dtype=dtype, target=target)
            yield backward(4, n, dtype=dtype, target=target)


def programs_per_problem(rows: int, target: Target, waves: int = 4) -> int:
    """Programs for a kernel that loops over rows and keeps a per-program partial sum (weight gradients)."""
    return max(1, min(rows, waves * target.num_sms))


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_minus(x, m):
    """exp(x - m) as exp2((x - m) log2(e)). Triton lowers tl.exp to ex2.approx.f32 behind a range fix-up for
    subnormal results (an FSETP, an FSEL and two FMULs more an element in Triton 3.6's sm_90 SASS:
    benchmarks/sass_mix.py), tl.exp2 to ex2.approx.ftz.f32, whose results below 2^-126 are 0 (nothing beside a sum
    that holds exp(0) = 1). x - m first, not one FFMA of x log2(e) - m log2(e): that would err by an ulp of
    m log2(e) on every term, 1e-4 relative at logits of 1000."""
    return tl.exp2((x - m) * LOG2E)


@triton.jit
def online_max_sum_step(m_lane, s_lane, x):
    """One chunk of a streamed row: per-lane running max and sum of exp(x - max), the sum rescaled when the max
    grows. Lanes that have met no finite value keep sum 0 (avoids -inf - -inf)."""
    m_new = tl.maximum(m_lane, x)
    return m_new, tl.where(m_new > -float("inf"), s_lane * exp_minus(m_lane, m_new) + exp_minus(x, m_new), 0.0)


@triton.jit
def online_max_sum_total(m_lane, s_lane):
    """(max, sum of exp(x - max)) of the whole row from the per-lane running values."""
    m = tl.max(m_lane, axis=0)
    return m, tl.sum(tl.where(m_lane > -float("inf"), s_lane * exp_minus(m_lane, m), 0.0), axis=0)


@triton.jit
def sum_partials_kernel(
    PARTIAL,  # (B, G, N) fp32
    G,
    N,
    OUT,  # (B, N)
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNIT: tl.constexpr,
):
    """OUT[b, n] = sum_g PARTIAL[b, g, n]; grid (cdiv(N, BLOCK_N), B). N in units of UNIT elements (plan.in_units:
    jax-triton does not specialize ints), multiplied back first so that the rows are known 16-byte aligned."""
    N = N * UNIT
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g[:, None] < G) & (cols[None, :] < N)
        acc += tl.load(PARTIAL + (b * G + g[:, None]) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + b * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < N)


def sum_partials(partial: str, out: str, batch: int, programs: int, n: int, target: Target) -> Launch:
    """Launch that reduces a (batch, programs, n) fp32 partial buffer to (batch, n), each column summed by one program
    in a fixed order (deterministic). Up to 8192 columns: 16 columns a program (more programs over a narrow weight),
    2048 partials (8 KB) a step over 8 warps (benchmarks/sweep_sum_partials.py; at a Llama step's 8 MiB of partials
    2.2x faster on an H100 than the 4 warps / 4096 partials before); beyond, 64 columns, 4096 partials, 4 warps
    (benchmarks/results/h200/eager.md, "dweight partial sums")."""
    narrow = n <= 8192
    block_n = min(16 if narrow else 64, next_power_of_2(n))
    launch = Launch(
        sum_partials_kernel,
        grid=(cdiv(n, block_n), batch),
        reads=(partial, programs, n),
        writes=(out,),
        constexprs=dict(BLOCK_G=max(1, (2048 if narrow else 4096) // block_n), BLOCK_N=block_n),
        num_warps=8 if narrow else 4,
    )
    return in_units(launch, "N")
