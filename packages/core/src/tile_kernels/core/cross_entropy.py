"""Cross-entropy over the last dim of 2-D logits (N, V) with integer targets, as torch.nn.functional.cross_entropy.

    lse = log(sum(exp(x)))                                 per row, in fp32
    loss_row = (1 - eps) * (lse - x[target]) + eps * (lse - mean(x))      eps = label_smoothing
    rows whose target is ignore_index have loss 0 and do not count; reduction mean = sum / count (NaN if none count)
Backward, with g the row's cotangent (dloss, or dloss / count for mean, 0 for ignored rows):
    dlogits = g * (softmax(x) - (1 - eps) * onehot(target) - eps / V)

Forward: rows of up to MAX_ROW_BLOCK classes are read once into registers, in tiles of TILE elements (several
narrow rows a tile) by a persistent grid of programs that load the next tile while the current one reduces (max,
then sum of exp); x[target] is gathered, not reduced. Wider rows (128K vocabularies) are split: a program per
SEGMENT classes of a row writes the segment's (max, sum of exp, sum), a second launch combines them per row (one
read of the logits, one exp a logit; a row per program streaming its chunks was latency-bound and spent two exps a
logit on the online rescaling, kept only where fused_linear_cross_entropy writes the gradient in place in a second
pass over the row). A reduction ('mean' / 'sum') is a last, one-program launch over the per-row losses; where one
tile of the forward holds all rows of a problem (small inputs: a host-bound call), its program reduces them (REDUCE).
Bytes per logit (s = element size; design limit): forward s, plus per row the target read and 12 bytes written
(loss, lse, valid flag; the reduction reads 8 of them again), backward 2s. The backward recomputes softmax from the
saved lse, fully parallel over (row, vocabulary block). A target outside [0, V) that is not ignore_index gives a NaN
loss (no host sync to raise an error). `batch` independent problems (a JAX vmap folded into one launch) each reduce
over their own rows.

The forward kernel can also write dlogits for a unit cotangent per row (0 for ignored rows; WRITE_GRAD), over the
logits in place: fused_linear_cross_entropy uses it on each chunk of logits, so that the gradient costs no second
pass. Both kernels take the rows they work on as views (`forward_launch` / `backward_launch` build their launches
for this op and for that one).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import (
    FLOAT_DTYPES,
    ITEMSIZE,
    BufferSpec,
    Launch,
    Plan,
    Rows,
    Target,
    cdiv,
    dtype_name,
    in_units,
    next_power_of_2,
)
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to
from .rows import (
    MAX_ROW_BLOCK,
    WIDTH_BUCKETS,
    exp_minus,
    online_max_sum_step,
    online_max_sum_total,
    programs_per_problem,
    row_block,
)

NAME = "cross_entropy"
REDUCTIONS = ("none", "sum", "mean")
TARGET_DTYPES = ("int32", "int64")
TILE = 4096  # elements of a forward tile: narrow rows are read several at a time
# Warps of a forward tile: 64 of its elements a thread, at least 4 warps; rows of 1024-4096 classes (FEW_WARPS_CLASSES)
# 2 warps, on the grid of 4-warp programs. benchmarks/sweep_row_warps.py (2^26 bf16 logits, % of copy), 1024 / 2048 /
# 4096 classes: 4 warps 51 / 63 / 68 on an H100 (2026-12-05), 37 / 46 / 59 on an H200 (2026-12-02); 2 warps 58 / 66 /
# 71 on the H100. 1 warp at 1024 classes measured 62% (H100) and 49% (H200), but holds 128 elements a thread: the AOT
# matrix's builds spill 16-168 B; 2 warps spill 8-64 B in 9 sm_90 builds, all with label smoothing. 256 classes (16
# rows a tile) keep 4 (2 warps: 36 against 40%). Wavefront-64 targets: not measured, 4 warps.
TILE_PER_THREAD, TILE_MIN_WARPS = 64, 4
FEW_WARPS_CLASSES = (1024, 4096)
REDUCE_BLOCK = 16384  # row losses a step of the loss reduction (one step at 16K rows)
SEGMENT = 8192  # classes a program of the split forward of rows wider than MAX_ROW_BLOCK
# chunk of a streamed row (fused_linear_cross_entropy's chunks) and the kernel's BLOCK_ONLINE (one running max / sum
# a row, one exp a logit, few registers: 32-warp programs and 32768-wide chunks fit): benchmarks/sweep_ce_wide.py,
# 1024 x 128256 bf16 on an H100 (2026-12-08), 240 us (73% of copy) against 290 for the per-lane running max at 8192 /
# 16 warps, its best; a persistent grid of 1-2 programs an SM 244-248 us. 64 registers a thread at 32 warps: the
# variants with per-row losses and a validity mask spill 8-16 B on sm_90, up to 144 B on sm_80 (Triton 3.6)
STREAM_BLOCK, STREAM_WARPS = 32768, 32
STREAM_ONLINE = True
COMBINE_ROWS, COMBINE_SEGMENTS = 16, 32  # rows and segments a step of its combining launch
# The row widths and strides are passed in units of 16 elements where they all divide (plan.in_units) and multiplied
# back by UNIT first: rows then start 16-byte aligned and the loads and stores vectorize under jax-triton too. The
# combining kernel only gathers x[target] from the logits: nothing there to vectorize, it takes them as they are.


@triton.jit
def _dlogits(x, lse, cols, t, smoothing, V, SMOOTH: tl.constexpr):
    """d loss_row / d logits for a unit cotangent: softmax(x) - (1 - eps) * onehot(t) - eps / V."""
    d = exp_minus(x, lse) - tl.where(cols == t, 1.0 - smoothing, 0.0)
    if SMOOTH:
        d -= smoothing / V
    return d


@triton.jit
def _load_tile(LOGITS, TARGET, r, row_end, V, stride_row, cols):
    """Loads of a tile of rows r (a vector; nothing past row_end): logits [rows, BLOCK_V] in their stored dtype (-inf
    past V), the targets, and x[target] (0 for a target outside [0, V)), gathered directly."""
    rmask = r < row_end
    t = tl.load(TARGET + r, mask=rmask, other=0).to(tl.int64)
    x_ptr = LOGITS + r * stride_row
    x = tl.load(x_ptr[:, None] + cols[None, :], mask=rmask[:, None] & (cols[None, :] < V), other=-float("inf"))
    x_t = tl.load(x_ptr + t, mask=rmask & (t >= 0) & (t < V), other=0.0)
    return x, t, x_t


@triton.jit
def _row_losses(LOSS, LSE, VALID, r, row_end, lse, x_t, sum_x, t, V, ignore_index, smoothing, SMOOTH: tl.constexpr,
                HAS_VALID: tl.constexpr, PER_ROW: tl.constexpr):  # fmt: skip
    """Stores the lse of rows r (vectors, or scalars for one row) and, PER_ROW, their losses (0 for ignored rows) and
    valid flags; returns the ignored mask, and the losses and valid flags with 0 past row_end (for a sum)."""
    loss = tl.where((t >= 0) & (t < V), lse - x_t, float("nan"))
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - sum_x / V)
    ignored = t == ignore_index
    mask = r < row_end
    loss = tl.where(ignored, 0.0, loss)
    valid = tl.where(ignored, 0.0, 1.0)
    if PER_ROW:
        tl.store(LOSS + r, loss.to(LOSS.dtype.element_ty), mask=mask)
        if HAS_VALID:
            tl.store(VALID + r, valid, mask=mask)
    tl.store(LSE + r, lse, mask=mask)
    return ignored, tl.where(mask, loss, 0.0), tl.where(mask, valid, 0.0)


@triton.jit
def _tile_losses(x, t, x_t, r, row_end, cols, V, ignore_index, smoothing, LOSS, LSE, VALID, DLOGITS,
                 SMOOTH: tl.constexpr, HAS_VALID: tl.constexpr, WRITE_GRAD: tl.constexpr,
                 PER_ROW: tl.constexpr):  # fmt: skip
    """Losses, lse, valid flags (and with WRITE_GRAD the unit-cotangent gradient) of a tile of rows r, x its logits
    in fp32 (-inf past V); rows from row_end on are skipped. Returns the losses and valid flags (_row_losses)."""
    x = x.to(tl.float32)
    m = tl.where(r < row_end, tl.max(x, axis=1), 0.0)  # rows past the end (all -inf): e = 0, never stored
    e = exp_minus(x, m[:, None])
    s = tl.sum(e, axis=1)
    lse = m + tl.log(s)
    sum_x = tl.zeros_like(lse)
    if SMOOTH:
        sum_x = tl.sum(tl.where((cols < V)[None, :], x, 0.0), axis=1)
    ignored, loss, valid = _row_losses(LOSS, LSE, VALID, r, row_end, lse, x_t.to(tl.float32), sum_x, t, V,
                                       ignore_index, smoothing, SMOOTH, HAS_VALID, PER_ROW)  # fmt: skip
    if WRITE_GRAD:  # softmax - (1 - eps) * onehot - eps / V, times 0 for ignored rows
        d = e * (1.0 / s)[:, None] - tl.where(cols[None, :] == t[:, None], 1.0 - smoothing, 0.0)
        if SMOOTH:
            d -= smoothing / V
        d = tl.where(ignored[:, None], 0.0, d)
        tl.store(DLOGITS + r[:, None] * V + cols[None, :], d.to(DLOGITS.dtype.element_ty),
                 mask=(r < row_end)[:, None] & (cols < V)[None, :])  # fmt: skip
    return loss, valid


@triton.jit
def cross_entropy_fwd_kernel(
    LOGITS, TARGET, rows, V, stride_row, ignore_index, smoothing,
    LOSS, LSE, VALID, DLOGITS,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, ONE_BLOCK: tl.constexpr, SMOOTH: tl.constexpr,
    HAS_VALID: tl.constexpr, WRITE_GRAD: tl.constexpr, REDUCE: tl.constexpr, UNIT: tl.constexpr,
    BLOCK_ONLINE: tl.constexpr = False,
):  # fmt: skip
    """Grid (G, batch), persistent: program g handles tiles g, g + G, ... of BLOCK_M rows of its problem. LOSS gets a
    row's loss (0 when ignored), LSE its log-sum-exp, VALID (for a reduction) 1.0 or 0.0 for an ignored row. REDUCE
    (1 sum, 2 mean; only where one tile holds all rows of a problem): LOSS[b] gets the problem's sum or mean of the
    losses instead and VALID[b] its count of rows not ignored, as loss_reduce_kernel would from the per-row values. With
    WRITE_GRAD, DLOGITS (rows of V, may be LOGITS itself) gets the row's gradient for a unit cotangent (0 when
    ignored). ONE_BLOCK: a tile [BLOCK_M, BLOCK_V] in registers, the next tile's loads in flight while this one
    reduces (a row per program ran at a third of copy speed: one 8 KiB load, then three dependent block reductions).
    Else (G = rows: a program per row) the row is streamed with an online max / sum, kept per lane of a chunk (two
    exps a logit, three running values a lane) or, BLOCK_ONLINE, one for the row (one exp a logit and a block
    reduction a chunk: fewer registers, for wide chunks of many warps). x[target] is gathered before any
    store of its row, so an in-place gradient cannot race with it."""
    V, stride_row = V * UNIT, stride_row * UNIT
    smoothing = tl.cast(smoothing, tl.float32)  # torch.compile passes floats as fp64
    g = tl.program_id(0)
    G = tl.num_programs(0)
    row0 = tl.program_id(1).to(tl.int64) * rows
    row_end = row0 + rows
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_V)
        r = row0 + g * BLOCK_M + tl.arange(0, BLOCK_M)
        if REDUCE != 0:  # one tile holds the problem's rows: their losses summed here
            x, t, x_t = _load_tile(LOGITS, TARGET, r, row_end, V, stride_row, cols)
            loss, valid = _tile_losses(x, t, x_t, r, row_end, cols, V, ignore_index, smoothing, LOSS, LSE, VALID,
                                       DLOGITS, SMOOTH, HAS_VALID, WRITE_GRAD, False)  # fmt: skip
            total, count = tl.sum(loss, axis=0), tl.sum(valid, axis=0)
            b = tl.program_id(1)
            tl.store(LOSS + b, (total / count if REDUCE == 2 else total).to(LOSS.dtype.element_ty))
            tl.store(VALID + b, count)
        else:  # the next tile's loads are in flight while this one reduces (software pipelining by hand)
            nxt = _load_tile(LOGITS, TARGET, r, row_end, V, stride_row, cols)
            for _ in range(g, tl.cdiv(rows, BLOCK_M), G):
                x, t, x_t = nxt
                nxt = _load_tile(LOGITS, TARGET, r + G * BLOCK_M, row_end, V, stride_row, cols)
                _tile_losses(x, t, x_t, r, row_end, cols, V, ignore_index, smoothing, LOSS, LSE, VALID, DLOGITS,
                             SMOOTH, HAS_VALID, WRITE_GRAD, True)  # fmt: skip
                r += G * BLOCK_M
    else:
        for row in range(row0 + g, row_end, G):
            x_ptr = LOGITS + row * stride_row
            t = tl.load(TARGET + row).to(tl.int64)
            if BLOCK_ONLINE:  # a running max / sum of the row: one exp a logit, a block reduction a chunk
                m = -float("inf")
                s = 0.0
                sum_x = 0.0
                x_t = tl.load(x_ptr + t, mask=(t >= 0) & (t < V), other=0.0).to(tl.float32)  # before any store
                for start in range(0, V, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    x = tl.load(x_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
                    m_new = tl.maximum(m, tl.max(x, axis=0))
                    m_safe = tl.where(m_new > -float("inf"), m_new, 0.0)  # no -inf - -inf before a finite logit
                    s = s * exp_minus(m, m_safe) + tl.sum(exp_minus(x, m_safe), axis=0)
                    m = m_new
                    if SMOOTH:
                        sum_x += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
            else:  # per-lane running values, reduced once at the end
                m_lane = tl.full([BLOCK_V], -float("inf"), dtype=tl.float32)
                s_lane = tl.zeros([BLOCK_V], dtype=tl.float32)
                x_lane = tl.zeros([BLOCK_V], dtype=tl.float32)
                t_lane = tl.zeros([BLOCK_V], dtype=tl.float32)
                for start in range(0, V, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    x = tl.load(x_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
                    m_lane, s_lane = online_max_sum_step(m_lane, s_lane, x)
                    t_lane += tl.where(cols == t, x, 0.0)
                    if SMOOTH:
                        x_lane += tl.where(cols < V, x, 0.0)
                m, s = online_max_sum_total(m_lane, s_lane)
                x_t, sum_x = tl.sum(t_lane, axis=0), tl.sum(x_lane, axis=0)
            lse = m + tl.log(s)
            ignored, _, _ = _row_losses(LOSS, LSE, VALID, row, row_end, lse, x_t, sum_x, t, V, ignore_index,
                                        smoothing, SMOOTH, HAS_VALID, True)  # fmt: skip
            if WRITE_GRAD:
                g_row = tl.where(ignored, 0.0, 1.0)
                for start in range(0, V, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    x = tl.load(x_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
                    d = g_row * _dlogits(x, lse, cols, t, smoothing, V, SMOOTH)
                    tl.store(DLOGITS + row * V + cols, d.to(DLOGITS.dtype.element_ty), mask=cols < V)


@triton.jit
def cross_entropy_segment_kernel(
    LOGITS, rows, V, stride_row,
    PARTIAL,
    BLOCK_V: tl.constexpr, SMOOTH: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Split forward of wide rows, step 1. Grid (S * rows, batch), S = cdiv(V, BLOCK_V) segments a row: one segment
    in registers, PARTIAL[row, s] = (max, sum of exp(x - max) (0 when the max is -inf), sum of x)."""
    V, stride_row = V * UNIT, stride_row * UNIT
    S = tl.cdiv(V, BLOCK_V)
    s = tl.program_id(0) % S
    row = tl.program_id(1).to(tl.int64) * rows + tl.program_id(0) // S
    cols = s * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(LOGITS + row * stride_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    part = PARTIAL + (row * S + s) * 3
    tl.store(part, m)
    tl.store(part + 1, tl.where(m > -float("inf"), tl.sum(exp_minus(x, m), axis=0), 0.0))
    if SMOOTH:
        tl.store(part + 2, tl.sum(tl.where(cols < V, x, 0.0), axis=0))


@triton.jit
def cross_entropy_combine_kernel(
    LOGITS, TARGET, PARTIAL, rows, V, stride_row, ignore_index, smoothing,
    LOSS, LSE, VALID,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, SEGMENT: tl.constexpr, SMOOTH: tl.constexpr,
    HAS_VALID: tl.constexpr,
):  # fmt: skip
    """Split forward of wide rows, step 2. Grid (cdiv(rows, BLOCK_M), batch): lse of BLOCK_M rows from their segments'
    PARTIAL (max m_s, sum s_s: lse = m + log(sum of s_s * exp(m_s - m))), x[target] gathered, then as the one-pass
    kernel: loss, lse and valid flag of each row."""
    smoothing = tl.cast(smoothing, tl.float32)  # torch.compile passes floats as fp64
    S = tl.cdiv(V, SEGMENT)
    row0 = tl.program_id(1).to(tl.int64) * rows
    r = row0 + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_end = row0 + rows
    # the running max and sums stay (BLOCK_M, BLOCK_S) tiles, reduced once after each loop (fewer reductions; a
    # reduction inside the loop also trips Triton 3.6's thread-locality pass)
    m = tl.full([BLOCK_M, BLOCK_S], -float("inf"), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        seg = s0 + tl.arange(0, BLOCK_S)
        mask = (r < row_end)[:, None] & (seg < S)[None, :]
        m = tl.maximum(m, tl.load(PARTIAL + (r[:, None] * S + seg[None, :]) * 3, mask=mask, other=-float("inf")))
    m = tl.max(m, axis=1)
    shift = tl.where(m > -float("inf"), m, 0.0)  # (rows past the end, or of -inf logits only: no inf - inf)
    total = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
    sum_x = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        seg = s0 + tl.arange(0, BLOCK_S)
        mask = (r < row_end)[:, None] & (seg < S)[None, :]
        part = PARTIAL + (r[:, None] * S + seg[None, :]) * 3
        m_s = tl.load(part, mask=mask, other=-float("inf"))
        s_s = tl.load(part + 1, mask=mask, other=0.0)
        total += tl.where(m_s > -float("inf"), s_s * exp_minus(m_s, shift[:, None]), 0.0)
        if SMOOTH:
            sum_x += tl.load(part + 2, mask=mask, other=0.0)
    total, sum_x = tl.sum(total, axis=1), tl.sum(sum_x, axis=1)
    t = tl.load(TARGET + r, mask=r < row_end, other=0).to(tl.int64)
    x_t = tl.load(LOGITS + r * stride_row + t, mask=(r < row_end) & (t >= 0) & (t < V), other=0.0).to(tl.float32)
    lse = shift + tl.log(tl.where(r < row_end, total, 1.0))
    _row_losses(LOSS, LSE, VALID, r, row_end, lse, x_t, sum_x, t, V, ignore_index, smoothing, SMOOTH, HAS_VALID,
                True)  # fmt: skip


@triton.jit
def loss_reduce_kernel(
    LOSS, VALID, rows, stride_b, OUT, COUNT, BLOCK: tl.constexpr, MEAN: tl.constexpr, UNIT: tl.constexpr
):
    """Grid (batch,): OUT[b] = sum (or mean over valid rows) of LOSS[b, :]; COUNT[b] = sum of VALID[b, :]."""
    rows, stride_b = rows * UNIT, stride_b * UNIT
    b = tl.program_id(0).to(tl.int64)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, rows, BLOCK):
        r = start + tl.arange(0, BLOCK)
        mask = r < rows
        total += tl.load(LOSS + b * stride_b + r, mask=mask, other=0.0)
        count += tl.load(VALID + b * stride_b + r, mask=mask, other=0.0)
    total_sum, count_sum = tl.sum(total, axis=0), tl.sum(count, axis=0)
    tl.store(OUT + b, (total_sum / count_sum if MEAN else total_sum).to(OUT.dtype.element_ty))
    tl.store(COUNT + b, count_sum)


@triton.jit
def cross_entropy_bwd_kernel(
    LOGITS, TARGET, LSE, DLOSS, COUNT, rows, V, stride_row, ignore_index, smoothing,
    DLOGITS,
    BLOCK_V: tl.constexpr, REDUCTION: tl.constexpr, SMOOTH: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Grid (rows, cdiv(V, BLOCK_V), batch). REDUCTION: 0 none, 1 sum, 2 mean. DLOGITS (rows of V) may be LOGITS
    itself (each element is read by the program that then writes it)."""
    V, stride_row = V * UNIT, stride_row * UNIT
    smoothing = tl.cast(smoothing, tl.float32)  # torch.compile passes floats as fp64
    b = tl.program_id(2).to(tl.int64)
    row = b * rows + tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    t = tl.load(TARGET + row).to(tl.int64)
    if REDUCTION == 0:
        g = tl.load(DLOSS + row).to(tl.float32)
    else:
        g = tl.load(DLOSS + b).to(tl.float32)
        if REDUCTION == 2:
            g = g / tl.load(COUNT + b)
    g = tl.where(t == ignore_index, 0.0, g)
    x = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    d = _dlogits(x, tl.load(LSE + row), cols, t, smoothing, V, SMOOTH)
    tl.store(DLOGITS + row * V + cols, (g * d).to(DLOGITS.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation and plans


def check(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0) -> None:
    checks.check_float(NAME, "logits", logits)
    if len(logits.shape) != 2:
        raise ValueError(f"{NAME}: logits must be 2-D (N, V), got shape {tuple(logits.shape)}")
    if logits.shape[1] < 1:
        raise ValueError(f"{NAME}: logits must have at least one class, got shape {tuple(logits.shape)}")
    checks.check_array(NAME, "target", target)
    if dtype_name(target.dtype) not in TARGET_DTYPES:
        raise TypeError(f"{NAME}: target must have dtype int32 or int64, got {dtype_name(target.dtype)}")
    checks.check_shape(NAME, "target", target, logits.shape[:1], "one class index per row of logits")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{NAME}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= checks.check_real(NAME, "label_smoothing", label_smoothing, "a number in [0, 1]") <= 1.0:
        raise ValueError(f"{NAME}: label_smoothing must be in [0, 1], got {label_smoothing}")
    checks.check_int(NAME, "ignore_index", ignore_index)


Ref = str | Rows | None


def _forward_grid(rows: int, n_classes: int, target: Target) -> tuple[int, bool, int, int, int]:
    """(block, one_block, warps, tile_rows, programs a problem) of the forward kernel."""
    block, one_block, _ = row_block(n_classes, target)
    if not one_block:  # streamed rows: a program per row
        return STREAM_BLOCK, False, min(STREAM_WARPS, 1024 // target.warp_size), 1, rows
    # persistent programs over tiles, as many as fill each SM's 2048 threads (registers permitting)
    tile_rows = max(1, TILE // block)
    warps = max(TILE_MIN_WARPS, row_block(tile_rows * block, target, per_thread=TILE_PER_THREAD)[2])
    programs = programs_per_problem(cdiv(rows, tile_rows), target, waves=max(1, 2048 // (warps * target.warp_size)))
    if FEW_WARPS_CLASSES[0] <= block <= FEW_WARPS_CLASSES[1] and target.warp_size == 32:
        warps = 2
    return block, one_block, warps, tile_rows, programs


def reduces_in_one_program(rows: int, n_classes: int, target: Target) -> bool:
    """Whether one tile of the forward holds all `rows` (>= 1) of a problem, so that its program can reduce them."""
    _, one_block, _, tile_rows, _ = _forward_grid(rows, n_classes, target)
    return one_block and 1 <= rows <= tile_rows


def forward_launch(
    batch: int, rows: int, n_classes: int, *, logits: Ref, labels: Ref, loss: Ref, lse: Ref, valid: Ref = None,
    dlogits: Ref = None, ignore_index: int, label_smoothing: float, target: Target, stride_row: int | None = None,
    reduction: str = "none",
) -> Launch:  # fmt: skip
    """The forward kernel over batch*rows rows of logits; `valid` (fp32 flags) for a reduction; `dlogits` for the
    unit-cotangent gradient (may be `logits`: in place). reduction 'sum' / 'mean' (where reduces_in_one_program):
    `loss` (batch,) gets the reduced loss and `valid` (batch,) the count."""
    block, one_block, warps, tile_rows, programs = _forward_grid(rows, n_classes, target)
    if reduction != "none" and not reduces_in_one_program(rows, n_classes, target):
        raise ValueError(f"forward_launch: reduction {reduction!r} needs one tile a problem ({rows} rows here)")
    launch = Launch(
        cross_entropy_fwd_kernel,
        grid=(programs, batch),
        reads=(logits, labels, rows, n_classes, n_classes if stride_row is None else stride_row, ignore_index,
               float(label_smoothing)),
        writes=(loss, lse, valid, dlogits),
        constexprs=dict(BLOCK_M=tile_rows, BLOCK_V=block, ONE_BLOCK=one_block, SMOOTH=label_smoothing > 0,
                        HAS_VALID=valid is not None, WRITE_GRAD=dlogits is not None,
                        REDUCE=REDUCTIONS.index(reduction), BLOCK_ONLINE=STREAM_ONLINE and not one_block),
        num_warps=warps,
    )  # fmt: skip
    return in_units(launch, "V", "stride_row")


def reduce_launch(batch: int, rows: int, reduction: str, *, row_loss: Ref, valid: Ref, loss: Ref, count: Ref) -> Launch:
    """loss[b] = sum (mean: over the valid rows) of row_loss[b, :rows]; count[b] = valid rows. Row stride max(rows, 1):
    give a row-less problem one column so that its buffers still have a pointer."""
    block = min(REDUCE_BLOCK, next_power_of_2(max(rows, 1)))
    launch = Launch(loss_reduce_kernel, (batch,), (row_loss, valid, rows, max(rows, 1)), (loss, count),
                    dict(BLOCK=block, MEAN=reduction == "mean"), num_warps=max(1, min(16, block // 512)))  # fmt: skip
    return in_units(launch, "rows", "stride_b")


def backward_launch(
    batch: int, rows: int, n_classes: int, *, logits: Ref, labels: Ref, lse: Ref, dloss: Ref, count: Ref,
    dlogits: Ref, reduction: str, ignore_index: int, label_smoothing: float, target: Target,
    stride_row: int | None = None,
) -> Launch:  # fmt: skip
    """dlogits (rows of n_classes; may be `logits`: in place) from logits, lse and the cotangent. `count` (the valid
    rows) is read for 'mean' only."""
    block = min(4096, next_power_of_2(n_classes))
    warps = max(1, min(16, block // (target.warp_size * 8)))
    launch = Launch(
        cross_entropy_bwd_kernel,
        grid=(rows, cdiv(n_classes, block), batch),
        reads=(logits, labels, lse, dloss, count, rows, n_classes, n_classes if stride_row is None else stride_row,
               ignore_index, float(label_smoothing)),
        writes=(dlogits,),
        constexprs=dict(BLOCK_V=block, REDUCTION=REDUCTIONS.index(reduction), SMOOTH=label_smoothing > 0),
        num_warps=warps,
    )  # fmt: skip
    return in_units(launch, "V", "stride_row")


def forward(
    batch: int, rows: int, n_classes: int, *, dtype: str, target_dtype: str, reduction: str, ignore_index: int,
    label_smoothing: float, target: Target, stride_row: int | None = None,
) -> Plan:  # fmt: skip
    """Inputs logits (batch*rows rows of n_classes, row stride stride_row), target (batch*rows,).
    Outputs loss ((batch, rows) for 'none', else (batch,)) in logits' dtype, lse (batch, rows) and count (batch,)
    fp32 (count: non-ignored rows; zeros for 'none')."""
    reduced = reduction != "none"
    empty = batch * rows == 0
    in_one = reduced and batch > 0 and reduces_in_one_program(rows, n_classes, target)  # the forward reduces
    reducing = reduced and batch > 0 and not in_one  # a reduction launch runs (rows == 0 too: a mean of nothing is NaN)
    buffers = {
        "loss": BufferSpec((batch,) if reduced else (batch, rows), dtype, zeroed=empty and not reducing),
        "lse": BufferSpec((batch, rows), "float32", zeroed=empty),
        "count": BufferSpec((batch,), "float32", zeroed=not (reducing or in_one)),
    }
    if reducing:  # per-row losses and valid flags
        buffers |= {n: BufferSpec((batch, max(rows, 1)), "float32", zeroed=empty) for n in ("row_loss", "valid")}
    launches = []
    outs = dict(loss="row_loss" if reducing else "loss", lse="lse", valid="valid" if reducing else None)
    stride_row = n_classes if stride_row is None else stride_row
    if empty:
        pass
    elif in_one:
        launches.append(
            forward_launch(batch, rows, n_classes, logits="logits", labels="target", loss="loss", lse="lse",
                           valid="count", ignore_index=ignore_index, label_smoothing=label_smoothing, target=target,
                           stride_row=stride_row, reduction=reduction)
        )  # fmt: skip
    elif n_classes <= MAX_ROW_BLOCK:
        launches.append(
            forward_launch(batch, rows, n_classes, logits="logits", labels="target", **outs, ignore_index=ignore_index,
                           label_smoothing=label_smoothing, target=target, stride_row=stride_row)
        )  # fmt: skip
    else:  # wide rows split across programs: segment (max, sum of exp) in one launch, combined per row in a second
        segments = cdiv(n_classes, SEGMENT)
        buffers["partial"] = BufferSpec((batch, rows, segments, 3), "float32")
        smooth = label_smoothing > 0
        launches += [
            in_units(Launch(cross_entropy_segment_kernel, (segments * rows, batch),
                            ("logits", rows, n_classes, stride_row), ("partial",), dict(BLOCK_V=SEGMENT, SMOOTH=smooth),
                            num_warps=row_block(SEGMENT, target)[2]), "V", "stride_row"),
            Launch(cross_entropy_combine_kernel, (cdiv(rows, COMBINE_ROWS), batch),
                   ("logits", "target", "partial", rows, n_classes, stride_row, ignore_index, float(label_smoothing)),
                   (outs["loss"], "lse", outs["valid"]),
                   dict(BLOCK_M=COMBINE_ROWS, BLOCK_S=COMBINE_SEGMENTS, SEGMENT=SEGMENT, SMOOTH=smooth,
                        HAS_VALID=reducing), num_warps=4),
        ]  # fmt: skip
    if reducing:
        launches.append(reduce_launch(batch, rows, reduction, row_loss="row_loss", valid="valid", loss="loss",
                                      count="count"))  # fmt: skip
    return Plan({"logits": dtype, "target": target_dtype}, buffers, tuple(launches), ("loss", "lse", "count"))


def backward(
    batch: int, rows: int, n_classes: int, *, dtype: str, target_dtype: str, reduction: str, ignore_index: int,
    label_smoothing: float, target: Target, stride_row: int | None = None,
) -> Plan:  # fmt: skip
    """Inputs logits, target, lse, dloss (shaped as the forward's loss), count; output dlogits (batch, rows, V)."""
    empty = batch * rows == 0
    buffers = {"dlogits": BufferSpec((batch, rows, n_classes), dtype, zeroed=empty)}
    launches = ()
    if not empty:
        launches = (
            backward_launch(batch, rows, n_classes, logits="logits", labels="target", lse="lse", dloss="dloss",
                            count="count", dlogits="dlogits", reduction=reduction, ignore_index=ignore_index,
                            label_smoothing=label_smoothing, target=target, stride_row=stride_row),
        )  # fmt: skip
    inputs = {"logits": dtype, "target": target_dtype, "lse": "float32", "dloss": dtype, "count": "float32"}
    return Plan(inputs, buffers, launches, ("dlogits",))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def _row_terms(logits, target, ignore_index):
    x = logits.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    lse = (m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)))[:, 0]
    valid = target != ignore_index
    picked = x[np.arange(len(x)), np.where(valid, target, 0)]
    return x, lse, valid, picked


def reference(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    x, lse, valid, picked = _row_terms(logits, target, ignore_index)
    eps = label_smoothing
    loss = np.where(valid, (1 - eps) * (lse - picked) + eps * (lse - x.mean(axis=-1)), 0.0)
    if reduction == "none":
        return (loss,)
    if reduction == "sum":
        return (np.asarray(loss.sum()),)
    with np.errstate(invalid="ignore"):
        return (np.asarray(loss.sum() / valid.sum()),)


def reference_vjp(kwargs, cotangents):
    logits, target = kwargs["logits"], kwargs["target"]
    ignore_index, reduction = kwargs.get("ignore_index", -100), kwargs.get("reduction", "mean")
    eps = kwargs.get("label_smoothing", 0.0)
    x, lse, valid, _ = _row_terms(logits, target, ignore_index)
    g = cotangents[0].astype(np.float64)
    if reduction == "mean":
        g = g / valid.sum()
    g = np.where(valid, np.broadcast_to(g, valid.shape), 0.0)[:, None]
    onehot = np.zeros_like(x)
    onehot[np.arange(len(x)), np.where(valid, target, 0)] = 1.0
    return {"logits": g * (np.exp(x - lse[:, None]) - (1 - eps) * onehot - eps / x.shape[-1])}


def cost(kwargs) -> tuple[Cost, Cost]:
    logits, target = kwargs["logits"], kwargs["target"]
    rows, classes = logits.shape
    item, titem = ITEMSIZE[str(logits.dtype)], ITEMSIZE[str(target.dtype)]
    fwd = Cost(rows * classes * item + rows * (titem + 8), 4 * rows * classes)
    bwd = Cost(2 * rows * classes * item + rows * (titem + 4), 4 * rows * classes)
    return fwd, bwd


def sample(rng: np.random.Generator, shape, dtype: str, reduction="mean", label_smoothing=0.0, ignore=False) -> dict:
    """Logits (prod(shape[:-1]), max(shape[-1], 1)); with ignore, about a fifth of the targets are ignore_index."""
    rows, classes = int(np.prod(shape[:-1])), max(shape[-1], 1)
    target = rng.integers(0, classes, rows)
    if ignore:
        target = np.where(rng.random(rows) < 0.2, -100, target)
    return {"logits": round_to(rng.standard_normal((rows, classes)) * 3.0, dtype), "target": target.astype(np.int64),
            "ignore_index": -100, "reduction": reduction, "label_smoothing": label_smoothing}  # fmt: skip


def bad_inputs(kwargs) -> list[BadInput]:
    logits, target = kwargs["logits"], kwargs["target"]
    return [
        BadInput({"logits": logits[None]}, ValueError, "cross_entropy: logits must be 2-D"),
        BadInput({"logits": logits.astype(np.int32)}, TypeError, "cross_entropy: logits must have dtype"),
        BadInput({"target": target.astype(np.float32)}, TypeError, "cross_entropy: target must have dtype int32"),
        BadInput({"target": target[:-1]}, ValueError, "cross_entropy: target must have shape"),
        BadInput({"reduction": "avg"}, ValueError, "cross_entropy: reduction must be one of"),
        BadInput({"label_smoothing": 1.5}, ValueError, "cross_entropy: label_smoothing must be in"),
        BadInput({"label_smoothing": "0.1"}, TypeError, r"cross_entropy: label_smoothing must be a number in \[0, 1\]"),
        BadInput({"ignore_index": 1.5}, TypeError, "cross_entropy: ignore_index must be an int"),
        BadInput({"ignore_index": True}, TypeError, "cross_entropy: ignore_index must be an int"),
        *not_arrays(NAME, "logits", "target"),
    ]


def plans(target: Target):
    for dtype in FLOAT_DTYPES:
        for target_dtype in TARGET_DTYPES:
            for n in WIDTH_BUCKETS:
                for reduction in REDUCTIONS:
                    for smoothing in (0.0, 0.1):
                        kw = dict(dtype=dtype, target_dtype=target_dtype, reduction=reduction, ignore_index=-100,
                                  label_smoothing=smoothing, target=target)  # fmt: skip
                        yield forward(1, 4, n, **kw)
                        yield forward(1, 16, n, **kw)  # 16 rows over 2+ tiles: the reduction launch, UNIT = 16
                        yield backward(1, 4, n, **kw)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"reduction": REDUCTIONS, "label_smoothing": (0.0, 0.1), "ignore": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("logits",),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
