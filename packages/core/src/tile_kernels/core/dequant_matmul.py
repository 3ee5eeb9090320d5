"""W4A16 GEMM: dequant_matmul(a, qweight, scales, group_size=128, zeros=None) = a @ W for int4 weights.

a (M, K) in float16 / bfloat16 (or float32); qweight (K / 8, N) int32 holds W's 4-bit codes packed 8 per int32 along
K (GPTQ / AWQ layout): code k = 8 i + j of column n is bits 4j .. 4j + 3 of qweight[i, n], unsigned 0 .. 15; scales
and zeros (K / group_size, N) in a's dtype:
    W[k, n] = (code[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]     (zeros = 8 when None)
Returns (M, N) in a's dtype. Not differentiable (inference).

Kernels (`blocks` picks one and its tiles; each streams K in BLOCK_K steps, a step's packed codes (BLOCK_K / 8,
BLOCK_N) read once as coalesced rows of N int32, unpacked in registers by shifts and masks; the weights are read once
per row block, so at decode sizes the kernels stream the int4 weights, a quarter of fp16's bytes):
  * dequant_gemv_kernel, one row of `a` (decode at batch 1): FMA units, every tensor a vector over the program's
    columns (a's elements scalars), the codes turned into floats by their bits (16 or 1 + code / 16, two codes a
    shift), the group's zero and scale applied once per step, the next step's words loaded before this step's math.
    Relative error ~2^-18 in float32 (the int4 codes' own is 2^-4).
  * dequant_matmul_kernel, tensor cores, fp32 accumulation. Where a step lies in one group (BLOCK_K divides
    group_size) the scale can follow the product: s (a @ (MAGIC + code) - (MAGIC + z) rowsum(a)), MAGIC + code made
    by OR-ing the code into the float MAGIC (`magic`), so W is never formed (POST_SCALE, decode sizes); at 128-deep
    steps as eight products of depth 16, one per nibble, so no interleave of the codes (BY_NIBBLE). Otherwise W =
    (code - z) s is formed in fp32 and rounded to a's dtype before the product (prefill sizes, groups narrower than a
    step: a scale per (k, n)).
  * dequant_matmul_t_kernel, tensor cores for up to 16 rows of `a`, transposed (W^T a^T): the codes, two an and-or,
    are the register operand of the product as loaded, no layout conversion (Blocks.transposed; 2-16 rows on sm_90).
  * dequantize_kernel, then the framework's GEMM (a plan Gemm step), from DEQUANTIZE_FIRST_ROWS rows of 16-bit a: W
    formed once in a's dtype, exactly as the reference rounds it.
  K may be split over programs (SPLIT_K: decode sizes, so that enough programs stream the weights), the fp32 partial
products then summed in a fixed order (rows.sum_partials). The reference (`weight`) rounds W to a's dtype, as the
dequantize-then-multiply it stands for; the POST_SCALE and FMA paths skip that rounding (within the tolerance).
Design limits: K a multiple of 8 (whole int32 words) and of group_size; from DEQUANTIZE_FIRST_ROWS rows a call
holds W (K x N in a's dtype) while it runs.
backend="tilelang" runs dequant_matmul_tilelang's Hopper kernel for prefill sizes (TMA, wgmma, a producer warp group).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from . import backends, checks, dequant_matmul_tilelang
from .backends import Call
from .flash_attention import dot
from .host import ieee_dots
from .plan import ITEMSIZE, BufferSpec, Gemm, Launch, Plan, Target, cdiv, in_units
from .registry import BadInput, Cost, OpInfo, gemm_dims, not_arrays, register, round_to
from .rows import sum_partials

NAME = "dequant_matmul"
# backend="tilelang": dequant_matmul_tilelang's Hopper kernel; backend=None: Triton (measured faster)
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.dequant_matmul_tilelang"})
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_ZERO = 8  # the code of 0 when no zeros are given (symmetric int4)
# from this many rows (16-bit a) W is formed once by dequantize_kernel (a K x N buffer in a's dtype for the call) and
# multiplied by the framework's GEMM: the prefill-sized product at the vendor GEMM's speed plus one pass over W, where
# the fused kernels dequantize each weight tile once per row block inside their tensor-core loops
DEQUANTIZE_FIRST_ROWS = 256


@triton.jit
def _codes(packed):
    """The step's int4 codes (BLOCK_K, BLOCK_N) int32 in K's order, from its packed words (BLOCK_K / 8, BLOCK_N)."""
    shifts = tl.arange(0, 8) * 4
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # (BLOCK_K / 8, 8, BLOCK_N): k = 8 i + j
    return tl.reshape(codes, (8 * packed.shape[0], packed.shape[1]))


@triton.jit
def _biased(codes, dtype: tl.constexpr):
    """MAGIC + code in `dtype` (`magic`): in 16-bit floats the code ORed into the low mantissa bits of MAGIC, exact,
    no integer-to-float conversion; in float32 the code itself."""
    if dtype == tl.bfloat16:  # 0x4300 is 128.0
        return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:  # 0x6400 is 1024.0
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return codes.to(tl.float32)


@triton.jit
def dequant_matmul_kernel(
    A, QW, S, Z, M, N, K, group_size, stride_a, stride_qw, stride_s, stride_z,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, ONE_GROUP: tl.constexpr, POST_SCALE: tl.constexpr, BY_NIBBLE: tl.constexpr,
    MAGIC: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K); the tensor-core kernel. OUT (M, N) compact = A @ W (the
    module's formula), or with SPLIT_K > 1 (SPLIT_K, M, N) fp32: slice s of the K steps' partial products."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    a_rows = A + rows[:, None].to(tl.int64) * stride_a
    k_begin, k_end = 0, K
    if SPLIT_K > 1:  # this program's slice of the K steps
        steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_begin = tl.program_id(2) * steps * BLOCK_K
        k_end = tl.minimum(K, k_begin + steps * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = k0 + kk < K
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_rows = k0 // 8 + words
        w_ok = w_rows < K // 8
        packed = tl.load(QW + w_rows[:, None].to(tl.int64) * stride_qw + cols[None, :],
                         mask=w_ok[:, None] & col_ok[None, :], other=0)  # fmt: skip
        if ONE_GROUP:  # the step lies in one group: a row of scales (and zeros)
            group = k0 // group_size
            s = tl.load(S + group * stride_s + cols, mask=col_ok, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(Z + group * stride_z + cols, mask=col_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
        if POST_SCALE:  # acc += s (a @ (MAGIC + code) - (MAGIC + z) rowsum(a)): W itself never formed
            if BY_NIBBLE:  # a product per nibble j: the words' codes j times a's k = 8 i + j (no interleave)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for j in tl.static_range(8):
                    a_j = tl.load(a_rows + (k0 + 8 * words + j)[None, :], mask=row_ok[:, None] & w_ok[None, :],
                                  other=0.0)  # fmt: skip
                    part += dot(a_j, _biased((packed >> (4 * j)) & 0xF, A.dtype.element_ty), IEEE)
            else:
                part = dot(a, _biased(_codes(packed), A.dtype.element_ty), IEEE)
            a_sum = tl.sum(a.to(tl.float32), axis=1)
            acc += (part - a_sum[:, None] * (z + MAGIC)[None, :]) * s[None, :]
        else:  # W = (code - z) s in fp32, rounded to a's dtype (the codes' I2F: the bit trick spilled here on sm_80)
            codes = _codes(packed).to(tl.float32)
            if ONE_GROUP:
                w = (codes - z[None, :]) * s[None, :]
            else:
                group = ((k0 + kk) // group_size).to(tl.int64)[:, None]
                mask = k_ok[:, None] & col_ok[None, :]
                s = tl.load(S + group * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    z = tl.load(Z + group * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    w = (codes - z) * s
                else:
                    w = (codes - 8.0) * s
            acc += dot(a, w.to(A.dtype.element_ty), IEEE)
    out = OUT + tl.program_id(2).to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def dequantize_kernel(
    QW, S, Z, K, N, group_size, stride_qw, stride_s, stride_z,
    W,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr, ONE_GROUP: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(K, BLOCK_K), cdiv(N, BLOCK_N)): W (K, N) compact in its dtype = (code - z) s, as the reference forms
    it (the difference and product exact in fp32, one rounding). ONE_GROUP: BLOCK_K divides group_size, so a tile
    takes one row of scales (and zeros)."""
    kk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.program_id(0) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    col_ok = cols < N
    packed = tl.load(QW + words[:, None].to(tl.int64) * stride_qw + cols[None, :],
                     mask=(words < K // 8)[:, None] & col_ok[None, :], other=0)  # fmt: skip
    mask = (kk < K)[:, None] & col_ok[None, :]
    if ONE_GROUP:  # one row of scales (and zeros) for the tile
        group = ((tl.program_id(0) * BLOCK_K) // group_size).to(tl.int64)
        group_mask = col_ok[None, :]
    else:  # each k's group row
        group = (kk // group_size).to(tl.int64)[:, None]
        group_mask = mask
    s = tl.load(S + group * stride_s + cols[None, :], mask=group_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(Z + group * stride_z + cols[None, :], mask=group_mask, other=0.0).to(tl.float32)
    else:
        z = 8.0
    w = (_codes(packed).to(tl.float32) - z) * s
    tl.store(W + kk[:, None].to(tl.int64) * N + cols[None, :], w.to(W.dtype.element_ty), mask=mask)


@triton.jit
def _pair(packed, j: tl.constexpr, even_one, odd_one):
    """Nibbles j and j + 1 of each word as floats 16 + code / 16 and 1 + code / 16: one shift moves the pair to bits
    15 .. 22 (the top of the mantissa), an and-or each keeps one nibble over the bits of 16.0 (`even_one`) or 1.0
    (`odd_one`), registers: with two immediates ptxas takes two instructions for it. Exact; no integer-to-float
    conversion."""
    if 4 * j <= 15:
        moved = packed << (15 - 4 * j)
    else:
        moved = packed >> (4 * j - 15)
    even = ((moved & 0x78000) | even_one).to(tl.float32, bitcast=True)
    odd = ((moved & 0x780000) | odd_one).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def dequant_gemv_kernel(
    A, QW, S, Z, M, N, K, stride_a, stride_qw, stride_s, stride_z, even_one, odd_one,
    OUT,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, GROUP_STEPS: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_ZEROS: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """As dequant_matmul_kernel for ROWS rows of `a` (grid (cdiv(N, BLOCK_N), cdiv(M, ROWS), SPLIT_K)), on the FMA
    units. Every tensor is a vector over the program's BLOCK_N columns (no layout conversion, no reduction across
    threads), one per row of `a`; a step reads BLOCK_K / 8 rows of words, and a's elements as scalars. Nibble pair
    (j, j + 1) of a word, as x = 16 + code / 16 and y = 1 + code / 16 (`_pair`, once for all rows), multiplies a
    row's elements k = 8 i + j and 8 i + j + 1 into its column sum p = 16 E + O + sum a code / 16 (E, O: the step's
    sums of the row's even and odd elements), so
        sum a (code - z) = 16 p - (256 + z) E - (16 + z) O,
    times the step's scale (its group's: GROUP_STEPS steps a group). Per weight element: half a shift and an and-or,
    and a multiply-add a row. `even_one`, `odd_one`: the bits of 16.0f and 1.0f, arguments so that they stay in
    registers. N and the strides of qweight, scales and zeros come in UNITs (plan.in_units). Rows past M read row
    M - 1 and are not stored."""
    N, stride_qw, stride_s, stride_z = N * UNIT, stride_qw * UNIT, stride_s * UNIT, stride_z * UNIT
    # + (K >> 31) = + 0 (K >= 0): values ptxas must hold in registers (sm_80 reads an argument from the constant bank
    # inside the LOP3, which then takes two)
    even_one += K >> 31
    odd_one += K >> 31
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # the scales in the words' vectors of 4 (the bf16 load would take 8), so that they share the words' layout
    cols_of_4 = tl.max_contiguous(cols, 4)
    total = K // BLOCK_K
    per_split = tl.cdiv(total, SPLIT_K)
    first = tl.program_id(2) * per_split
    last = tl.minimum(total, first + per_split)
    row0 = tl.program_id(1) * ROWS
    a_rows = ()
    accs = ()
    for r in tl.static_range(ROWS):
        a_rows = a_rows + (A + tl.minimum(row0 + r, M - 1).to(tl.int64) * stride_a,)
        accs = accs + (tl.zeros((BLOCK_N,), dtype=tl.float32),)
    w_row = QW + (first * (BLOCK_K // 8)).to(tl.int64) * stride_qw + cols
    words = ()  # a step's rows of words; the next step's are loaded before this step's math
    for i in tl.static_range(BLOCK_K // 8):
        words = words + (tl.load(w_row + i * stride_qw, mask=col_ok & (cols * 0 + first < last), other=0),)
    for step in range(first, last):
        w_row += (BLOCK_K // 8) * stride_qw
        ahead = col_ok & (cols * 0 + step + 1 < last)  # a vector compare: the interpreter mis-types a scalar one
        following = ()
        for i in tl.static_range(BLOCK_K // 8):
            following = following + (tl.load(w_row + i * stride_qw, mask=ahead, other=0),)
        k0 = step * BLOCK_K
        group = step // GROUP_STEPS
        s = tl.load(S + group * stride_s + cols_of_4, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(Z + group * stride_z + cols_of_4, mask=col_ok, other=0.0).to(tl.float32)
        new_accs = ()
        for r in tl.static_range(ROWS):
            part = tl.zeros((BLOCK_N,), dtype=tl.float32)
            even_sum = 0.0
            odd_sum = 0.0
            for i in tl.static_range(BLOCK_K // 8):
                for j in tl.static_range(0, 8, 2):
                    a_even = tl.load(a_rows[r] + k0 + 8 * i + j).to(tl.float32)
                    a_odd = tl.load(a_rows[r] + k0 + 8 * i + j + 1).to(tl.float32)
                    x, y = _pair(words[i], j, even_one, odd_one)  # one for all rows (common subexpressions)
                    part += a_even * x  # two multiply-adds: a sum of both products first would take three
                    part += a_odd * y
                    even_sum += a_even
                    odd_sum += a_odd
            if HAS_ZEROS:
                t = 16.0 * part - (256.0 * even_sum + 16.0 * odd_sum) - z * (even_sum + odd_sum)
            else:
                t = 16.0 * part - (264.0 * even_sum + 24.0 * odd_sum)
            new_accs = new_accs + (accs[r] + t * s,)
        accs = new_accs
        words = following
    for r in tl.static_range(ROWS):
        out = OUT + tl.program_id(2).to(tl.int64) * M * N + (row0 + r).to(tl.int64) * N + cols
        tl.store(out, accs[r].to(OUT.dtype.element_ty), mask=col_ok & (cols * 0 + row0 + r < M))


@triton.jit
def _load_words(ptrs, ASM: tl.constexpr):
    """int32 words at ptrs. ASM (NVIDIA): by inline PTX, so Triton neither pipelines them through shared memory nor
    picks their layout: they take the layout of their use, the tensor cores' register operand (4 bytes a lane, 8 lanes
    on 32 adjacent bytes). Unmasked: the caller keeps ptrs in bounds."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptrs.to(tl.int64, bitcast=True)],
                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    return tl.load(ptrs)


@triton.jit
def _biased_pairs(packed, s: tl.constexpr, magic2, dtype: tl.constexpr):
    """Nibbles s and s + 4 of each word as a pair of 16-bit floats (MAGIC + code_s, MAGIC + code_{s+4}), shape
    (..., 2): (w >> 4 s) & 0x000F000F | magic2 (magic2: MAGIC's bits in both halves, a register) is one shift and one
    and-or for two codes; the halves are the pair's registers, nothing moves."""
    if s > 0:
        packed = packed >> (4 * s)  # the mask drops the sign bits
    pair = (packed & 0x000F000F) | magic2
    lo = pair.to(tl.int16).to(dtype, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(dtype, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def dequant_matmul_t_kernel(
    A, QW, S, Z, M, N, K, stride_a, stride_qw, stride_s, stride_z, magic2,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_STEPS: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K); as dequant_matmul_kernel, transposed for few rows of `a`:
    out^T (BLOCK_N, BLOCK_M) = W^T a^T, so the dequantized weights are the tensor cores' register operand (sm_90:
    wgmma's A from registers, a^T from shared memory) and reach it without a layout conversion. A step's words
    (BLOCK_N, BLOCK_K / 8), the next step's loaded before this step's math, give four products: product s takes
    nibbles s and s + 4 of every word (`_biased_pairs`: 2 codes an and-or), at depth k' = 2 i + h <-> k = 8 i + s + 4 h,
    times a's elements permuted alike in registers. Post-scaled as dequant_matmul_kernel: s (P - (MAGIC + z) rowsum a).
    16-bit a only; BLOCK_K divides group_size (GROUP_STEPS steps a group) and is >= 64; N >= BLOCK_N."""
    KW: tl.constexpr = BLOCK_K // 8
    magic2 += K >> 31  # + 0 (K >= 0): held in a register, so each and-or is one LOP3
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # the last column block ends at N (N >= BLOCK_N), overlapping its neighbour: the unmasked word loads stay in
    # bounds and a thread's words keep constant column offsets (immediates in the loads' addresses)
    cols = tl.minimum(tl.program_id(0) * BLOCK_N, N - BLOCK_N) + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    total = K // BLOCK_K
    per_split = tl.cdiv(total, SPLIT_K)
    first = tl.program_id(2) * per_split
    last = tl.minimum(total, first + per_split)
    a_rows = A + rows.to(tl.int64) * stride_a
    # an empty split loads the last step's words (never used)
    w_ptrs = QW + (tl.minimum(first, total - 1) * KW).to(tl.int64) * stride_qw + \
        (tl.arange(0, KW)[None, :] * stride_qw + cols[:, None])  # fmt: skip
    following = _load_words(w_ptrs, ASM)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(first, last):
        packed = following
        w_ptrs += KW * stride_qw
        if step + 1 < last:
            following = _load_words(w_ptrs, ASM)
        group = step // GROUP_STEPS
        s = tl.load(S + group * stride_s + cols).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(Z + group * stride_z + cols).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        a = tl.load(a_rows[:, None] + step * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], mask=row_ok[:, None], other=0.0)
        a_sum = tl.sum(a.to(tl.float32), axis=1)
        # k = 8 i + 4 h + 2 s1 + s0 -> (s1, s0, i, h): a's (BLOCK_M, 2 KW) slices for s = 2 s1 + s0
        a_q = tl.reshape(tl.permute(tl.reshape(a, (BLOCK_M, KW, 2, 2, 2)), (0, 3, 4, 1, 2)), (BLOCK_M, 2, 2, 2 * KW))
        a01, a23 = tl.split(tl.permute(a_q, (0, 2, 3, 1)))
        a0, a1 = tl.split(tl.permute(a01, (0, 2, 1)))
        a2, a3 = tl.split(tl.permute(a23, (0, 2, 1)))
        a_s = (a0, a1, a2, a3)
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for nib in tl.static_range(4):
            w = tl.reshape(_biased_pairs(packed, nib, magic2, A.dtype.element_ty), (BLOCK_N, 2 * KW))
            part += dot(w, tl.trans(a_s[nib]), IEEE)
        acc += (part - (z + MAGIC)[:, None] * a_sum[None, :]) * s[:, None]
    out = OUT + tl.program_id(2).to(tl.int64) * M * N + rows[None, :].to(tl.int64) * N + cols[:, None]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[None, :])


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


@dataclass(frozen=True)
class Blocks:
    """A launch configuration: the kernel (dequant_gemv_kernel if gemv, dequant_matmul_t_kernel if transposed,
    dequantize_kernel's (block_k, block_n) tiles then the vendor GEMM if dequantize_first, else dequant_matmul_kernel),
    its constexprs of the same names (the GEMV's ROWS: block_m), and the split of K over programs (partial products
    summed after)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split_k: int = 1
    gemv: bool = False
    post_scale: bool = True
    by_nibble: bool = False
    transposed: bool = False
    dequantize_first: bool = False


def blocks(m: int, n: int, k: int, group_size: int, dtype: str, target: Target) -> Blocks:
    """One row (two on AMD, and on sm_90 where the transposed kernel does not apply): the FMA kernel, 512 columns on
    4 warps (4 a thread), K split so that about six programs an SM stream the weights; up to 16 rows on sm_90: the
    transposed tensor-core kernel (weights in registers), 256 columns, K split for about twelve programs an SM, where
    it applies (transposed_fits, at 256 columns); elsewhere one 16-row tensor-core tile of 256 columns, a product per
    nibble, K split for six; up to 64: 64-row tiles; prefill-sized M: 128 x 128 tiles (16 x 32 in float32) with W
    formed in a's dtype, or from DEQUANTIZE_FIRST_ROWS rows (16-bit a) W formed once, then the vendor GEMM. BLOCK_K
    the largest of 128 .. 16 that divides the group (one scale row a step; 32 .. 8 for the FMA kernel). The fastest
    of benchmarks/sweep_dequant_matmul.py on an H100 and an H200 (benchmarks/results/h200/notes.md). Wavefront-64
    (AMD) targets, 64 KiB of LDS: one software-pipelining stage."""
    stages = 1 if target.warp_size == 64 else 3

    def split(block_n, block_k, per_sm=6):  # about per_sm programs an SM, each as many steps (the last may take fewer)
        steps = cdiv(k, block_k)
        return cdiv(steps, max(1, steps // cdiv(per_sm * target.num_sms, cdiv(n, block_n))))

    block_k = next((b for b in (128, 64, 32, 16) if group_size % b == 0), 32)
    transposed = target.cuda_arch == 90 and 2 <= m <= 16 and transposed_fits(dtype, block_k, group_size, n, 256)
    # two rows: the GEMV spills on sm_80-89 (ptxas of Triton 3.9: 3.3 KB a thread at 512 x 64)
    if (m == 1 or (m == 2 and not transposed and not 0 < target.cuda_arch < 90)) and group_size % 8 == 0:
        gemv_k = next(b for b in (32, 16, 8) if group_size % b == 0)
        return Blocks(m, 512, gemv_k, 4, stages, split(512, gemv_k), gemv=True)
    if transposed:
        return Blocks(16, 256, block_k, 4, 2, split(256, block_k, per_sm=12), transposed=True)
    if dtype == "float32":  # IEEE products (no TF32) hold more registers: small tiles
        return Blocks(16, 32, min(block_k, 32), 4, min(stages, 2))
    if m <= 16:
        one_group = group_size % block_k == 0
        return Blocks(16, 256, block_k, 4, stages, split(256, block_k) if one_group else 1, by_nibble=True)
    if m <= 64:
        block_n = next((b for b in (128, 64) if cdiv(n, b) >= 2 * target.num_sms), 32)
        return Blocks(64, block_n, block_k, 4, stages)
    if m >= DEQUANTIZE_FIRST_ROWS:  # 64 x 128 tiles of W (32 elements a thread), one group a tile where one divides
        return Blocks(m, 128, min(block_k, 64), 8, 1, dequantize_first=True)
    return Blocks(128, 128, min(block_k, 64), 8, stages, post_scale=False)


GEMV_ONES = (0x41800000, 0x3F800000)  # 16.0f, 1.0f: dequant_gemv_kernel's even_one, odd_one
MAGIC_PAIRS = {"bfloat16": 0x43004300, "float16": 0x64006400}  # dequant_matmul_t_kernel's magic2: `magic` twice


def transposed_fits(dtype: str, block_k: int, group_size: int, n: int, block_n: int) -> bool:
    """Whether dequant_matmul_t_kernel takes these tiles: 16-bit a, steps of one group and >= 64 deep, N >= block_n."""
    return dtype in MAGIC_PAIRS and block_k >= 64 and group_size % block_k == 0 and n >= block_n


def magic(dtype: str) -> float:
    """The float whose bit pattern ORed with a code c in 0 .. 15 is MAGIC + c, exactly, in `dtype` (0: converted)."""
    return {"bfloat16": 128.0, "float16": 1024.0}.get(dtype, 0.0)


def forward(m: int, n: int, k: int, *, dtype: str, group_size: int, has_zeros: bool, target: Target,
            stride_a: int | None = None, stride_qw: int | None = None, stride_s: int | None = None,
            stride_z: int | None = None, tiles: Blocks | None = None) -> Plan:  # fmt: skip
    """Inputs a (M, K), qweight (K / 8, N), scales [and zeros] (K / group_size, N), each at its row stride (None:
    compact) with a unit column stride. Output out (M, N) compact in a's dtype (zeros when K = 0). With K split, a
    (split, M, N) fp32 buffer of partial products, summed in a fixed order by rows.sum_partials. `tiles` overrides
    `blocks`' choice."""
    inputs = {"a": dtype, "qweight": "int32", "scales": dtype} | ({"zeros": dtype} if has_zeros else {})
    buffers = {"out": BufferSpec((m, n), dtype, zeroed=not (m and n and k))}
    launches = ()
    if m and n and k:
        b = tiles or blocks(m, n, k, group_size, dtype, target)
        ieee = ieee_dots(dtype)
        strides = (k if stride_a is None else stride_a, *(n if s is None else s for s in (stride_qw, stride_s)),
                   (n if stride_z is None else stride_z) if has_zeros else 0)  # fmt: skip
        one_group = group_size % b.block_k == 0
        post_scale = b.post_scale and one_group
        products = "partial" if b.split_k > 1 else "out"
        grid = (cdiv(n, b.block_n), cdiv(m, b.block_m), b.split_k)
        reads = ("a", "qweight", "scales", "zeros" if has_zeros else None, m, n, k, group_size, *strides)
        constexprs = dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, SPLIT_K=b.split_k,
                          HAS_ZEROS=has_zeros)  # fmt: skip
        if b.dequantize_first:  # W formed once in a's dtype, then a @ W by the framework's GEMM
            buffers["weight"] = BufferSpec((k, n), dtype)
            reads = ("qweight", "scales", "zeros" if has_zeros else None, k, n, group_size, *strides[1:])
            constexprs = dict(BLOCK_K=b.block_k, BLOCK_N=b.block_n, HAS_ZEROS=has_zeros, ONE_GROUP=one_group)
            grid = (cdiv(k, b.block_k), cdiv(n, b.block_n))
            dequantize = Launch(dequantize_kernel, grid, reads, ("weight",), constexprs, b.warps, 1)
            launches = (dequantize, Gemm("out", "a", "weight"))
        elif b.transposed:
            if not transposed_fits(dtype, b.block_k, group_size, n, b.block_n):
                raise ValueError(f"{NAME}: transposed tiles take 16-bit a, a block_k >= 64 that divides group_size "
                                 f"and N >= block_n, got {dtype}, block_k {b.block_k}, group_size {group_size}, "
                                 f"N {n}")  # fmt: skip
            constexprs |= dict(GROUP_STEPS=group_size // b.block_k, MAGIC=magic(dtype), IEEE=ieee,
                               ASM=target.cuda_arch > 0)  # fmt: skip
            reads = (*reads[:7], *strides, MAGIC_PAIRS[dtype])
            launches = (Launch(dequant_matmul_t_kernel, grid, reads, (products,), constexprs, b.warps, b.stages),)
        elif b.gemv:
            constexprs = dict(BLOCK_N=b.block_n, BLOCK_K=b.block_k, ROWS=b.block_m,
                              GROUP_STEPS=group_size // b.block_k, SPLIT_K=b.split_k, HAS_ZEROS=has_zeros)  # fmt: skip
            reads = (*reads[:7], *strides, *GEMV_ONES)
            launch = Launch(dequant_gemv_kernel, grid, reads, (products,), constexprs, b.warps, b.stages)
            launches = (in_units(launch, "N", "stride_qw", "stride_s", "stride_z"),)
        else:
            by_nibble = b.by_nibble and post_scale and b.block_k >= 128  # products of K = BLOCK_K / 8 >= 16
            constexprs |= dict(ONE_GROUP=one_group, POST_SCALE=post_scale, BY_NIBBLE=by_nibble,
                               MAGIC=magic(dtype) if post_scale else 0.0, IEEE=ieee)  # fmt: skip
            launches = (Launch(dequant_matmul_kernel, grid, reads, (products,), constexprs, b.warps, b.stages),)
        if b.split_k > 1:
            buffers["partial"] = BufferSpec((b.split_k, m, n), "float32")
            launches += (sum_partials("partial", "out", 1, b.split_k, m * n, target),)
    return Plan(inputs, buffers, launches, ("out",))


def check_backend(backend: str, dtype: str, n: int, group_size: int, arch: int | None = None) -> None:
    """Raises ValueError naming the input a resolved backend cannot run (dequant_matmul_tilelang.unsupported)."""
    if backend == "tilelang" and (why := dequant_matmul_tilelang.unsupported(dtype, n, group_size, arch)):
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")


def compiled_forward(backend: str, m: int, n: int, k: int, *, dtype: str, group_size: int, has_zeros: bool,
                     arch: int, target: Target, tile_config: str | None = None) -> Plan:  # fmt: skip
    """The TileLang backend's forward for compute capability `arch` (90): a (M, K), qweight (K / 8, N), scales [and
    zeros] (K / group_size, N) compact; out (M, N) compact in dtype. One Call; an empty product runs `forward`'s
    plan (zeros). `tile_config`: one of dequant_matmul_tilelang.CONFIGS (None: its default)."""
    check_backend(backend, dtype, n, group_size, arch)
    if not (m and n and k):
        return forward(m, n, k, dtype=dtype, group_size=group_size, has_zeros=has_zeros, target=target)
    module = backends.module(NAME, backend)
    kernel = module.kernel_name(has_zeros, tile_config or module.DEFAULT_CONFIG)
    load = functools.partial(module.function, kernel, dtype, dtype, arch, group_size)
    inputs = {"a": dtype, "qweight": "int32", "scales": dtype} | ({"zeros": dtype} if has_zeros else {})
    key = f"tile_kernels_{backend}_{kernel}_g{group_size}_{dtype}_sm{arch}"
    return Plan(inputs, {"out": BufferSpec((m, n), dtype)}, (Call(key, load, tuple(inputs), ("out",)),), ("out",))


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
    """W (K, N) in float64 as a dequantization forms it: (code - zero) * scale, rounded to a's dtype."""
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
    """(M, K, N) as registry.gemm_dims gives them, K = group_size x 1 .. 3 where it gives none. Random codes, scales
    of either sign around 0.02 (outputs of order 1), zeros among the 16 codes."""
    m, k, n = gemm_dims(shape)
    k = group_size * int(rng.integers(1, 4)) if k is None else k
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
    """Decode- and prefill-sized tiles for each dtype, with and without zeros, one-group and per-k scale steps, W
    formed first; the transposed tiles for 16-bit dtypes."""
    for dtype in DTYPES:
        for m, group_size in ((1, 128), (2, 64), (16, 32), (128, 128), (128, 8), (DEQUANTIZE_FIRST_ROWS, 128)):
            for has_zeros in (False, True):
                k, n = 4 * max(group_size, 128), 4096
                yield forward(m, n, k, dtype=dtype, group_size=group_size, has_zeros=has_zeros, target=target)
    transposed = Blocks(16, 128, 128, 4, 2, 8, transposed=True)  # 128-deep steps (`blocks` takes them on sm_90 only)
    for dtype in MAGIC_PAIRS:
        for has_zeros in (False, True):
            yield forward(16, 4096, 512, dtype=dtype, group_size=128, has_zeros=has_zeros, target=target,
                          tiles=transposed)  # fmt: skip


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
