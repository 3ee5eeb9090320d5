"""Kernels and plans of the normalization family (rms_norm, layer_norm), with an optional fused residual add.

    h = x + residual                     (rounded to x.dtype: it is returned, as in an unfused model)
    layer_norm: mean = mean(h), xhat = (h - mean) * rstd, rstd = 1 / sqrt(mean((h - mean)^2) + eps)
    rms_norm:   mean = 0,       xhat = h * rstd,          rstd = 1 / sqrt(mean(h^2) + eps)
    y = xhat * weight (+ bias)                                        over the last dim, in fp32

Backward, with g = dy * weight and dh the cotangent of the returned h:
    dx = dresidual = rstd * (g - xhat * mean(g * xhat) - mean(g)) + dh      (no mean(g) term for rms_norm)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy

Layout: `batch` independent problems of `rows` rows of `n` elements (batch > 1 is how a JAX vmap folds into one
launch; weight and bias are shared or one per problem).

In-register rows (n <= MAX_ROW_BLOCK forward, <= BACKWARD_MAX_ROW_BLOCK backward): one read of each input, one write
of each output: the algorithmic minimum. The forward runs a program per row; the backward a persistent grid of a
few programs per SM, each keeping dweight/dbias partials in registers (reduced by `sum_partials`) and loading the
next row while the current one reduces; up to ONE_PROGRAM_ROWS rows, one program per problem, which writes dweight /
dbias itself (one launch and no partials: the calls small enough to be bound by host time).

Wider rows are split across programs, in two launches, since a row's statistics need the whole row before any
output element and no program holds it (one launch would need programs that wait for each other: an ordered task
scheduler, as Triton's interpreter runs a launch's programs one after another). No spills; cuda:90 registers at the
benchmark's bf16 shapes: step 1 / step 2 forward 32-39 / 32-40, backward 40-64 / 40-42 (4-6 / 2-4 programs a SM):
  forward   1. norm_fwd_stats_kernel, one program per SPLIT_BLOCK-element segment of a row: h = x + residual
               (stored), the segment's sum(h^2), or sum(h) and its sum of squares about the segment mean;
            2. norm_fwd_apply_kernel, same grid: (mean, rstd) from the segment sums (Chan's combination for the
               variance), y from h; rows visited last first, so that the h written last is still in L2.
  backward  1. norm_bwd_stats_kernel, a program per (column chunk, group of rows): per row sum(xhat * g) and
               sum(g) over the chunk, and over the group dweight / dbias partials (in registers, one row per group);
            2. norm_bwd_apply_kernel, a program per row segment: dx from the rows' sums; rows visited in the
               reverse of the order step 1 finished them (its last tiles are still in L2).
Bytes per element of the split path (design limit; s = element size, 2 for bf16; algorithmic minimum in brackets):
  forward   with residual: x, r read, h written, h read, y written = 5s   [4s]  -> at most 80% of copy speed
            without:       x read twice, y written                  = 3s   [2s]  -> 67%
  backward  with dh:       h, dy read twice, dh read, dx written    = 6s   [4s]  -> 67%
            without:       h, dy read twice, dx written             = 5s   [3s]  -> 60%
less what the second launch finds in L2 (up to the L2 size of the data step 1 touched last), plus fp32 partials of
8 bytes per row per chunk and 4 bytes per column per row group (under 2% at the benchmark's shapes).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, not_arrays, round_to
from .rows import MAX_ROW_BLOCK, WIDTH_BUCKETS, programs_per_problem, row_block, sum_partials

BACKWARD_MAX_ROW_BLOCK = 8192  # in-register rows of the backward (h, dy, dh, weight and two accumulators live)
ONE_PROGRAM_ROWS = 8  # rows a problem's in-register backward handles in one program (one launch, no partials)
# rows of the in-register backward whose loads are in flight while one reduces (its kernel's ROWS_AHEAD). With 1, Triton
# 3.6's sm_90 build at 4096 columns with dh takes 170 registers: one 8-warp program an SM, ~24 KB of loads in flight
BACKWARD_ROWS_AHEAD = 1
# Bytes of a row a thread of the in-register backward holds: 16-bit rows take half the forward's warps, float32 rows
# as many (16 elements a thread spill there on sm_80). benchmarks/sweep_row_warps.py on an H100 (2026-12-05; 2^26 bf16
# elements, rms_norm, % of copy with 16 / 8 elements a thread on the same grid): 1024 wide 78 / 72, 2048 84 / 80,
# 4096 87 / 76; 8192 (16 warps either way) 84.
BACKWARD_BYTES_PER_THREAD = 32
SPLIT_BLOCK = 8192  # elements of a row segment, one program each, in the split forward and the split backward's dx
BACKWARD_STATS_TILE = (1, 2048)  # rows x columns a step of the split backward's statistics program
# Programs of the split backward's statistics launch per SM, keyed (is_rms, has_bias, fp32 input): all resident at
# once (one wave: none is left to a tail, and their last tiles are still in L2 for the dx launch). From the register
# counts on cuda:90 (Triton 3.9, 256 threads a program): rms_norm 40 (fp32: 48), layer_norm 60 (64), with bias 64 (86).
BACKWARD_STATS_PROGRAMS_PER_SM = {
    (True, False, False): 6, (True, False, True): 5, (False, False, False): 4, (False, False, True): 4,
    (False, True, False): 4, (False, True, True): 2,
}  # fmt: skip
SEGMENT_SUMS_BLOCK = 64  # per-row partial sums read per step
# The kernels take the row width N and the strides in units of UNIT elements (plan.in_units: jax-triton does not
# specialize int arguments) and multiply them back first: rows then start 16-byte aligned and loads and stores
# vectorize under every launcher.


@triton.jit
def _load_sum(x_ptr, r_ptr, h_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """h = x (+ residual, rounded to x's dtype and stored to h_ptr), returned in fp32."""
    h = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _mean(total, N):
    """total / N rounded correctly (IEEE division, not the approximate one): a row whose values are all equal must
    centre to exactly zero, since rstd = 1/sqrt(eps) then magnifies any residue (n = 1 rows, constant rows)."""
    return tl.math.div_rn(total, N * 1.0)


@triton.jit
def _row_stats(MEAN, RSTD, row, IS_RMS: tl.constexpr):
    """(mean, rstd) the forward saved for a row; rms_norm has no mean."""
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(MEAN + row)
    return mean, tl.load(RSTD + row)


@triton.jit
def norm_fwd_kernel(
    X, R, W, B, eps, rows, N, stride_x, stride_r, stride_w,
    Y, H, MEAN, RSTD,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    UNIT: tl.constexpr,
):  # fmt: skip
    """Grid (rows, batch): one program per row, the row (up to BLOCK_N elements) in registers."""
    N, stride_x, stride_r, stride_w = N * UNIT, stride_x * UNIT, stride_r * UNIT, stride_w * UNIT
    eps = tl.cast(eps, tl.float32)  # torch.compile passes floats as fp64
    b = tl.program_id(1).to(tl.int64)
    row = b * rows + tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    xc = _load_sum(X + row * stride_x, R + row * stride_r, H + row * N, cols, mask, HAS_RESIDUAL)
    if not IS_RMS:
        mean = _mean(tl.sum(xc, axis=0), N)
        xc = tl.where(mask, xc - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = tl.rsqrt(_mean(tl.sum(xc * xc, axis=0), N) + eps)
    y = xc * rstd * tl.load(W + b * stride_w + cols, mask=mask).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + b * stride_w + cols, mask=mask).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _segment(S, rows, REVERSE: tl.constexpr):
    """(problem, row, segment) of this program in a grid (S * rows, batch) of row segments, the row counted over all
    problems; REVERSE visits the rows last first."""
    b = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) // S
    if REVERSE:
        r = rows - 1 - r
    return b, b * rows + r, tl.program_id(0) % S


