"""Decode attention: decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
k_scale=None, v_scale=None).

New query tokens, q (B, Hq, D) (one a sequence) or (B, T, Hq, D) (T a sequence: speculative decoding), over the
first L_b = cache_seqlens[b] positions of each sequence's KV cache, their own K / V already written (the last T):
    out[b, t, h] = sum_{p < L_bt} softmax_p(scale * q[b, t, h] . K_b[p, hk]) V_b[p, hk]
    L_bt = L_b - (T - 1 - t) (causal among the new tokens), hk = h // (Hq / Hk), scale = softmax_scale or 1 / sqrt(D);
    a token that sees no position (L_bt <= 0) gives 0
Caches: contiguous (B, Smax, Hk, D), K_b[p] = k_cache[b, p]; or paged (num_blocks, page_size, Hk, D) with block_table
(B, max_pages) int32, K_b[p] = k_cache[block_table[b, p // page_size], p % page_size]. The capacity C (Smax, or
max_pages * page_size) is a shape; the lengths are values, read on the device only (clamped to [0, C]; the pages
they cover must be valid indices of the pool). Caches in q's dtype, or FP8 (float8_e4m3fn, NVIDIA sm_89+ and the
interpreter) with per-tensor scales: K = k_cache * k_scale, V = v_cache * v_scale (floats, default 1; k_scale folds
into the softmax scale, v_scale into each split's output; the codes are widened to q's dtype before the products).

Kernels (flash-decoding, split-KV; fp32 accumulation, log-sum-exps in base 2):
  * split: grid (B, Hk * cdiv(T * Hq / Hk, BLOCK_G), S). A program holds up to BLOCK_G (token, query head) pairs of
    one key/value head's group as the rows of a tile (padded to >= 16 rows, so tl.dot runs on tensor cores; each row
    masked to its own L_bt) and takes split s of its sequence: positions [s * c, min((s + 1) * c, L_b)),
    c = cdiv(cdiv(L_b, S), BLOCK_N) * BLOCK_N, so the S splits share the actual length, whatever the capacity.
    Online softmax over BLOCK_N positions at a time; a paged cache gathers each position's row through its page
    index (any page size). Writes the split's normalized output (fp32) and log-sum-exp to (B, T, Hq, S, D) and
    (B, T, Hq, S) plan buffers; an empty split writes 0, lse = -inf. With S = 1 it writes the output itself and the
    combine is not launched.
  * combine: grid (B * T, Hq). out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m), m = max_s lse_s; 0 where every
    split is empty (L_bt <= 0). COMBINE_SPLITS splits a load. Output in q's dtype.
S (`split_count`) depends on shapes only (no host sync): the count whose programs fill the target's multiprocessors in
whole waves (B = 1 with a long context splits it up to MAX_SPLITS ways, a large batch not at all), never splits
shorter than MIN_SPLIT_BLOCKS blocks. Head dims up to 256, padded to a power of two >= 16 with masks. Offsets are
64-bit.
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from . import checks
from .flash_attention import dot
from .fp8_quantize import FP8, e4m3_target, require_e4m3
from .host import ieee_dots
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, dtype_name, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "decode_attention"
MAX_HEAD_DIM = 256
MAX_SPLITS = 128
MIN_SPLIT_BLOCKS = 2  # BLOCK_N blocks of positions a split gets at least (of the capacity)
COMBINE_SPLITS = 16  # splits the combine loads at once
# Split programs an SM holds at once (the unit of splits_for's waves), as Triton 3.6 allots registers for sm_90 to the
# default tiles (`tile-kernels aot --report`): 4 (105 registers, contiguous 16-bit caches; 128 FP8 at pages >= 64);
# paged 16-bit caches at head dim 128 take 148-152 registers: 3. Other head dims, fp32 and AMD: 4, unmeasured.
PROGRAMS_PER_SM = 4
PAGED_PROGRAMS_PER_SM = 3
SPLIT_OVERHEAD_BLOCKS = 2  # a split program's fixed cost (q, its partial output), in blocks of positions
# the int arguments the split kernel builds addresses from, passed in units of 16 (or 8) elements where they all
# divide (plan.in_units): rows then start 16-byte aligned and the K / V rows load 16 bytes at a time
UNIT_ARGS = ("head_dim", "stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
             "stride_vs", "stride_vh")  # fmt: skip
UNITS = (16, 8)


@triton.jit
def split_range(SEQLENS, b, seqlen_k, split, splits, BLOCK_N: tl.constexpr):
    """(seqlen, start, end): sequence b's length clamped to [0, seqlen_k], and split `split` of `splits` of it,
    positions [start, end), the splits cut in BLOCK_N multiples of the actual length (not of the capacity)."""
    seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), seqlen_k)
    chunk = tl.cdiv(tl.cdiv(seqlen, splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return seqlen, start, tl.minimum(start + chunk, seqlen)


@triton.jit
def cache_rows(BLOCK_TABLE, b, stride_bt, n0, end, cols, page_size, stride_page, stride_pos, PAGED: tl.constexpr,
               PAGES_A_BLOCK: tl.constexpr):  # fmt: skip
    """Element offsets of the block of positions `cols` = n0 + arange(BLOCK_N) of sequence b (positions < end valid)
    in a cache: through the block table when PAGED (page stride_page apart), else stride_pos apart from the
    sequence's base. PAGES_A_BLOCK (pages_a_block; n0 a multiple of BLOCK_N): 1, the block lies in one page, looked up
    once; k > 1, it spans k whole pages, k lookups, each position selecting its page from them (a reshape of (pages,
    positions) rows would cost Triton 3.6 its cp.async pipelining); 0, a lookup a position (a gather of a page a
    position costs registers and a dependent load in every position's address)."""
    if PAGED and PAGES_A_BLOCK == 1:
        page = tl.load(BLOCK_TABLE + b * stride_bt + n0 // page_size).to(tl.int64)
        return page * stride_page + (cols - n0 + n0 % page_size).to(tl.int64) * stride_pos
    if PAGED and PAGES_A_BLOCK > 1:
        PAGE: tl.constexpr = cols.shape[0] // PAGES_A_BLOCK
        first = n0 + tl.arange(0, PAGES_A_BLOCK) * PAGE  # of each page
        pages = tl.load(BLOCK_TABLE + b * stride_bt + first // PAGE, mask=first < end, other=0).to(tl.int64)
        which = (cols - n0) // PAGE
        page = tl.sum(tl.where(which[:, None] == tl.arange(0, PAGES_A_BLOCK)[None, :], pages[None, :], 0), axis=1)
        return page * stride_page + ((cols - n0) % PAGE).to(tl.int64) * stride_pos
    if PAGED:
        page = tl.load(BLOCK_TABLE + b * stride_bt + cols // page_size, mask=cols < end, other=0).to(tl.int64)
        return page * stride_page + (cols % page_size).to(tl.int64) * stride_pos
    return cols.to(tl.int64) * stride_pos


def pages_a_block(page_size: int | None, block_n: int) -> int:
    """cache_rows' PAGES_A_BLOCK: 1 where a block of block_n positions lies in one page (page_size a multiple of
    block_n), block_n / page_size where it spans whole pages of 8 or more positions, else 0 (a lookup a position;
    also contiguous caches)."""
    if page_size is None:
        return 0
    if page_size % block_n == 0:
        return 1
    return block_n // page_size if block_n % page_size == 0 and page_size >= 8 else 0


@triton.jit
def online_softmax(s, m_i, l_i):
    """One block of base-2 scores s (rows, N) into the running max m_i and sum l_i: (p, alpha, m, l), the
    accumulator to be scaled by alpha and p's products added. Rows that saw nothing yet get p = alpha = 0, not NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def finish(acc, m_i, l_i):
    """(out, lse) of a split: acc / l and the base-2 log-sum-exp; an empty split gives 0 and -inf (weight 0 in the
    combine)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    return out, tl.where(empty, -float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))


# FP8 e4m3 codes x = s eeee mmm widened with integer ops and one multiply a pair of values, not cvt (F2F runs at a
# quarter of the ALU rate on sm_90 and bounded the FP8 kernel): prmt puts codes 0 and 1 (2 and 3) in the high bytes
# of the two halves, the sign stays at bit 15 and eeeemmm moves to the top of the wider format's exponent and mantissa
# (>> 4 for bf16, >> 1 for fp16, masked). That reads as the value x 2^-120 (bf16) or 2^-8 (fp16), denormals included,
# and a multiply by the power of two (0x7B80 = 2^120, 0x5C00 = 2^8; -0 added) restores it exactly. lop3's 0xea:
# (a & b) | c. The NaN codes (0x7f / 0xff) read as +-480.
_WIDEN_E4M3 = (  # one line: torch.compile copies the kernel's globals into its generated source
    "{{ .reg .b32 a, b, p, z; mov.b32 p, {power}; mov.b32 z, 0x80008000; "
    "prmt.b32 a, $2, 0, 0x1404; prmt.b32 b, $2, 0, 0x3424; shr.b32 $0, a, {shift}; shr.b32 $1, b, {shift}; "
    "and.b32 $0, $0, {mask}; and.b32 $1, $1, {mask}; lop3.b32 $0, a, 0x80008000, $0, 0xea; "
    "lop3.b32 $1, b, 0x80008000, $1, 0xea; fma.rn.{ty} $0, $0, p, z; fma.rn.{ty} $1, $1, p, z; }}"
)
WIDEN_E4M3_BF16: tl.constexpr = tl.constexpr(
    _WIDEN_E4M3.format(shift=4, mask="0x07F007F0", ty="bf16x2", power="0x7B807B80")
)
WIDEN_E4M3_F16: tl.constexpr = tl.constexpr(
    _WIDEN_E4M3.format(shift=1, mask="0x3F803F80", ty="f16x2", power="0x5C005C00")
)


@triton.jit
def widen(codes, dtype: tl.constexpr, E4M3_ASM: tl.constexpr):
    """Cache values as `dtype` (q's): FP8 e4m3 codes through the integer widening above where E4M3_ASM (NVIDIA
    sm_89+), else a cast (a no-op for caches in q's dtype). The asm is pure: marked impure it kept the codes' 16-byte
    shared-memory loads and ldmatrix, with fewer registers, but measured slower (benchmarks/results/h200/notes.md)."""
    if E4M3_ASM:
        bits = codes.to(tl.uint8, bitcast=True)
        if dtype == tl.bfloat16:
            out = tl.inline_asm_elementwise(WIDEN_E4M3_BF16, "=r,=r,r", [bits], tl.bfloat16, is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(WIDEN_E4M3_F16, "=r,=r,r", [bits], tl.float16, is_pure=True, pack=4)
    else:
        out = codes.to(dtype)
    return out


@triton.jit
def decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, tokens, heads_q, heads_k, head_dim, seqlen_k, page_size, stride_bt,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale, v_scale,
    PARTIAL_O, PARTIAL_LSE, OUT,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, UNIT: tl.constexpr, PAGES_A_BLOCK: tl.constexpr, E4M3_ASM: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, Hk * cdiv(T * Hq / Hk, BLOCK_G), S). stride_kb / stride_vb: of the batch (contiguous) or of a page
    (PAGED). SPLIT (S > 1): PARTIAL_O (B, T, Hq, S, D) and PARTIAL_LSE (B, T, Hq, S) fp32, compact; else the output
    OUT (B, T, Hq, D) in q's dtype (no combine). The absent buffers are never stored to, in the compiled code either:
    torch.compile counts a pointer the kernel's IR stores to as written, so one may stand in for another.
    PDL: the combine launch (Launch.pdl) may start now and wait for this one's partials there."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = tl.cast(scale, tl.float32)  # torch.compile passes floats as fp64
    head_dim, stride_qb, stride_qt, stride_qh = head_dim * UNIT, stride_qb * UNIT, stride_qt * UNIT, stride_qh * UNIT
    stride_kb, stride_ks, stride_kh = stride_kb * UNIT, stride_ks * UNIT, stride_kh * UNIT
    stride_vb, stride_vs, stride_vh = stride_vb * UNIT, stride_vs * UNIT, stride_vh * UNIT
    b = tl.program_id(0).to(tl.int64)
    group = heads_q // heads_k
    group_blocks = tl.cdiv(tokens * group, BLOCK_G)
    hk = tl.program_id(1) // group_blocks
    split, splits = tl.program_id(2), tl.num_programs(2)
    r = (tl.program_id(1) % group_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)  # (token, head) pairs, heads fastest
    row_ok = r < tokens * group
    t = (r // group).to(tl.int64)
    h = (hk * group + r % group).to(tl.int64)  # the query heads of the tile's rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    seqlen, start, end = split_range(SEQLENS, b, seqlen_k, split, splits, BLOCK_N)
    visible = seqlen - (tokens - 1 - t)  # a row's L_bt: causal among the new tokens
    k_base = K + hk.to(tl.int64) * stride_kh
    v_base = V + hk.to(tl.int64) * stride_vh
    if not PAGED:
        k_base += b * stride_kb
        v_base += b * stride_vb
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):  # a row may see none of a block's positions: its m stays -inf
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k_rows = cache_rows(BLOCK_TABLE, b, stride_bt, n0, end, cols, page_size, stride_kb, stride_ks, PAGED,
                            PAGES_A_BLOCK)  # fmt: skip
        v_rows = cache_rows(BLOCK_TABLE, b, stride_bt, n0, end, cols, page_size, stride_vb, stride_vs, PAGED,
                            PAGES_A_BLOCK)  # fmt: skip
        kt = tl.load(k_base + k_rows[None, :] + d[:, None], mask=col_ok[None, :] & dmask[:, None], other=0.0)  # (D, N)
        kt = widen(kt, q.dtype, E4M3_ASM)
        s = dot(q, kt, IEEE) * (scale * 1.4426950408889634)
        s = tl.where(col_ok[None, :] & (cols[None, :] < visible[:, None]), s, -float("inf"))
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
        v = tl.load(v_base + v_rows[:, None] + d[None, :], mask=col_ok[:, None] & dmask[None, :], other=0.0)  # (N, D)
        v = widen(v, q.dtype, E4M3_ASM)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    out, lse = finish(acc, m_i, l_i)
    out *= tl.cast(v_scale, tl.float32)  # V = v_cache x v_scale
    mask = row_ok[:, None] & dmask[None, :]
    out_row = (b * tokens + t) * heads_q + h
    if not SPLIT:
        tl.store(OUT + out_row[:, None] * head_dim + d[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    else:
        row = out_row * splits + split
        tl.store(PARTIAL_O + row[:, None] * head_dim + d[None, :], out, mask=mask)
        tl.store(PARTIAL_LSE + row, lse, mask=row_ok)


@triton.jit
def decode_combine_kernel(
    PARTIAL_O, PARTIAL_LSE, heads_q, head_dim, num_splits,
    OUT, LSE,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr, HAS_LSE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B * T, Hq). OUT (B, T, Hq, D) compact: the splits' outputs weighted by 2^lse, BLOCK_S splits a load.
    HAS_LSE: also LSE (B, T, Hq) fp32, the log-sum-exp of the whole row in natural log (-inf: every split empty).
    PDL: launched programmatically dependent (Launch.pdl): waits for the split launch to finish first."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # the split launch has finished and its partials are visible
    head_dim = head_dim * UNIT
    row = tl.program_id(0).to(tl.int64) * heads_q + tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    lse_base, o_base = PARTIAL_LSE + row * num_splits, PARTIAL_O + row * num_splits * head_dim
    m = tl.full([BLOCK_S], -float("inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = tl.maximum(m, tl.load(lse_base + s, mask=s < num_splits, other=-float("inf")))
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == -float("inf"), 0.0, m_all)  # every split empty (a sequence of length 0): weights 0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        w = tl.exp2(tl.load(lse_base + s, mask=s < num_splits, other=-float("inf")) - m_all)
        o = tl.load(o_base + s[:, None] * head_dim + d[None, :], mask=(s < num_splits)[:, None] & dmask[None, :],
                    other=0.0)  # fmt: skip
        acc += tl.sum(w[:, None] * o, axis=0)
        total += w
    total_all = tl.sum(total, axis=0)
    out = acc / tl.where(total_all == 0.0, 1.0, total_all)
    tl.store(OUT + row * head_dim + d, out.to(OUT.dtype.element_ty), mask=dmask)
    if HAS_LSE:
        lse = tl.where(total_all == 0.0, -float("inf"), (m_all + tl.log2(tl.where(total_all == 0.0, 1.0, total_all))))
        tl.store(LSE + row, lse * 0.6931471805599453)


# ---------------------------------------------------------------------------------------------------------------------
# configurations, validation and plans


def config(head_dim: int, group: int, dtype: str, target: Target, fp8: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_G, BLOCK_N, BLOCK_D, num_warps, num_stages) of the split kernel for `group` rows (tokens x query heads
    of a key/value head). More than 64 rows (32 in float32 or on wavefront-64 targets) take several tiles (each reads
    its key/value head again).
    Wavefront-64 (AMD) targets: one pipelining stage (64 KiB of LDS), and within the register file (512 VGPRs a lane
    at most) smaller key blocks for the large tiles. FP8 caches (`fp8`): three stages (half the bytes a block;
    faster than two at every size of `benchmarks/sweep_decode_attention.py --fp8`)."""
    wave64 = target.warp_size == 64
    block_d = max(16, next_power_of_2(head_dim))
    block_g = min(32 if dtype == "float32" or wave64 else 64, max(16, next_power_of_2(group)))
    if dtype == "float32":  # IEEE dots on CUDA cores hold their operands in registers: smaller key blocks
        block_n = 32 if block_d <= 64 else 16
    else:
        block_n = 32 if block_d > 128 or wave64 and block_g * block_d >= 32 * 128 else 64
    warps = 8 if block_g * block_d >= 32 * 128 or dtype == "float32" and block_g * block_d >= 16 * 128 else 4
    return block_g, block_n, block_d, warps, 1 if target.warp_size == 64 else 3 if fp8 else 2


def pdl_combine(splits: int, target: Target) -> bool:
    """Whether the combine launch follows the split launch programmatically (Launch.pdl; sm_90+): it is scheduled
    as the split launch's last programs start, not after they finish."""
    return splits > 1 and target.cuda_arch >= 90


def split_count(batch: int, heads_k: int, group: int, seqlen_k: int, head_dim: int, dtype: str, target: Target,
                paged: bool = False, fp8: bool = False) -> int:  # fmt: skip
    """How many splits the sequences are cut into (splits_for). A function of shapes only; `group`: the rows of a
    key/value head (tokens x query heads)."""
    block_g, block_n, block_d, warps = config(head_dim, group, dtype, target, fp8)[:4]
    paged_16bit = paged and not fp8 and block_d == 128 and warps == 4 and target.warp_size == 32
    resident = PAGED_PROGRAMS_PER_SM if paged_16bit else PROGRAMS_PER_SM
    return splits_for(batch * heads_k * cdiv(group, block_g), seqlen_k, block_n, target, resident)


def splits_for(programs: int, seqlen_k: int, block_n: int, target: Target, resident: int = PROGRAMS_PER_SM) -> int:
    """The split count S of a split-KV kernel with `programs` programs a split and BLOCK_N positions a block, from a
    model of whole waves: resident x SMs programs run at once, so S splits of c blocks each (S' of them non-empty)
    take ceil(programs x S' / (resident x SMs)) waves of c + SPLIT_OVERHEAD_BLOCKS; the S in [1, MAX_SPLITS] that
    minimizes it, fewest on a tie, splits of at least MIN_SPLIT_BLOCKS blocks of the capacity seqlen_k: no second
    wave that runs part-filled."""
    if programs == 0 or seqlen_k == 0:
        return 1
    blocks, slots = cdiv(seqlen_k, block_n), resident * target.num_sms
    best = (math.inf, 1)
    for splits in range(1, max(1, min(MAX_SPLITS, cdiv(blocks, MIN_SPLIT_BLOCKS))) + 1):
        chunk = cdiv(blocks, splits)
        best = min(best, (cdiv(programs * cdiv(blocks, chunk), slots) * (chunk + SPLIT_OVERHEAD_BLOCKS), splits))
    return best[1]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def check(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None, v_scale=None):
    dtype = checks.check_float(NAME, "q", q)
    if len(q.shape) not in (3, 4):
        raise ValueError(f"{NAME}: q must be 3-D (batch, heads, head_dim) or 4-D (batch, tokens, heads, head_dim), "
                         f"got shape {tuple(q.shape)}")  # fmt: skip
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_array(NAME, name, t)
        if len(t.shape) != 4:
            what = "(batch, seqlen, heads, head_dim) or paged (num_blocks, page_size, heads, head_dim)"
            raise ValueError(f"{NAME}: {name} must be 4-D {what}, got shape {tuple(t.shape)}")
    cache_dtype = FP8 if dtype_name(k_cache.dtype) == FP8 else dtype
    checks.check_same_dtype(NAME, "k_cache", k_cache, cache_dtype, f"that of q, or {FP8}")
    checks.check_same_dtype(NAME, "v_cache", v_cache, cache_dtype, "that of k_cache")
    checks.check_same_dtype(NAME, "cache_seqlens", cache_seqlens, "int32", "the tokens in each sequence's cache")
    batch, heads_q, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    checks.check_shape(NAME, "cache_seqlens", cache_seqlens, (batch,), "q's batch")
    blocks, slots, heads_k, _ = k_cache.shape
    if block_table is not None:
        layout = "(num_blocks, page_size, heads, head_dim)"
        checks.check_block_table(NAME, block_table, batch, "q", "k_cache", k_cache, layout)
        checks.check_shape(NAME, "k_cache", k_cache, (blocks, slots, heads_k, head_dim), "q's head_dim")
    else:
        checks.check_shape(NAME, "k_cache", k_cache, (batch, slots, heads_k, head_dim), "q's batch and head_dim")
    checks.check_shape(NAME, "v_cache", v_cache, tuple(k_cache.shape), "that of k_cache")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{NAME}: head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    if heads_k == 0 and heads_q != 0 or heads_k and heads_q % heads_k:
        raise ValueError(f"{NAME}: q's heads must be a multiple of the caches' heads (GQA/MQA), got {heads_q} and "
                         f"{heads_k}")  # fmt: skip
    if softmax_scale is not None:
        checks.check_real(NAME, "softmax_scale", softmax_scale, "None or a finite number")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None:
            checks.check_real(NAME, name, value, "None or a finite number")


def options(q, softmax_scale, k_scale=None, v_scale=None) -> tuple[float, float]:
    """(scale, v_scale) the kernels take, once `check` has passed: the softmax scale times k_scale, and v_scale."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return scale * (1.0 if k_scale is None else float(k_scale)), 1.0 if v_scale is None else float(v_scale)


def tokens_of(q) -> int:
    """New tokens a sequence: T of a (B, T, Hq, D) q, 1 of a (B, Hq, D) one."""
    return q.shape[1] if len(q.shape) == 4 else 1


def forward(
    batch: int, heads_q: int, heads_k: int, head_dim: int, seqlen_k: int, *, dtype: str, scale: float | None,
    target: Target, page_size: int | None = None, strides_q=None, strides_k=None, strides_v=None,
    stride_bt: int | None = None, num_splits: int | None = None, tokens: int = 1, cache_dtype: str | None = None,
    v_scale: float = 1.0,
) -> Plan:  # fmt: skip
    """Inputs q (B, T, Hq, D) (T = tokens), k_cache / v_cache (contiguous (B, seqlen_k, Hk, D), or paged (num_blocks,
    page_size, Hk, D) with seqlen_k = max_pages * page_size), cache_seqlens (B,) int32, and block_table (B,
    max_pages) int32 when paged; unit head-dim strides, the others given ((batch, token, head) for q, (batch or page,
    position, head) for the caches, the row stride of block_table; None = compact). Output out (B, T, Hq, D)
    compact. `num_splits` None: the heuristic's (the tests force others). `cache_dtype`: the caches' (default q's
    `dtype`; FP8 with `scale` = softmax scale x k_scale and `v_scale`)."""
    paged = page_size is not None
    cache_dtype = cache_dtype or dtype
    if cache_dtype == FP8:
        require_e4m3(NAME, target)
    inputs = {"q": dtype, "k_cache": cache_dtype, "v_cache": cache_dtype, "cache_seqlens": "int32"}
    if paged:
        inputs["block_table"] = "int32"
    empty = batch * tokens * heads_q * head_dim == 0 or seqlen_k == 0  # nothing to attend to: out is 0
    buffers = {"out": BufferSpec((batch, tokens, heads_q, head_dim), dtype, zeroed=empty)}
    if empty:
        return Plan(inputs, buffers, (), ("out",))
    rows = tokens * (heads_q // heads_k)  # of a key/value head
    fp8 = cache_dtype == FP8
    block_g, block_n, block_d, warps, stages = config(head_dim, rows, dtype, target, fp8)
    splits = num_splits or split_count(batch, heads_k, rows, seqlen_k, head_dim, dtype, target, paged, fp8)
    sq = tuple(strides_q) if strides_q is not None else (tokens * heads_q * head_dim, heads_q * head_dim, head_dim)
    positions = page_size if paged else seqlen_k  # per page (paged) or per sequence
    compact = (positions * heads_k * head_dim, heads_k * head_dim, head_dim)
    sk = tuple(strides_k) if strides_k is not None else compact
    sv = tuple(strides_v) if strides_v is not None else compact
    stride_bt = (seqlen_k // page_size if stride_bt is None else stride_bt) if paged else 0
    ieee = ieee_dots(dtype)
    pdl = pdl_combine(splits, target)
    reads = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table" if paged else None, tokens, heads_q, heads_k,
             head_dim, seqlen_k, page_size if paged else seqlen_k, stride_bt, *sq, *sk, *sv,
             default_scale(head_dim) if scale is None else float(scale), float(v_scale))  # fmt: skip
    writes = (None, None, "out") if splits == 1 else ("partial_o", "partial_lse", None)
    constexprs = dict(BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, PAGED=paged, IEEE=ieee, SPLIT=splits > 1,
                      PAGES_A_BLOCK=pages_a_block(page_size, block_n), PDL=pdl,
                      E4M3_ASM=cache_dtype == FP8 and dtype != "float32" and target.cuda_arch >= 89)  # fmt: skip
    split = Launch(
        decode_split_kernel,
        (batch, heads_k * cdiv(rows, block_g), splits),
        reads,
        writes,
        constexprs,
        warps,
        stages,
    )
    launches = (in_units(split, *UNIT_ARGS, units=UNITS),)
    if splits > 1:
        buffers |= {"partial_o": BufferSpec((batch, tokens, heads_q, splits, head_dim), "float32"),
                    "partial_lse": BufferSpec((batch, tokens, heads_q, splits), "float32")}  # fmt: skip
        combine = Launch(decode_combine_kernel, (batch * tokens, heads_q), ("partial_o", "partial_lse", heads_q,
                         head_dim, splits), ("out", None), dict(BLOCK_S=COMBINE_SPLITS, BLOCK_D=block_d, HAS_LSE=False,
                         PDL=pdl), num_warps=2, pdl=pdl)  # fmt: skip
        launches += (in_units(combine, "head_dim", units=UNITS),)
    return Plan(inputs, buffers, launches, ("out",))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def gather(cache: np.ndarray, b: int, length: int, block_table=None) -> np.ndarray:
    """The first `length` positions of sequence b's cache, (length, Hk, D)."""
    if block_table is None:
        return cache[b, :length]
    p = np.arange(length)
    return cache[block_table[b, p // cache.shape[1]], p % cache.shape[1]]


def reference(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None, v_scale=None):
    tokens = tokens_of(q)
    q4 = q.reshape(q.shape[0], tokens, *q.shape[-2:])
    batch, _, heads_q, head_dim = q4.shape
    heads_k = k_cache.shape[2]
    scale = default_scale(head_dim) if softmax_scale is None else softmax_scale
    k_scale, v_scale = (1.0 if x is None else float(x) for x in (k_scale, v_scale))
    out = np.zeros(q4.shape)
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    for b, t in np.ndindex(batch, tokens):
        length = int(np.clip(cache_seqlens[b], 0, capacity)) - (tokens - 1 - t)  # causal among the new tokens
        if length <= 0 or heads_q == 0:
            continue
        group = heads_q // heads_k
        k = np.repeat(gather(k_cache, b, length, block_table).astype(np.float64), group, axis=1) * k_scale  # (L, Hq, D)
        v = np.repeat(gather(v_cache, b, length, block_table).astype(np.float64), group, axis=1) * v_scale
        s = np.einsum("hd,lhd->hl", q4[b, t].astype(np.float64), k) * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b, t] = np.einsum("hl,lhd->hd", p / p.sum(axis=1, keepdims=True), v)
    return (out.reshape(q.shape),)


def reference_vjp(kwargs, cotangents):
    return {}  # not differentiable (grad_args is empty)


def cost(kwargs) -> tuple[Cost, Cost]:
    """flops: 4 Hq D per attended position (two products); bytes: q, the attended K / V rows, out. No backward."""
    q, k = kwargs["q"], kwargs["k_cache"]
    heads_q, head_dim = q.shape[-2:]
    capacity = k.shape[1] * (kwargs["block_table"].shape[1] if kwargs.get("block_table") is not None else 1)
    positions = int(np.clip(kwargs["cache_seqlens"], 0, capacity).sum())
    item = ITEMSIZE[str(q.dtype)]
    kv_bytes = 2 * positions * k.shape[2] * head_dim * ITEMSIZE[str(k.dtype)]
    flops = 4 * positions * tokens_of(q) * heads_q * head_dim
    return Cost(2 * q.size * item + kv_bytes + 4 * q.shape[0], flops), Cost(0, 0)


LONG_CONTEXT = 256  # a capacity taken from the drawn shape as it is (benchmarks: every sequence full); else drawn


def draw_lengths(rng: np.random.Generator, batch: int, capacity: int, page: int, full: bool) -> np.ndarray:
    """cache_seqlens (batch,) int32: every sequence full (a benchmark's), or drawn among 0, 1, page +- 1, page, the
    capacity and uniform ones."""
    if full:
        return np.full(batch, capacity, np.int32)
    choices = np.array([0, 1, page - 1, page, page + 1, capacity, *rng.integers(0, capacity + 1, 3)])
    return np.clip(rng.choice(choices, batch), 0, capacity).astype(np.int32)


def sample(rng: np.random.Generator, shape, dtype: str, paged=False, gqa=1, page_size=None, tokens=1, fp8=False):
    """q (B, Hk * gqa, D), caches of capacity C, from a drawn shape (..., n): C = shape[1] if it is 0 or >=
    LONG_CONTEXT (a benchmark's shape: every sequence full, B = shape[0] and Hk = shape[2] as they are), else drawn
    in [1, 160], B = shape[0] at most 4 (1 without leading dims) and Hk = shape[2] (as it is from 16 on, else at
    most 4; 2 if absent); D = n up to 64 (or 128 / 256), else 16, 32 or 64. Lengths drawn among 0, 1,
    page_size +- 1, page_size, C and uniform ones. Paged: page_size drawn from 1, 7, 16, 32 (unless given), the pool
    holds the B * max_pages pages (and 3 more) in a shuffled order. tokens > 1: q (B, tokens, Hq, D). fp8: FP8
    caches of 4 x standard normals with k_scale 0.25 and v_scale 0.5."""
    lead, n = tuple(shape[:-1]), shape[-1]
    given = len(lead) > 1 and (lead[1] == 0 or lead[1] >= LONG_CONTEXT)
    batch = (lead[0] if given else min(lead[0], 4)) if lead else 1
    capacity = lead[1] if given else int(rng.integers(1, 161))
    heads_k = lead[2] if len(lead) > 2 else 2
    heads_k = heads_k if heads_k >= 16 or given else min(heads_k, 4)
    head_dim = n if n <= 64 or n in (128, 256) else (16, 32, 64)[n % 3]
    page = int(page_size or rng.choice([1, 7, 16, 32])) if paged else 16
    max_pages = cdiv(capacity, page)
    capacity = max_pages * page if paged else capacity
    lengths = draw_lengths(rng, batch, capacity, page, full=given)
    q_shape = (batch, heads_k * gqa, head_dim) if tokens == 1 else (batch, tokens, heads_k * gqa, head_dim)
    kwargs = {"q": round_to(rng.standard_normal(q_shape), dtype)}
    cache_shape = (batch * max_pages + 3, page) if paged else (batch, capacity)
    kwargs["k_cache"], kwargs["v_cache"] = (
        round_to(rng.standard_normal(cache_shape + (heads_k, head_dim)) * (4 if fp8 else 1), FP8 if fp8 else dtype)
        for _ in range(2)
    )
    table = None
    if paged:
        table = rng.permutation(cache_shape[0])[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    scales = {"k_scale": 0.25, "v_scale": 0.5} if fp8 else {"k_scale": None, "v_scale": None}
    return kwargs | {"cache_seqlens": lengths, "block_table": table, "softmax_scale": None} | scales


def bad_inputs(kwargs) -> list[BadInput]:
    q, k, v, lengths = kwargs["q"], kwargs["k_cache"], kwargs["v_cache"], kwargs["cache_seqlens"]
    table = np.zeros((q.shape[0], 2), np.int32)
    return [
        BadInput({"q": q[(0,) * (q.ndim - 2)]}, ValueError, "decode_attention: q must be 3-D .* or 4-D"),
        BadInput({"q": q[..., None, None]}, ValueError, "decode_attention: q must be 3-D .* or 4-D"),
        BadInput({"q": q.astype(np.int32)}, TypeError, "decode_attention: q must have dtype"),
        BadInput({"k_cache": k.astype(np.int32)}, TypeError, "decode_attention: k_cache must have dtype"),
        BadInput({"v_cache": v.astype(np.float32)} if k.dtype.name == FP8 else {"k_cache": round_to(k, FP8)},
                 TypeError, "decode_attention: v_cache must have dtype"),
        BadInput({"k_cache": k[0]}, ValueError, "decode_attention: k_cache must be 4-D"),
        BadInput({"v_cache": v[:, :-1]}, ValueError, "decode_attention: v_cache must have shape"),
        BadInput({"k_cache": k[..., :-1], "v_cache": v[..., :-1]}, ValueError, "decode_attention: k_cache must have"),
        BadInput({"q": np.concatenate([q, q[..., :1, :]], axis=-2)}, ValueError, "decode_attention: q's heads must be"),
        BadInput({"cache_seqlens": lengths.astype(np.float32)}, TypeError,
                 "decode_attention: cache_seqlens must have dtype int32"),
        BadInput({"cache_seqlens": lengths[:-1]}, ValueError, "decode_attention: cache_seqlens must have shape"),
        BadInput({"block_table": table.astype(np.float32)}, TypeError,
                 "decode_attention: block_table must have dtype int32"),
        BadInput({"block_table": table[:-1]}, ValueError, "decode_attention: block_table must have shape"),
        BadInput({"softmax_scale": "0.3"}, TypeError, "decode_attention: softmax_scale must be None or a finite"),
        BadInput({"softmax_scale": float("nan")}, ValueError, "decode_attention: softmax_scale must be None or a fin"),
        BadInput({"k_scale": "2"}, TypeError, "decode_attention: k_scale must be None or a finite number"),
        BadInput({"v_scale": float("inf")}, ValueError, "decode_attention: v_scale must be None or a finite number"),
        *not_arrays(NAME, "q", "k_cache", "v_cache", "cache_seqlens"),
    ]  # fmt: skip


def plans(target: Target):
    """Every dtype at head dims 40 (padded, units of 8), 64, 128 and 256, contiguous and paged, for groups of up to
    16 query heads; groups of 32 and 64 (MQA-like) and pages of 64 (a block a page) at head dim 128; the unsplit kernel
    (one split) at head dim 128;
    FP8 caches under 16-bit queries at head dim 128 on e4m3 targets.
    The split count of a split kernel is a runtime value."""
    for dtype in FLOAT_DTYPES:
        for head_dim in (40, 64, 128, 256):
            for page_size in (None, 16):
                yield forward(2, 8, 2, head_dim, 256, dtype=dtype, scale=None, target=target, page_size=page_size)
        for group in (32, 64):
            yield forward(2, group, 1, 128, 256, dtype=dtype, scale=None, target=target)
        yield forward(2, 8, 2, 128, 256, dtype=dtype, scale=None, target=target, page_size=16, tokens=4)
        yield forward(2, 8, 2, 128, 256, dtype=dtype, scale=None, target=target, page_size=64)  # a block a page
        yield forward(2, 8, 2, 128, 256, dtype=dtype, scale=None, target=target, num_splits=1)
    if e4m3_target(target):  # FP8 caches
        for dtype in ("bfloat16", "float16"):
            for page_size in (None, 16):
                yield forward(2, 8, 2, 128, 256, dtype=dtype, scale=None, target=target, page_size=page_size,
                              cache_dtype=FP8, v_scale=0.5)  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"paged": (True, False), "gqa": (3, 4, 1), "tokens": (3, 1), "fp8": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