@triton.jit
def norm_fwd_stats_kernel(
    X, R, rows, N, stride_x, stride_r,
    H, PARTIAL,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Split forward, step 1. Grid (S * rows, batch), S = cdiv(N, BLOCK_N) segments a row: h = x (+ residual) over one
    segment, stored with a residual, and the segment's sums PARTIAL[row, s] = (sum(h^2), unused) for rms_norm,
    (sum(h), sum((h - segment mean)^2)) for layer_norm (exact two-pass sums: the segment is in registers)."""
    N, stride_x, stride_r = N * UNIT, stride_x * UNIT, stride_r * UNIT
    S = tl.cdiv(N, BLOCK_N)
    _, row, s = _segment(S, rows, False)
    cols = s * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    h = _load_sum(X + row * stride_x, R + row * stride_r, H + row * N, cols, mask, HAS_RESIDUAL)
    part = PARTIAL + (row * S + s) * 2
    if IS_RMS:
        tl.store(part, tl.sum(h * h, axis=0))
    else:
        total = tl.sum(h, axis=0)
        d = tl.where(mask, h - _mean(total, tl.minimum(N - s * BLOCK_N, BLOCK_N)), 0.0)
        tl.store(part, total)
        tl.store(part + 1, tl.sum(d * d, axis=0))


@triton.jit
def _row_stats_of_segments(P, S, N, eps, IS_RMS: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_S: tl.constexpr):
    """(mean, rstd) of a row from the sums of its S segments at P (norm_fwd_stats_kernel); the variance by Chan's
    combination, sum over segments of M2_s + n_s * (mean_s - mean)^2 (no E[h^2] - mean^2 cancellation)."""
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        acc += tl.load(P + s * 2, mask=s < S, other=0.0)
    total = tl.sum(acc, axis=0)
    mean = 0.0
    if IS_RMS:
        rstd = tl.rsqrt(_mean(total, N) + eps)
    else:
        mean = _mean(total, N)
        acc = tl.zeros([BLOCK_S], dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            m = s < S
            count = tl.maximum(tl.minimum(N - s * SEGMENT, SEGMENT), 1) * 1.0
            d = tl.math.div_rn(tl.load(P + s * 2, mask=m, other=0.0), count) - mean
            acc += tl.where(m, tl.load(P + s * 2 + 1, mask=m, other=0.0) + count * d * d, 0.0)
        rstd = tl.rsqrt(_mean(tl.sum(acc, axis=0), N) + eps)
    return mean, rstd


@triton.jit
def norm_fwd_apply_kernel(
    SRC, W, B, PARTIAL, eps, rows, N, stride_src, stride_w,
    Y, MEAN, RSTD,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Split forward, step 2. Grid as step 1, rows last first (the h that step 1 wrote last is still in L2): the
    row's (mean, rstd) from its PARTIAL sums (stored by segment 0's program), and y over one segment of SRC (h, or x
    without a residual)."""
    N, stride_src, stride_w = N * UNIT, stride_src * UNIT, stride_w * UNIT
    eps = tl.cast(eps, tl.float32)  # torch.compile passes floats as fp64
    S = tl.cdiv(N, BLOCK_N)
    b, row, s = _segment(S, rows, True)
    mean, rstd = _row_stats_of_segments(PARTIAL + row * S * 2, S, N, eps, IS_RMS, BLOCK_N, BLOCK_S)
    cols = s * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    y = (tl.load(SRC + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
    y *= tl.load(W + b * stride_w + cols, mask=mask).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + b * stride_w + cols, mask=mask).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    if s == 0:
        if not IS_RMS:
            tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)


@triton.jit
def _load_row(DY, H, DH, MEAN, RSTD, row, row_end, stride_dy, stride_h, stride_dh, cols, mask, IS_RMS: tl.constexpr,
              HAS_DH: tl.constexpr):  # fmt: skip
    """(h, dy, dh) of one row in their stored dtype and its saved (mean, rstd); zeros past the problem's rows."""
    mask = mask & (cols < tl.where(row < row_end, cols.shape[0], 0))  # (an & with a scalar fails in the interpreter)
    last = tl.minimum(row, row_end - 1)  # the stats of a row past the end: any valid address, unused
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0)
    dh = tl.zeros_like(dy)
    if HAS_DH:
        dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0)
    mean, rstd = _row_stats(MEAN, RSTD, last, IS_RMS)
    return h, dy, dh, mean, rstd


@triton.jit
def norm_bwd_kernel(
    DY, H, W, MEAN, RSTD, DH, rows, N, stride_dy, stride_h, stride_w, stride_dh,
    DX, DW_PARTIAL, DB_PARTIAL,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    UNIT: tl.constexpr, ROWS_AHEAD: tl.constexpr = 1,
):  # fmt: skip
    """Grid (G, batch): program g handles rows g, g + G, ... of its problem, each in registers (up to BLOCK_N
    elements), and writes DW/DB_PARTIAL[b, g, :] (fp32 partials; with G = 1 the gradients, in their dtype).
    ROWS_AHEAD (1 or 2): rows whose loads are in flight while one reduces (2: twice the bytes in flight an SM, for
    ~1.5 registers an element more)."""
    N, stride_dy, stride_h, stride_w, stride_dh = (N * UNIT, stride_dy * UNIT, stride_h * UNIT, stride_w * UNIT,
                                                   stride_dh * UNIT)  # fmt: skip
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    partial = (b * G + g) * N
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + b * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    # software pipelining by hand: the next row's loads are in flight while this row reduces and stores
    row_end = (b + 1) * rows
    nxt = _load_row(DY, H, DH, MEAN, RSTD, b * rows + g, row_end, stride_dy, stride_h, stride_dh, cols, mask, IS_RMS,
                    HAS_DH)  # fmt: skip
    if ROWS_AHEAD == 2:
        nxt2 = _load_row(DY, H, DH, MEAN, RSTD, b * rows + g + G, row_end, stride_dy, stride_h, stride_dh, cols, mask,
                         IS_RMS, HAS_DH)  # fmt: skip
    for m in range(g, rows, G):
        row = b * rows + m
        h, dy, dh, mean, rstd = nxt
        h, dy = h.to(tl.float32), dy.to(tl.float32)
        if ROWS_AHEAD == 2:
            nxt = nxt2
            nxt2 = _load_row(DY, H, DH, MEAN, RSTD, row + 2 * G, row_end, stride_dy, stride_h, stride_dh, cols, mask,
                             IS_RMS, HAS_DH)  # fmt: skip
        else:
            nxt = _load_row(DY, H, DH, MEAN, RSTD, row + G, row_end, stride_dy, stride_h, stride_dh, cols, mask,
                            IS_RMS, HAS_DH)  # fmt: skip
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        wdy = w * dy
        dx = wdy - xhat * (_mean(tl.sum(xhat * wdy, axis=0), N))
        if not IS_RMS:
            dx -= _mean(tl.sum(wdy, axis=0), N)
        dx = dx * rstd + dh.to(tl.float32)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PARTIAL + partial + cols, dw.to(DW_PARTIAL.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial + cols, db.to(DB_PARTIAL.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(DY, H, MEAN, RSTD, r, end, stride_dy, stride_h, cols, cmask, IS_RMS: tl.constexpr):
    """h and dy of rows r (a vector; zeros from row `end` on) over columns cols, in their stored dtype, and the rows'
    saved (mean, rstd)."""
    rmask = r < end
    mask = rmask[:, None] & cmask[None, :]
    h = tl.load(H + r[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + r[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + r, mask=rmask, other=0.0)
    mean = tl.zeros_like(rstd)
    if not IS_RMS:
        mean = tl.load(MEAN + r, mask=rmask, other=0.0)
    return h, dy, mean, rstd


@triton.jit
def norm_bwd_stats_kernel(
    DY, H, W, MEAN, RSTD, rows, N, group_rows, stride_dy, stride_h, stride_w,
    PARTIAL, DW_PARTIAL, DB_PARTIAL,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Split backward, step 1. Grid (C * G, batch), C = cdiv(N, BLOCK_N) column chunks, G groups of group_rows rows:
    program (g, c) reads h and dy of its group's rows over chunk c once, BLOCK_M rows at a time (the next tile's loads
    in flight while this one reduces). Per row PARTIAL[row, c] = (sum(xhat * w * dy), sum(w * dy)); over its rows
    DW_PARTIAL[g, cols] = sum(dy * xhat), DB_PARTIAL[g, cols] = sum(dy) (xhat from the forward's mean and rstd)."""
    N, stride_dy, stride_h, stride_w = N * UNIT, stride_dy * UNIT, stride_h * UNIT, stride_w * UNIT
    C = tl.cdiv(N, BLOCK_N)
    G = tl.num_programs(0) // C
    c = tl.program_id(0) % C
    g = tl.program_id(0) // C
    b = tl.program_id(1).to(tl.int64)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + b * stride_w + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = b * rows + g * group_rows + tl.arange(0, BLOCK_M)
    end = b * rows + tl.minimum((g + 1) * group_rows, rows)
    # software pipelining by hand: the next tile's loads are in flight while this one reduces (a second tile ahead
    # would cost register moves that wait for the loads just issued)
    nxt = _load_tile(DY, H, MEAN, RSTD, first, end, stride_dy, stride_h, cols, cmask, IS_RMS)
    for m in range(g * group_rows, tl.minimum((g + 1) * group_rows, rows), BLOCK_M):
        r = b * rows + m + tl.arange(0, BLOCK_M)
        h, dy, mean, rstd = nxt
        nxt = _load_tile(DY, H, MEAN, RSTD, r + BLOCK_M, end, stride_dy, stride_h, cols, cmask, IS_RMS)
        dy = dy.to(tl.float32)
        xhat = (h.to(tl.float32) - mean[:, None]) * rstd[:, None]  # finite where masked, and multiplied by dy = 0
        wdy = w[None, :] * dy
        part = PARTIAL + (r * C + c) * 2
        tl.store(part, tl.sum(xhat * wdy, axis=1), mask=r < end)
        if not IS_RMS:
            tl.store(part + 1, tl.sum(wdy, axis=1), mask=r < end)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PARTIAL + (b * G + g) * N + cols, tl.sum(dw, axis=0), mask=cmask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + (b * G + g) * N + cols, tl.sum(db, axis=0), mask=cmask)


@triton.jit
def norm_bwd_apply_kernel(
    DY, H, W, MEAN, RSTD, DH, PARTIAL, rows, N, chunks, group_rows, stride_dy, stride_h, stride_w, stride_dh,
    DX,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Split backward, step 2. Grid (S * G * group_rows, batch), S = cdiv(N, BLOCK_N) segments a row, step 1's G groups
    of group_rows rows: dx over one segment of a row, from the row's sums over step 1's `chunks` chunks:
        dx = rstd * (w * dy - xhat * sum(xhat * w * dy) / N - sum(w * dy) / N) (+ dh)
    Step 1's programs end on the last rows of their groups, whose h and dy are then still in L2: this grid visits the
    rows group tails first (programs past the last row of a short last group do nothing)."""
    N, stride_dy, stride_h, stride_w, stride_dh = (N * UNIT, stride_dy * UNIT, stride_h * UNIT, stride_w * UNIT,
                                                   stride_dh * UNIT)  # fmt: skip
    S = tl.cdiv(N, BLOCK_N)
    G = tl.cdiv(rows, group_rows)
    s = tl.program_id(0) % S
    q = tl.program_id(0) // S
    local = (q % G) * group_rows + group_rows - 1 - q // G
    b = tl.program_id(1).to(tl.int64)
    row = b * rows + tl.minimum(local, rows - 1)  # a valid row for the scalar loads; nothing is stored past the end
    n_valid = tl.where(local < rows, N, 0)
    acc_xg = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        acc_xg += tl.load(PARTIAL + (row * chunks + c) * 2, mask=c < chunks, other=0.0)
        if not IS_RMS:
            acc_g += tl.load(PARTIAL + (row * chunks + c) * 2 + 1, mask=c < chunks, other=0.0)
    c_xg = _mean(tl.sum(acc_xg, axis=0), N)
    c_g = 0.0 if IS_RMS else _mean(tl.sum(acc_g, axis=0), N)
    mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS)
    cols = s * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_valid
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + b * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
    dx = (w * dy - (h - mean) * rstd * c_xg - c_g) * rstd
    if HAS_DH:
        dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _warps(block: int, target: Target) -> int:
    """Warps of a program over a block of `block` elements (rows.row_block's: a 16-byte vector of bf16 a thread)."""
    return row_block(block, target)[2]


def forward(
    batch: int, rows: int, n: int, *, is_rms: bool, x_dtype: str, weight_dtype: str, has_residual: bool,
    has_bias: bool, eps: float, target: Target, stride_x: int | None = None, stride_residual: int | None = None,
    weight_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs x (batch*rows rows of n, row stride stride_x), weight ((batch,) n), [bias], [residual].
    Outputs y (batch, rows, n), [h (batch, rows, n)], [mean (batch, rows) fp32, layer_norm], rstd (batch, rows)."""
    empty = batch * rows * n == 0
    buffers = {"y": BufferSpec((batch, rows, n), x_dtype, zeroed=empty)}
    if has_residual:
        buffers["h"] = BufferSpec((batch, rows, n), x_dtype, zeroed=empty)
    if not is_rms:
        buffers["mean"] = BufferSpec((batch, rows), "float32", zeroed=empty)
    buffers["rstd"] = BufferSpec((batch, rows), "float32", zeroed=empty)
    outputs = tuple(buffers)
    stride_x = n if stride_x is None else stride_x
    stride_r = n if stride_residual is None else stride_residual
    stride_w = n if weight_batched else 0
    flags = dict(IS_RMS=is_rms, HAS_RESIDUAL=has_residual, HAS_BIAS=has_bias)
    launches = ()
    if empty:
        pass
    elif n <= MAX_ROW_BLOCK:
        block = next_power_of_2(n)
        launches = (
            in_units(Launch(
                norm_fwd_kernel,
                grid=(rows, batch),
                reads=("x", "residual" if has_residual else None, "weight", "bias" if has_bias else None, eps,
                       rows, n, stride_x, stride_r, stride_w),
                writes=("y", "h" if has_residual else None, None if is_rms else "mean", "rstd"),
                constexprs=dict(**flags, BLOCK_N=block),
                num_warps=_warps(block, target),
            ), "N", "stride_x", "stride_r", "stride_w"),
        )  # fmt: skip
    else:  # split rows: segment statistics, then normalize (see the module docstring)
        segments = cdiv(n, SPLIT_BLOCK)
        buffers["partial"] = BufferSpec((batch, rows, segments, 2), "float32")
        warps = _warps(SPLIT_BLOCK, target)
        launches = (
            in_units(Launch(
                norm_fwd_stats_kernel,
                grid=(segments * rows, batch),
                reads=("x", "residual" if has_residual else None, rows, n, stride_x, stride_r),
                writes=("h" if has_residual else None, "partial"),
                constexprs=dict(IS_RMS=is_rms, HAS_RESIDUAL=has_residual, BLOCK_N=SPLIT_BLOCK),
                num_warps=warps,
            ), "N", "stride_x", "stride_r"),
            in_units(Launch(
                norm_fwd_apply_kernel,
                grid=(segments * rows, batch),
                reads=("h" if has_residual else "x", "weight", "bias" if has_bias else None, "partial", eps, rows, n,
                       n if has_residual else stride_x, stride_w),
                writes=("y", None if is_rms else "mean", "rstd"),
                constexprs=dict(IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_N=SPLIT_BLOCK, BLOCK_S=SEGMENT_SUMS_BLOCK),
                num_warps=warps,
            ), "N", "stride_src", "stride_w"),
        )  # fmt: skip
    inputs = {"x": x_dtype, "weight": weight_dtype}
    inputs |= ({"bias": weight_dtype} if has_bias else {}) | ({"residual": x_dtype} if has_residual else {})
    return Plan(inputs, buffers, launches, outputs)


def backward(
    batch: int, rows: int, n: int, *, is_rms: bool, x_dtype: str, weight_dtype: str, has_bias: bool, has_dh: bool,
    target: Target, stride_dy: int | None = None, stride_h: int | None = None, stride_dh: int | None = None,
    weight_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs dy, h (the normalized input: x, or x + residual), weight, [mean], rstd, [dh].
    Outputs dx (batch, rows, n) in x's dtype, dweight and [dbias] (batch, n) in weight's dtype."""
    empty = batch * rows * n == 0
    grads = ("dweight", "dbias") if has_bias else ("dweight",)
    buffers = {"dx": BufferSpec((batch, rows, n), x_dtype, zeroed=empty)}
    buffers |= {name: BufferSpec((batch, n), weight_dtype, zeroed=empty) for name in grads}
    partials = tuple(f"{name}_partial" for name in grads)
    strides = (n if stride_dy is None else stride_dy, n if stride_h is None else stride_h, n if weight_batched else 0)
    stride_dh = n if stride_dh is None else stride_dh
    stats = ("dy", "h", "weight", None if is_rms else "mean", "rstd")
    launches = ()
    if empty:
        pass
    elif n <= BACKWARD_MAX_ROW_BLOCK:
        block = next_power_of_2(n)
        warps = row_block(block, target, per_thread=BACKWARD_BYTES_PER_THREAD // ITEMSIZE[x_dtype])[2]
        # 1024 threads an SM (narrow rows: many one-warp programs), 4 to 32 programs an SM
        programs = programs_per_problem(rows, target, waves=max(4, min(32, 1024 // (warps * target.warp_size))))
        if rows <= ONE_PROGRAM_ROWS:  # the one program writes the gradients themselves
            programs, partials = 1, grads
        else:
            buffers |= {p: BufferSpec((batch, programs, n), "float32") for p in partials}
        launches = (
            in_units(Launch(
                norm_bwd_kernel,
                grid=(programs, batch),
                reads=stats + ("dh" if has_dh else None, rows, n, *strides, stride_dh),
                writes=("dx", partials[0], partials[1] if has_bias else None),
                constexprs=dict(IS_RMS=is_rms, HAS_DH=has_dh, HAS_BIAS=has_bias, BLOCK_N=block,
                                ROWS_AHEAD=BACKWARD_ROWS_AHEAD),
                num_warps=warps,
            ), "N", "stride_dy", "stride_h", "stride_w", "stride_dh"),
        ) + tuple(sum_partials(p, name, batch, programs, n, target) for p, name in zip(partials, grads)
                  if p != name)  # fmt: skip
    else:  # split rows: row sums and weight-gradient partials, then dx (see the module docstring)
        tile_rows, tile_cols = BACKWARD_STATS_TILE
        chunks = cdiv(n, tile_cols)
        per_sm = BACKWARD_STATS_PROGRAMS_PER_SM[is_rms, has_bias, x_dtype == "float32"]
        groups = max(1, min(cdiv(rows, tile_rows), per_sm * target.num_sms // chunks))
        group_rows = cdiv(cdiv(rows, groups), tile_rows) * tile_rows
        groups = cdiv(rows, group_rows)
        segments = cdiv(n, SPLIT_BLOCK)
        buffers["row_partial"] = BufferSpec((batch, rows, chunks, 2), "float32")
        buffers |= {p: BufferSpec((batch, groups, n), "float32") for p in partials}
        launches = (
            in_units(Launch(
                norm_bwd_stats_kernel,
                grid=(chunks * groups, batch),
                reads=stats + (rows, n, group_rows, *strides),
                writes=("row_partial", partials[0], partials[1] if has_bias else None),
                constexprs=dict(IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_M=tile_rows, BLOCK_N=tile_cols),
                num_warps=_warps(tile_rows * tile_cols, target),
            ), "N", "stride_dy", "stride_h", "stride_w"),
            in_units(Launch(
                norm_bwd_apply_kernel,
                grid=(segments * groups * group_rows, batch),
                reads=stats + ("dh" if has_dh else None, "row_partial", rows, n, chunks, group_rows, *strides,
                               stride_dh),
                writes=("dx",),
                constexprs=dict(IS_RMS=is_rms, HAS_DH=has_dh, BLOCK_N=SPLIT_BLOCK, BLOCK_C=SEGMENT_SUMS_BLOCK),
                num_warps=_warps(SPLIT_BLOCK, target),
            ), "N", "stride_dy", "stride_h", "stride_w", "stride_dh"),
        ) + tuple(sum_partials(p, name, batch, groups, n, target) for p, name in zip(partials, grads))  # fmt: skip
    inputs = {"dy": x_dtype, "h": x_dtype, "weight": weight_dtype} | ({} if is_rms else {"mean": "float32"})
    inputs |= {"rstd": "float32"} | ({"dh": x_dtype} if has_dh else {})
    return Plan(inputs, buffers, launches, ("dx",) + grads)


def plans(target: Target, is_rms: bool):
    """Every configuration the heuristics can choose (the AOT matrix)."""
    for dtype in FLOAT_DTYPES:
        for n in WIDTH_BUCKETS:
            for fused in (False, True):  # residual in the forward, dh in the backward; bias with them (layer_norm)
                kw = dict(
                    is_rms=is_rms, x_dtype=dtype, weight_dtype=dtype, has_bias=fused and not is_rms, target=target
                )
                yield forward(1, 64, n, has_residual=fused, eps=1e-6, **kw)
                yield backward(1, 64, n, has_dh=fused, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# validation, reference, cost, samples shared by the family


def check(op: str, x, weight, bias, residual, eps) -> None:
    checks.check_min_ndim(op, "x", x, 1)
    dtype = checks.check_float(op, "x", x)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None or name == "weight":
            checks.check_float(op, name, param)
            checks.check_shape(op, name, param, x.shape[-1:], "the last dim of x")
    if residual is not None:
        checks.check_same_dtype(op, "residual", residual, dtype, "the dtype of x")
        checks.check_shape(op, "residual", residual, x.shape, "the shape of x")
    checks.check_positive(op, "eps", eps)


def _mean_last(a):
    return np.sum(a, axis=-1, keepdims=True) / max(a.shape[-1], 1)


def _normalized(x, eps, residual, is_rms):
    """(h, xhat, rstd) in float64; h rounded to x's dtype as the op returns it."""
    h = x if residual is None else round_to(x.astype(np.float64) + residual.astype(np.float64), str(x.dtype))
    h = h.astype(np.float64)
    centered = h if is_rms else h - _mean_last(h)
    rstd = 1.0 / np.sqrt(_mean_last(centered * centered) + eps)
    return h, centered * rstd, rstd


def reference(x, weight, bias, eps, residual, is_rms):
    """Outputs (y,) or (y, h) in float64."""
    h, xhat, _ = _normalized(x, eps, residual, is_rms)
    y = xhat * weight.astype(np.float64) + (0.0 if bias is None else bias.astype(np.float64))
    return (y,) if residual is None else (y, h)


def reference_vjp(kwargs, cotangents, is_rms):
    x, weight, bias, residual = kwargs["x"], kwargs["weight"], kwargs.get("bias"), kwargs.get("residual")
    _, xhat, rstd = _normalized(x, kwargs["eps"], residual, is_rms)
    dy = cotangents[0].astype(np.float64)
    g = dy * weight.astype(np.float64)
    dx = rstd * (g - xhat * _mean_last(g * xhat) - (0.0 if is_rms else _mean_last(g)))
    if residual is not None:
        dx = dx + cotangents[1].astype(np.float64)
    n = x.shape[-1]
    grads = {"x": dx, "weight": (dy * xhat).reshape(-1, n).sum(axis=0)}
    if bias is not None:
        grads["bias"] = dy.reshape(-1, n).sum(axis=0)
    if residual is not None:
        grads["residual"] = dx
    return grads


def cost(kwargs) -> tuple[Cost, Cost]:
    x, weight, residual = kwargs["x"], kwargs["weight"], kwargs.get("residual")
    numel, n = int(np.prod(x.shape)), x.shape[-1]
    rows = numel // max(n, 1)
    params = 1 if kwargs.get("bias") is None else 2
    item, witem = ITEMSIZE[str(x.dtype)], ITEMSIZE[str(weight.dtype)]
    streams_fwd = 2 if residual is None else 4  # x, y (+ residual, h)
    streams_bwd = 3 if residual is None else 4  # dy, h, dx (+ dh)
    fwd = Cost(numel * item * streams_fwd + params * n * witem + rows * 8, 6 * numel)
    bwd = Cost(numel * item * streams_bwd + 2 * params * n * witem + rows * 8, 10 * numel)
    return fwd, bwd


def sample(rng: np.random.Generator, shape, dtype: str, residual=False, eps=1e-6, bias=False) -> dict:
    """Inputs with a non-zero mean (x ~ N(0.5, 2)) so that centering matters."""
    n = shape[-1:]
    kwargs = {"x": round_to(rng.standard_normal(shape) * 2.0 + 0.5, dtype),
              "weight": round_to(rng.uniform(-2, 2, n), dtype), "eps": eps}  # fmt: skip
    if bias:
        kwargs["bias"] = round_to(rng.standard_normal(n), dtype)
    if residual:
        kwargs["residual"] = round_to(rng.standard_normal(shape), dtype)
    return kwargs


def bad_inputs(op: str, kwargs) -> list[BadInput]:
    x, weight = kwargs["x"], kwargs["weight"]
    other = np.float16 if x.dtype != np.float16 else np.float32
    return [
        BadInput({"x": x.astype(np.int32)}, TypeError, f"{op}: x must have dtype"),
        BadInput({"weight": np.zeros(weight.shape[0] + 1, weight.dtype)}, ValueError, f"{op}: weight must have shape"),
        BadInput({"residual": np.zeros(x.shape + (1,), x.dtype)}, ValueError, f"{op}: residual must have shape"),
        BadInput({"residual": x.astype(other)}, TypeError, f"{op}: residual must have dtype"),
        BadInput({"eps": 0.0}, ValueError, f"{op}: eps must be a finite number > 0, got 0.0"),
        BadInput({"eps": None}, TypeError, f"{op}: eps must be a finite number > 0, got None"),
        BadInput({"eps": "a"}, TypeError, f"{op}: eps must be a finite number > 0, got 'a'"),
        *not_arrays(op, "x", "weight"),
    ]
