"""FlashAttention: flash_attention(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0).

q (B, Sq, Hq, D), k / v (B, Sk, Hk, D), Hq % Hk == 0 (query head h reads key/value head h // (Hq / Hk)):
    s[i, j] = scale * q_i . k_j                       scale = softmax_scale or 1 / sqrt(D)
    s[i, j] = softcap * tanh(s[i, j] / softcap)        when softcap > 0
    key j is visible to query i iff  i + Sk - Sq - left <= j <= i + Sk - Sq + right   (bottom-right aligned)
        window = (left, right), -1 = unbounded; causal sets right = 0
    out_i = sum_j softmax_j(s[i, :] over visible j) v_j; a row that sees no key gives 0 (lse = +inf)
Backward (flash-attn 2), with P = exp(s - lse), delta_i = sum_d dO_i * O_i:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * (1 - tanh^2 when softcap),  dQ = scale dS K,  dK = scale dS^T Q

Kernels (fp32 accumulation, the log-sum-exp kept in base 2 internally):
  * forward: one program per (BLOCK_M queries, query head); online softmax over the BLOCK_N key blocks of the
    query block's visible band; blocks that the band covers entirely skip the mask (a masked prefix, an unmasked
    middle and a masked suffix loop). Writes out and lse (B, Hq, Sq).
  * backward: a preprocess kernel (delta), a dK/dV kernel (one program per BLOCK_N keys of a key/value head, looping
    over the Hq / Hk query heads of its group and the query blocks that see the keys: no atomics, GQA included; under
    a causal mask its programs start longest first, key_chunk), and a dQ kernel (one program per BLOCK_M queries,
    looping over key blocks as the forward).
Packed sequences (flash_attention_varlen.py): the same kernels compiled with VARLEN read batch entry b's first row
and length from cu_seqlens (q (total_q, Hq, D), k / v (total_k, Hk, D), lse (Hq, total_q)); the grid covers the
longest sequence and a block past its own sequence's end returns at once.
The window is passed as runtime integers (unbounded = Sq + Sk), so causal / windowed / full attention share one
compiled kernel; only softcap and the dtype's dot precision (IEEE for float32, no TF32) are compile-time switches.
Head dims up to 256, padded to a power of two >= 32 (EVEN_D when the head dim is one). Offsets of (batch, head)
bases are 64-bit; in-sequence offsets are 32-bit (a (S, H, D) slice of one batch up to 2^31 elements).
Block configurations: a few per head-dim bucket and dtype (`configs`), the first being the default; plans(target)
enumerates all of them for the AOT matrix (the set an autotuner on the device may choose from).
Backends (backends.py): "triton" (the kernels here) and "tilelang", TileLang kernels (flash_attention_tilelang.py,
float16 / bfloat16) run as Plans of Calls: the forward by `compiled_forward` (the same (out, lse) as the Triton
forward) and, on sm_90a for head dims up to 128, the backward by `compiled_backward` (dQ accumulated with fp32
atomics); elsewhere backend="tilelang" runs the Triton backward (`compiled_backward_unsupported` says so).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import triton
import triton.language as tl

from . import backends, checks, flash_attention_tilelang
from .backends import Call
from .host import ieee_dots
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, dtype_name, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "flash_attention"
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
# the int arguments the kernels build addresses from, passed in units of 16 elements where they all divide (_aligned)
UNIT_ARGS = ("head_dim", "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
             "stride_vs", "stride_vh")  # fmt: skip
# backend="tilelang" runs the TileLang forward and backward (the Triton backward above head dim 128); backend=None:
# preferred_backend.
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.flash_attention_tilelang"})


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp (portable: no libdevice); saturates to +-1."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(qk, scale, softcap, SOFTCAP: tl.constexpr):
    """(scores in base-2 units, tanh term for the softcap gradient) from raw q.k products."""
    if SOFTCAP:
        t = _tanh(qk * (scale / softcap))
        return t * (softcap * 1.4426950408889634), t
    return qk * (scale * 1.4426950408889634), qk


@triton.jit
def _load(ptrs, mask_a, mask_b, USE_A: tl.constexpr, USE_B: tl.constexpr):
    """tl.load with the masks that apply (a constexpr choice each), 0 elsewhere."""
    if USE_A:
        if USE_B:
            x = tl.load(ptrs, mask=mask_a & mask_b, other=0.0)
        else:
            x = tl.load(ptrs, mask=mask_a, other=0.0)
    else:
        if USE_B:
            x = tl.load(ptrs, mask=mask_b, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store(ptrs, value, mask_a, mask_b, USE_B: tl.constexpr):
    if USE_B:
        tl.store(ptrs, value, mask=mask_a & mask_b)
    else:
        tl.store(ptrs, value, mask=mask_a)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE: float32 operands (upcast if needed) at full precision, no TF32."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _aligned(head_dim, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, UNIT: tl.constexpr):
    """The head dim and the strides, passed in units of UNIT elements (plan.in_units: UNIT_ARGS), multiplied back."""
    return (head_dim * UNIT, sqb * UNIT, sqs * UNIT, sqh * UNIT, skb * UNIT, sks * UNIT, skh * UNIT, svb * UNIT,
            svs * UNIT, svh * UNIT)  # fmt: skip


@triton.jit
def _visible(rows, cols, seqlen_k, shift, left, right):
    """Key `cols` visible to query `rows` (shift = Sk - Sq: bottom-right alignment), for rows / cols already shaped to
    broadcast: (M, 1) and (1, N), or (1, M) and (N, 1) for the transposed scores."""
    diag = rows + shift
    return (cols < seqlen_k) & (cols >= diag - left) & (cols <= diag + right)


@triton.jit
def _sequence(b, seqlen, CU, VARLEN: tl.constexpr):
    """(first row, length) of batch entry b's sequence as rows of the compact (B * S) or packed (total) layout: b * S
    and S at a fixed length, cu[b] and cu[b + 1] - cu[b] packed."""
    if VARLEN:
        start = tl.load(CU + b)
        return start.to(tl.int64), tl.load(CU + b + 1) - start
    return b * seqlen, seqlen


@triton.jit
def _lse_row(b, h, heads_q, seqlen_q, q0, VARLEN: tl.constexpr):
    """Offset of (b, h)'s first row in lse / delta: (B, Hq, Sq) at a fixed length, (Hq, total_q) packed (where the
    kernels' seqlen_q argument is total_q)."""
    if VARLEN:
        return h * seqlen_q + q0
    return (b * heads_q + h) * seqlen_q


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, rows, start, end, seqlen_k, shift, left, right, scale,
    softcap, d, dmask,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [start, end)."""
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < seqlen_k
        kt = _load(
            k_base + cols[None, :] * stride_ks + d[:, None], col_ok[None, :], dmask[:, None], MASKED, not EVEN_D
        )  # (D, N)
        s, _ = _scores(dot(q, kt, IEEE), scale, softcap, SOFTCAP)
        if MASKED:
            s = tl.where(_visible(rows[:, None], cols[None, :], seqlen_k, shift, left, right), s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load(
            v_base + cols[:, None] * stride_vs + d[None, :], col_ok[:, None], dmask[None, :], MASKED, not EVEN_D
        )  # (N, D)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_band(m0, seqlen_k, shift, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of query rows [m0, m0 + BLOCK_M): [lo, hi) holds every visible key, [full_lo, full_hi) the
    BLOCK_N-aligned blocks that every row sees entirely (no mask needed)."""
    lo = tl.maximum(m0 + shift - left, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M - 1 + shift + right + 1, seqlen_k)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(m0 + BLOCK_M - 1 + shift - left, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(m0 + shift + right + 1, seqlen_k) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def flash_fwd_kernel(
    Q, K, V, CU_Q, CU_K, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale, softcap, left, right,
    OUT, LSE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr, UNIT: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(Sq, BLOCK_M), B * Hq). OUT (B, Sq, Hq, D) compact, LSE (B, Hq, Sq) fp32 in base 2. VARLEN: packed
    sequences (see the module doc), grid (cdiv(max Sq, BLOCK_M), B * Hq)."""
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)  # torch.compile passes floats as fp64
    head_dim, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = (
        _aligned(head_dim, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                 stride_vh, UNIT)
    )  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads_q, bh % heads_q
    hk = h // (heads_q // heads_k)
    q0, sq = _sequence(b, seqlen_q, CU_Q, VARLEN)
    k0, seqlen_k = _sequence(b, seqlen_k, CU_K, VARLEN)
    lse_row = _lse_row(b, h, heads_q, seqlen_q, q0, VARLEN)
    seqlen_q = sq
    m0 = pid_m * BLOCK_M
    if VARLEN:
        if m0 >= seqlen_q:  # past this sequence's queries
            return
    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    row_mask = rows < seqlen_q
    q = _load(
        Q + (q0 * stride_qs if VARLEN else b * stride_qb) + h * stride_qh + rows[:, None] * stride_qs + d[None, :],
        row_mask[:, None],
        dmask[None, :],
        True,
        not EVEN_D,
    )
    k_base = K + (k0 * stride_ks if VARLEN else b * stride_kb) + hk * stride_kh
    v_base = V + (k0 * stride_vs if VARLEN else b * stride_vb) + hk * stride_vh
    shift = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = _query_band(m0, seqlen_k, shift, left, right, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    acc, l_i, m_i = _fwd_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        rows,
        lo,
        full_lo,
        seqlen_k,
        shift,
        left,
        right,
        scale,
        softcap,
        d,
        dmask,
        BLOCK_N,
        True,
        SOFTCAP,
        EVEN_D,
        IEEE,
    )
    acc, l_i, m_i = _fwd_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        rows,
        full_lo,
        full_hi,
        seqlen_k,
        shift,
        left,
        right,
        scale,
        softcap,
        d,
        dmask,
        BLOCK_N,
        False,
        SOFTCAP,
        EVEN_D,
        IEEE,
    )
    acc, l_i, m_i = _fwd_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        rows,
        full_hi,
        hi,
        seqlen_k,
        shift,
        left,
        right,
        scale,
        softcap,
        d,
        dmask,
        BLOCK_N,
        True,
        SOFTCAP,
        EVEN_D,
        IEEE,
    )
    empty = l_i == 0.0  # no visible key: output 0, lse +inf (the backward then gives 0 too)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptr = OUT + ((q0 + rows[:, None]) * heads_q + h) * head_dim + d[None, :]
    _store(o_ptr, out.to(OUT.dtype.element_ty), row_mask[:, None], dmask[None, :], not EVEN_D)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + lse_row + rows, lse, mask=row_mask)


@triton.jit
def flash_bwd_preprocess_kernel(
    OUT, DOUT, CU_Q, seqlen_q, heads_q, head_dim,
    DELTA,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(Sq, BLOCK_M), B * Hq): DELTA[b, h, i] = sum_d OUT * DOUT (both compact (B, Sq, Hq, D); DELTA laid
    out as lse)."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads_q, bh % heads_q
    q0, sq = _sequence(b, seqlen_q, CU_Q, VARLEN)
    delta = DELTA + _lse_row(b, h, heads_q, seqlen_q, q0, VARLEN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < sq) & (d[None, :] < head_dim)
    offs = ((q0 + rows[:, None]) * heads_q + h) * head_dim + d[None, :]
    o = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta + rows, tl.sum(o * do, axis=1), mask=rows < sq)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, head_stride, cols, start, end, seqlen_q,
    seqlen_k, shift, left, right, scale, softcap, d, dmask,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dK, dV (BLOCK_N, D) of one key block from query blocks [start, end) of one query head, on transposed scores
    (N, M) = K Q^T: P^T and dS^T are the left operands of their products straight from registers, and Q^T is loaded
    transposed, so no product transposes a register tile. Rows past Sq read lse = +inf, so their P is 0."""
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < seqlen_q
        qt = _load(
            q_base + rows[None, :] * stride_qs + d[:, None], row_mask[None, :], dmask[:, None], MASKED, not EVEN_D
        )  # (D, M)
        do = _load(
            do_base + rows[:, None] * head_stride + d[None, :], row_mask[:, None], dmask[None, :], MASKED, not EVEN_D
        )
        if MASKED:
            lse = tl.load(lse_base + rows, mask=row_mask, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=row_mask, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        st, t = _scores(dot(k, qt, IEEE), scale, softcap, SOFTCAP)  # (N, M)
        pt = tl.exp2(st - lse[None, :])
        if MASKED:
            pt = tl.where(_visible(rows[None, :], cols[:, None], seqlen_k, shift, left, right), pt, 0.0)
        dv += dot(pt.to(do.dtype), do, IEEE)
        dpt = dot(v, tl.trans(do), IEEE)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - t * t)
        dk += dot(dst.to(qt.dtype), tl.trans(qt), IEEE)
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DOUT, LSE, DELTA, CU_Q, CU_K, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale, softcap, left, right, chunk,
    DK, DV,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr, UNIT: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Grid (chunk * cdiv(Sk, BLOCK_N), B * Hk / chunk): program (i, c) takes key block i // chunk of group
    c * chunk + i % chunk (key_chunk). DK, DV (B, Sk, Hk, D) compact."""
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)  # torch.compile passes floats as fp64
    head_dim, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = (
        _aligned(head_dim, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                 stride_vh, UNIT)
    )  # fmt: skip
    bh = (tl.program_id(1) * chunk + tl.program_id(0) % chunk).to(tl.int64)
    b, hk = bh // heads_k, bh % heads_k
    group = heads_q // heads_k
    q0, sq = _sequence(b, seqlen_q, CU_Q, VARLEN)
    k0, seqlen_k = _sequence(b, seqlen_k, CU_K, VARLEN)
    lse_row = _lse_row(b, hk * group, heads_q, seqlen_q, q0, VARLEN)  # of the group's first query head
    lse_head = seqlen_q  # lse's head stride (Sq, or total_q when packed)
    seqlen_q = sq
    n0 = tl.program_id(0) // chunk * BLOCK_N  # the first key blocks (the longest causal bands) first
    if VARLEN:
        if n0 >= seqlen_k:  # past this sequence's keys
            return
    cols = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    col_ok = cols < seqlen_k
    k = _load(
        K + (k0 * stride_ks if VARLEN else b * stride_kb) + hk * stride_kh + cols[:, None] * stride_ks + d[None, :],
        col_ok[:, None],
        dmask[None, :],
        True,
        not EVEN_D,
    )
    v = _load(
        V + (k0 * stride_vs if VARLEN else b * stride_vb) + hk * stride_vh + cols[:, None] * stride_vs + d[None, :],
        col_ok[:, None],
        dmask[None, :],
        True,
        not EVEN_D,
    )
    shift = seqlen_k - seqlen_q
    # query rows that see some key of [n0, n0 + BLOCK_N): i in [j - shift - right, j - shift + left]
    lo = tl.maximum(n0 - shift - right, 0) // BLOCK_M * BLOCK_M
    hi = tl.maximum(tl.minimum(n0 + BLOCK_N - 1 - shift + left + 1, seqlen_q), lo)
    # rows that see every key of the block (and the block lies inside Sk): no mask
    full_lo = tl.minimum(tl.maximum(tl.cdiv(n0 + BLOCK_N - 1 - shift - right, BLOCK_M) * BLOCK_M, lo), hi)
    full_hi = tl.minimum(n0 - shift + left + 1, seqlen_q) // BLOCK_M * BLOCK_M
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    full_hi = tl.where(n0 + BLOCK_N > seqlen_k, full_lo, full_hi)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    head_stride = heads_q * head_dim  # row stride of the compact DOUT
    for g in range(0, group):
        h = hk * group + g
        q_base = Q + (q0 * stride_qs if VARLEN else b * stride_qb) + h * stride_qh
        do_base = DOUT + q0 * head_stride + h * head_dim
        lse_base = LSE + lse_row + g * lse_head
        delta_base = DELTA + lse_row + g * lse_head
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, head_stride, cols, lo,
                              full_lo, seqlen_q, seqlen_k, shift, left, right, scale, softcap, d, dmask, BLOCK_M,
                              True, SOFTCAP, EVEN_D, IEEE)  # fmt: skip
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, head_stride, cols,
                              full_lo, full_hi, seqlen_q, seqlen_k, shift, left, right, scale, softcap, d, dmask,
                              BLOCK_M, False, SOFTCAP, EVEN_D, IEEE)  # fmt: skip
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, head_stride, cols,
                              full_hi, hi, seqlen_q, seqlen_k, shift, left, right, scale, softcap, d, dmask, BLOCK_M,
                              True, SOFTCAP, EVEN_D, IEEE)  # fmt: skip
    offs = ((k0 + cols[:, None]) * heads_k + hk) * head_dim + d[None, :]
    _store(DK + offs, (dk * scale).to(DK.dtype.element_ty), col_ok[:, None], dmask[None, :], not EVEN_D)
    _store(DV + offs, dv.to(DV.dtype.element_ty), col_ok[:, None], dmask[None, :], not EVEN_D)


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, rows, start, end, seqlen_k, shift, left, right,
    scale, softcap, d, dmask,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < seqlen_k
        kt = _load(
            k_base + cols[None, :] * stride_ks + d[:, None], col_ok[None, :], dmask[:, None], MASKED, not EVEN_D
        )  # (D, N)
        vt = _load(v_base + cols[None, :] * stride_vs + d[:, None], col_ok[None, :], dmask[:, None], MASKED, not EVEN_D)
        s, t = _scores(dot(q, kt, IEEE), scale, softcap, SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows[:, None], cols[None, :], seqlen_k, shift, left, right), p, 0.0)
        dp = dot(do, vt, IEEE)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
    return dq


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DOUT, LSE, DELTA, CU_Q, CU_K, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale, softcap, left, right,
    DQ,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr, UNIT: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(Sq, BLOCK_M), B * Hq). DQ (B, Sq, Hq, D) compact."""
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)  # torch.compile passes floats as fp64
    head_dim, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = (
        _aligned(head_dim, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                 stride_vh, UNIT)
    )  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads_q, bh % heads_q
    hk = h // (heads_q // heads_k)
    q0, sq = _sequence(b, seqlen_q, CU_Q, VARLEN)
    k0, seqlen_k = _sequence(b, seqlen_k, CU_K, VARLEN)
    lse_row = _lse_row(b, h, heads_q, seqlen_q, q0, VARLEN)
    seqlen_q = sq
    m0 = pid_m * BLOCK_M
    if VARLEN:
        if m0 >= seqlen_q:  # past this sequence's queries
            return
    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    row_mask = rows < seqlen_q
    q = _load(
        Q + (q0 * stride_qs if VARLEN else b * stride_qb) + h * stride_qh + rows[:, None] * stride_qs + d[None, :],
        row_mask[:, None],
        dmask[None, :],
        True,
        not EVEN_D,
    )
    offs = ((q0 + rows[:, None]) * heads_q + h) * head_dim + d[None, :]
    do = _load(DOUT + offs, row_mask[:, None], dmask[None, :], True, not EVEN_D)
    lse = tl.load(LSE + lse_row + rows, mask=row_mask, other=float("inf"))
    delta = tl.load(DELTA + lse_row + rows, mask=row_mask, other=0.0)
    k_base = K + (k0 * stride_ks if VARLEN else b * stride_kb) + hk * stride_kh
    v_base = V + (k0 * stride_vs if VARLEN else b * stride_vb) + hk * stride_vh
    shift = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = _query_band(m0, seqlen_k, shift, left, right, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_blocks(
        dq,
        q,
        do,
        lse,
        delta,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        rows,
        lo,
        full_lo,
        seqlen_k,
        shift,
        left,
        right,
        scale,
        softcap,
        d,
        dmask,
        BLOCK_N,
        True,
        SOFTCAP,
        EVEN_D,
        IEEE,
    )
    dq = _dq_blocks(
        dq,
        q,
        do,
        lse,
        delta,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        rows,
        full_lo,
        full_hi,
        seqlen_k,
        shift,
        left,
        right,
        scale,
        softcap,
        d,
        dmask,
        BLOCK_N,
        False,
        SOFTCAP,
        EVEN_D,
        IEEE,
    )
    dq = _dq_blocks(
        dq,
        q,
        do,
        lse,
        delta,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        rows,
        full_hi,
        hi,
        seqlen_k,
        shift,
        left,
        right,
        scale,
        softcap,
        d,
        dmask,
        BLOCK_N,
        True,
        SOFTCAP,
        EVEN_D,
        IEEE,
    )
    _store(DQ + offs, (dq * scale).to(DQ.dtype.element_ty), row_mask[:, None], dmask[None, :], not EVEN_D)


# ---------------------------------------------------------------------------------------------------------------------
# configurations, validation and plans

# Block configurations per head-dim bucket: forward (BLOCK_M, BLOCK_N, num_warps, num_stages); backward a pair of
# those for the dK/dV kernel (BLOCK_N keys per program, BLOCK_M queries per step) and the dQ kernel (BLOCK_M queries
# per program, BLOCK_N keys per step). The first of each list is the default; the warp-32 defaults of head dims 64
# and 128 are the fastest of benchmarks/sweep_flash_attention.py on an H200. Wavefront-64 (AMD) targets have 64 KiB
# of LDS: smaller tiles, one software-pipelining stage.
_FWD = {
    32: {64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)],
         128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
         256: [(64, 64, 8, 2), (128, 32, 8, 2)]},
    64: {64: [(128, 64, 4, 1), (64, 64, 4, 1)], 128: [(128, 64, 8, 1), (64, 32, 4, 1)], 256: [(64, 32, 4, 1)]},
}  # fmt: skip
_BWD = {
    32: {64: [((32, 128, 4, 3), (64, 64, 4, 3)), ((32, 128, 4, 3), (128, 32, 4, 3)),
              ((64, 64, 4, 2), (64, 64, 4, 2))],
         128: [((32, 64, 4, 3), (128, 64, 8, 3)), ((32, 128, 8, 2), (128, 32, 8, 2)), ((64, 64, 4, 2), (64, 64, 4, 2))],
         256: [((32, 64, 8, 1), (64, 32, 8, 1))]},
    64: {64: [((32, 64, 4, 1), (64, 32, 4, 1))], 128: [((32, 64, 4, 1), (64, 32, 4, 1))],
         256: [((16, 32, 4, 1), (32, 16, 4, 1))]},
}  # fmt: skip


def _bucket(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


# float32 tiles take twice the bytes (and IEEE dots, no tensor-core speed to feed): one small configuration per
# bucket, within sm_80's 163 KiB of shared memory; one pipelining stage on wavefront-64 targets.
_FP32 = {
    "fwd": {64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)},
    "bwd": {64: ((32, 64, 4, 1), (64, 32, 4, 1)), 128: ((32, 64, 4, 1), (64, 32, 4, 1)),
            256: ((16, 32, 4, 1), (32, 16, 4, 1))},
}  # fmt: skip


def configs(direction: str, head_dim: int, dtype: str, target: Target) -> list:
    """The block configurations of the 'fwd' or 'bwd' kernels for this head dim and dtype; the first is the
    default."""
    wave64 = target.warp_size == 64
    if dtype == "float32":
        config = _FP32[direction][_bucket(head_dim)]
        if wave64:
            config = config[:3] + (1,) if direction == "fwd" else tuple(c[:3] + (1,) for c in config)
        return [config]
    return {"fwd": _FWD, "bwd": _BWD}[direction][64 if wave64 else 32][_bucket(head_dim)]


def _window(causal: bool, window, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(left, right) as kernel integers: unbounded = Sq + Sk (covers every key), causal sets right = 0."""
    unbounded = seqlen_q + seqlen_k
    left, right = window
    left = unbounded if left < 0 else min(left, unbounded)
    right = 0 if causal else unbounded if right < 0 else min(right, unbounded)
    return left, right


# The dK / dV kernels' program order (both backends). The GPU starts programs in grid order; with each (key/value head,
# batch entry) group's key blocks in turn, the last groups' long causal bands start last and leave SMs idle
# (Llama-3.2-1B's causal backward, 16 key blocks x 32 groups on 132 SMs: a makespan of 86 block units where the load
# averages 66). For causal attention on grids of at most LPT_MAX_PROGRAMS programs the groups come in chunks that
# stream at most L2_CHUNK_BYTES, and a chunk runs the first key block (the longest band) of each of its groups, then
# the second, ... (longest-processing-time first: 68 units there). Grids: TileLang (chunk, key blocks, groups / chunk),
# Triton (chunk * key blocks, groups / chunk). Measured (H100, bf16, forward + backward, 2026-12-06,
# benchmarks/results/h100/2026-12-06b/flash_bwd_order.jsonl): B 4 S 2048 32 / 8 heads of 64 (512 programs) 1.00 ->
# 0.88 ms on either backend; B 2 S 4096 32 / 8 x 128 (512) TileLang 2.58 -> 2.40, Triton 3.01 -> 2.86; B 4 S 8192
# 32 / 8 x 64 (2048) -3%; B 4 S 8192 32 x 128 (8192 programs) no gain, and non-causal grids lose 3-5% (the group's
# tiles no longer share q and dO in L2): those keep chunk 1, the grid order as before. Design limits: groups / chunk up
# to 65535 (program_chunk), and TileLang's key blocks too (its grid dim y). The forward keeps each group's query blocks
# in turn (the last, longest first): the longest-first order measured no faster there (H200).
L2_CHUNK_BYTES = 64 * 2**20
LPT_MAX_PROGRAMS = 4096
MAX_GRID_YZ = 65535


def program_chunk(groups: int, group_bytes: int) -> int:
    """The groups a chunk of the grid holds: the largest divisor of `groups` whose groups stream at most
    L2_CHUNK_BYTES together (at least 1), or the smallest that keeps groups / chunk a grid dimension. A grid's
    shape: symbolic sizes (torch.compile's dynamic shapes) are specialized to their values."""
    groups = int(groups)
    divisors = sorted({d for i in range(1, math.isqrt(groups) + 1) if groups % i == 0 for d in (i, groups // i)})
    fits = [c for c in divisors if c * group_bytes <= L2_CHUNK_BYTES] or [1]
    return max(fits[-1], next(c for c in divisors if groups // c <= MAX_GRID_YZ))


def key_chunk(
    batch: int, seqlen_q: int, heads_q: int, heads_k: int, head_dim: int, key_blocks: int, causal: bool,
    accumulator: bool = False,
) -> int:  # fmt: skip
    """The chunk of the dK / dV kernels' grid over `key_blocks` x (key/value head, batch entry) groups: program_chunk
    of groups streaming q and dO (2 bytes each) of their Hq / Hk query heads and, with `accumulator`, their fp32 dQ
    accumulator (TileLang's); 1 (each group's key blocks in turn) unless causal on a grid of at most
    LPT_MAX_PROGRAMS."""
    groups = heads_k * batch
    if not causal or key_blocks * groups > LPT_MAX_PROGRAMS:
        return program_chunk(groups, L2_CHUNK_BYTES + 1)  # 1, or what the grid dimension needs
    return program_chunk(groups, (8 if accumulator else 4) * head_dim * seqlen_q * (heads_q // heads_k))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def check(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0) -> None:
    dtype = checks.check_float(NAME, "q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_array(NAME, name, t)
        if len(t.shape) != 4:
            raise ValueError(f"{NAME}: {name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    checks.check_same_dtype(NAME, "k", k, dtype, "that of q")
    checks.check_same_dtype(NAME, "v", v, dtype, "that of q")
    batch, _, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    checks.check_shape(NAME, "k", k, (batch, seqlen_k, heads_k, head_dim), "q's batch and head_dim")
    checks.check_shape(NAME, "v", v, tuple(k.shape), "that of k")
    check_heads_and_options(NAME, heads_q, heads_k, head_dim, causal, window, softmax_scale, softcap)


def check_heads_and_options(op, heads_q, heads_k, head_dim, causal, window, softmax_scale, softcap) -> None:
    """The head counts and dim of q and k, and the attention options, of `op` (flash_attention or its varlen form)."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    if heads_k == 0 and heads_q != 0 or heads_k and heads_q % heads_k:
        raise ValueError(f"{op}: q's heads must be a multiple of k's heads (GQA/MQA), got {heads_q} and {heads_k}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{op}: causal must be a bool, got {causal!r}")
    pair = isinstance(window, (tuple, list)) and len(window) == 2
    if not pair or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= -1 for w in window):
        raise ValueError(f"{op}: window must be a pair of ints >= -1 (left, right; -1 = unbounded), got {window!r}")
    if softmax_scale is not None:
        checks.check_real(op, "softmax_scale", softmax_scale, "None or a finite number")
    if checks.check_real(op, "softcap", softcap, "a finite number >= 0") < 0:
        raise ValueError(f"{op}: softcap must be a finite number >= 0, got {softcap!r}")


def _strides(strides, seqlen: int, heads: int, head_dim: int, packed) -> tuple[int, int, int]:
    """(batch, seq, head) element strides; None = compact (B, S, H, D), or (total, H, D) when packed (batch stride
    0, unused)."""
    if strides is not None:
        return tuple(strides)
    return (0 if packed else seqlen * heads * head_dim), heads * head_dim, head_dim


def _shared(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal, window, scale, softcap,
            strides_q, strides_k, strides_v, packed) -> tuple[list, dict]:  # fmt: skip
    """The runtime arguments every kernel of both directions takes, and their common constexprs. Packed sequences
    pass their totals as seqlen_q / seqlen_k (lse's head stride; each sequence's lengths come from cu_seqlens)."""
    if packed:
        seqlen_q, seqlen_k = packed
    left, right = _window(causal, window, seqlen_q, seqlen_k)
    scale = default_scale(head_dim) if scale is None else float(scale)
    args = [seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
            *_strides(strides_q, seqlen_q, heads_q, head_dim, packed), *_strides(strides_k, seqlen_k, heads_k,
            head_dim, packed), *_strides(strides_v, seqlen_k, heads_k, head_dim, packed), scale,
            float(softcap) or 1.0, left, right]  # fmt: skip
    block_d = max(32, next_power_of_2(head_dim))
    ieee = ieee_dots(dtype)
    constexprs = dict(BLOCK_D=block_d, EVEN_D=block_d == head_dim, SOFTCAP=softcap > 0, IEEE=ieee,
                      VARLEN=bool(packed))  # fmt: skip
    return args, constexprs


def _shapes(batch: int, seqlen: int, heads: int, head_dim: int, total: int | None) -> tuple[tuple, tuple]:
    """(shape of q / out (or k), of lse / delta): (B, S, H, D) and (B, H, S); packed (total, H, D) and (H, total)."""
    if total is None:
        return (batch, seqlen, heads, head_dim), (batch, heads, seqlen)
    return (total, heads, head_dim), (heads, total)


def _forward_buffers(batch, seqlen_q, heads_q, head_dim, dtype, total_q=None) -> tuple[bool, dict]:
    """(whether the output is empty, the forward's out and lse buffers): zeroed when empty (no launch writes them)."""
    out, lse = _shapes(batch, seqlen_q, heads_q, head_dim, total_q)
    empty = math.prod(out) == 0
    return empty, {"out": BufferSpec(out, dtype, zeroed=empty), "lse": BufferSpec(lse, "float32", zeroed=empty)}


def forward(
    batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int, *, dtype: str,
    causal: bool, window: tuple[int, int], scale: float | None, softcap: float, target: Target,
    strides_q=None, strides_k=None, strides_v=None, config: int = 0, packed: tuple[int, int] | None = None,
) -> Plan:  # fmt: skip
    """Inputs q, k, v ((B, S, H, D) with unit head-dim stride, the other strides given; None = compact).
    Outputs out (B, Sq, Hq, D) compact and lse (B, Hq, Sq) fp32 (base 2; +inf for rows that see no key).
    packed = (total_q, total_k): B packed sequences (flash_attention_varlen), seqlen_q / seqlen_k their maxima; q
    (total_q, Hq, D), k / v (total_k, Hk, D) (batch strides ignored), int32 inputs cu_seqlens_q / cu_seqlens_k
    (B + 1,); out (total_q, Hq, D), lse (Hq, total_q)."""
    empty, buffers = _forward_buffers(batch, seqlen_q, heads_q, head_dim, dtype, packed and packed[0])
    launches = ()
    if not empty:
        args, constexprs = _shared(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal, window,
                                   scale, softcap, strides_q, strides_k, strides_v, packed)  # fmt: skip
        block_m, block_n, warps, stages = configs("fwd", head_dim, dtype, target)[config]
        launches = (
            in_units(Launch(flash_fwd_kernel, (cdiv(seqlen_q, block_m), batch * heads_q),
                            ("q", "k", "v", *_cu(packed), *args), ("out", "lse"),
                            dict(BLOCK_M=block_m, BLOCK_N=block_n, **constexprs), warps, stages), *UNIT_ARGS),
        )  # fmt: skip
    return Plan({"q": dtype, "k": dtype, "v": dtype, **_cu_inputs(packed)}, buffers, launches, ("out", "lse"))


def _cu(packed) -> tuple:
    """The kernels' CU_Q, CU_K pointers: the cu_seqlens inputs when packed, absent otherwise."""
    return ("cu_seqlens_q", "cu_seqlens_k") if packed else (None, None)


def _cu_inputs(packed) -> dict:
    return {"cu_seqlens_q": "int32", "cu_seqlens_k": "int32"} if packed else {}


def check_backend(backend: str, dtype: str, head_dim: int) -> None:
    """Raises ValueError naming the input a resolved backend cannot run (the TileLang forward: float32). The TileLang
    module is imported directly (it imports TileLang itself only to build): torch.compile traces this check, and
    Dynamo cannot trace an import."""
    why = flash_attention_tilelang.unsupported(dtype, head_dim) if backend == "tilelang" else None
    if why:
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")


def preferred_backend(arch: int, dtype: str, head_dim: int, backward: bool = False) -> str:
    """backend=None's choice for inputs of `dtype` and `head_dim` on compute capability `arch` (0: not a CUDA device):
    for the forward, or (`backward`) for the backward that follows it, as the torch adapter runs them (each pass on
    its own choice: every forward writes out and lse alike; JAX cannot tell at the call and takes the forward's).
    "tilelang" on sm_90 for float16 / bfloat16 at head dim 128, where its forward and backward both beat Triton's
    (H200, 2026-12-03, bf16 4 x 8192 x 32 heads, TFLOP/s: forward + backward 458 against 396, causal 422 against 374);
    at head dim 64 the backward (its forward is slower: H100, 2026-12-05, causal bf16, 4 x 2048, 32 / 8 heads, 0.244
    against 0.219 ms; TileLang's forward + backward 0.990 against Triton's 1.016, Triton's forward + TileLang's
    backward 0.974; benchmarks/results/h200/notes.md); "triton" elsewhere (other head dims and architectures are not
    measured). resolve falls back to "triton" where TileLang cannot build."""
    if arch != 90 or dtype not in flash_attention_tilelang.DTYPES:
        return "triton"
    return "tilelang" if head_dim == 128 or head_dim == 64 and backward else "triton"


def options(q, causal, window, softmax_scale, softcap, backend: str) -> tuple[bool, tuple[int, int], float, float]:
    """The public call's options as the ops take them, (causal, (left, right), scale, softcap), once `check` has passed
    and the backend is resolved; raises what that backend cannot run (check_backend)."""
    check_backend(backend, dtype_name(q.dtype), q.shape[-1])
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return bool(causal), (int(window[0]), int(window[1])), scale, float(softcap)


def compiled_forward(
    backend: str, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int, *,
    dtype: str, causal: bool, window: tuple[int, int], scale: float | None, softcap: float, arch: int,
    config: int = 0,
) -> Plan:  # fmt: skip
    """The forward of the TileLang backend for compute capability `arch` (e.g. 90): inputs q, k, v compact
    (B, S, H, D); outputs out and lse exactly as `forward` (the Triton backward reads them). `config`: an index into
    the module's CONFIGS (0 = the default)."""
    check_backend(backend, dtype, head_dim)
    module = backends.module(NAME, backend)
    empty, buffers = _forward_buffers(batch, seqlen_q, heads_q, head_dim, dtype)
    calls = ()
    if not empty:
        left, right = _window(causal, window, seqlen_q, seqlen_k)
        scale = default_scale(head_dim) if scale is None else float(scale)
        kernel = module.kernel_name(head_dim, softcap > 0, "fwd", config)
        reads, attrs = ("q", "k", "v"), dict(scale=scale, softcap=float(softcap) or 1.0, left=left, right=right)
        if seqlen_k == 0:  # no key at all: out 0, lse +inf (a tensor map cannot describe an empty k)
            kernel, reads, attrs = module.NO_KEYS_KERNEL, (), {}
        load = functools.partial(module.function, kernel, dtype, dtype, arch)
        calls = (Call(f"tile_kernels_{backend}_{kernel}_{dtype}_sm{arch}", load, reads, ("out", "lse"), attrs),)
    return Plan({"q": dtype, "k": dtype, "v": dtype}, buffers, calls, ("out", "lse"))


def compiled_backward_unsupported(backend: str, dtype: str, head_dim: int, arch: int = 90) -> str | None:
    """Why autograd does not run `backend`'s backward for these inputs on compute capability `arch` (its forward
    runs: the Triton backward then runs, reading the same (out, lse)), or None. Triton's own backward: always None.
    (The TileLang module is imported directly, as in check_backend: torch.compile may trace this.)"""
    if backend != "tilelang":
        return None
    return flash_attention_tilelang.backward_unsupported(dtype, head_dim, arch)


def compiled_backward(
    backend: str, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int, *,
    dtype: str, causal: bool, window: tuple[int, int], scale: float | None, softcap: float, arch: int,
    config: int = 0,
) -> Plan:  # fmt: skip
    """The backward of the TileLang backend for compute capability `arch`: the inputs and outputs of `backward` (q, k,
    v, out, dout compact (B, S, H, D), lse (B, Hq, Sq) base 2; dq, dk, dv compact). Three calls: delta (and lse with
    padded rows), the dK / dV kernel (dQ summed into an fp32 accumulator, zeroed here and updated in place), dQ from
    the accumulator. `config`: an index into the module's BWD_CONFIGS (0 = the default). Raises ValueError for
    inputs only the Triton backward runs (compiled_backward_unsupported)."""
    why = flash_attention_tilelang.backward_unsupported(dtype, head_dim, arch) if backend == "tilelang" else None
    if why:
        raise ValueError(f"{NAME}: backend {backend!r} {why}; its forward runs with the Triton backward")
    module = backends.module(NAME, backend)
    d_pad = module.bucket(head_dim)
    block_m, block_n = module.BWD_CONFIGS[module.family(arch)][d_pad][config][:2]
    q_shape, _ = _shapes(batch, seqlen_q, heads_q, head_dim, None)
    k_shape, _ = _shapes(batch, seqlen_k, heads_k, head_dim, None)
    run = math.prod(q_shape) > 0 and math.prod(k_shape) > 0
    rows = cdiv(seqlen_q, block_m) * block_m  # whole query blocks: each block's dQ tile is added whole
    buffers = {
        "delta": BufferSpec((batch, heads_q, rows), "float32", zeroed=not run),
        "lse_pad": BufferSpec((batch, heads_q, rows), "float32", zeroed=not run),
        "dq_acc": BufferSpec((batch, heads_q, rows, d_pad), "float32", zeroed=True),
        "dq": BufferSpec(q_shape, dtype, zeroed=not run),
        "dk": BufferSpec(k_shape, dtype, zeroed=not run),
        "dv": BufferSpec(k_shape, dtype, zeroed=not run),
    }
    calls = ()
    if run:
        left, right = _window(causal, window, seqlen_q, seqlen_k)
        scale = default_scale(head_dim) if scale is None else float(scale)

        def call(kernel, reads, writes, **attrs):
            load = functools.partial(module.function, kernel, dtype, dtype, arch)
            return Call(f"tile_kernels_{backend}_{kernel}_{dtype}_sm{arch}", load, reads, writes, attrs)

        main = module.kernel_name(head_dim, softcap > 0, "bwd", config)
        calls = (
            call(module.kernel_name(head_dim, False, "bwd_pre"), ("out", "dout", "lse"), ("delta", "lse_pad")),
            call(main, ("q", "k", "v", "dout", "lse_pad", "delta", "dq_acc"), ("dk", "dv", "dq_acc"), scale=scale,
                 softcap=float(softcap) or 1.0, left=left, right=right,
                 chunk=key_chunk(batch, seqlen_q, heads_q, heads_k, d_pad, cdiv(seqlen_k, block_n), causal, True)),
            call(module.kernel_name(head_dim, False, "bwd_post"), ("dq_acc",), ("dq",), scale=scale),
        )  # fmt: skip
    inputs = {"q": dtype, "k": dtype, "v": dtype, "out": dtype, "dout": dtype, "lse": "float32"}
    return Plan(inputs, buffers, calls, ("dq", "dk", "dv"))


def backward(
    batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int, *, dtype: str,
    causal: bool, window: tuple[int, int], scale: float | None, softcap: float, target: Target,
    strides_q=None, strides_k=None, strides_v=None, config: int = 0, packed: tuple[int, int] | None = None,
) -> Plan:  # fmt: skip
    """Inputs q, k, v (as the forward), out, dout (compact (B, Sq, Hq, D)), lse (B, Hq, Sq).
    Outputs dq (B, Sq, Hq, D), dk, dv (B, Sk, Hk, D), compact. packed: as the forward's (out, dout, dq packed as q,
    dk / dv as k, lse and delta (Hq, total_q))."""
    q_shape, lse_shape = _shapes(batch, seqlen_q, heads_q, head_dim, packed and packed[0])
    k_shape, _ = _shapes(batch, seqlen_k, heads_k, head_dim, packed and packed[1])
    empty_q, empty_k = math.prod(q_shape) == 0, math.prod(k_shape) == 0
    buffers = {
        "delta": BufferSpec(lse_shape, "float32", zeroed=empty_q),
        "dq": BufferSpec(q_shape, dtype, zeroed=empty_q),
        "dk": BufferSpec(k_shape, dtype, zeroed=empty_k),
        "dv": BufferSpec(k_shape, dtype, zeroed=empty_k),
    }
    launches = []
    args, constexprs = _shared(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal, window, scale,
                               softcap, strides_q, strides_k, strides_v, packed)  # fmt: skip
    reads = ("q", "k", "v", "dout", "lse", "delta", *_cu(packed), *args)
    if not empty_q:
        block = min(64, next_power_of_2(seqlen_q))
        launches.append(
            Launch(flash_bwd_preprocess_kernel, (cdiv(seqlen_q, block), batch * heads_q),
                   ("out", "dout", _cu(packed)[0], args[0], heads_q, head_dim), ("delta",),
                   dict(BLOCK_M=block, BLOCK_D=constexprs["BLOCK_D"], VARLEN=bool(packed)), num_warps=4)
        )  # fmt: skip
    dkdv, dq = configs("bwd", head_dim, dtype, target)[config]
    if not empty_k:
        block_m, block_n, warps, stages = dkdv
        chunk = key_chunk(batch, seqlen_q, heads_q, heads_k, head_dim, cdiv(seqlen_k, block_n), causal)
        grid = (chunk * cdiv(seqlen_k, block_n), batch * heads_k // chunk)
        launches.append(
            in_units(Launch(flash_bwd_dkdv_kernel, grid, (*reads, chunk), ("dk", "dv"),
                           dict(BLOCK_M=block_m, BLOCK_N=block_n, **constexprs), warps, stages), *UNIT_ARGS)
        )  # fmt: skip
    if not empty_q:
        block_m, block_n, warps, stages = dq
        launches.append(
            in_units(Launch(flash_bwd_dq_kernel, (cdiv(seqlen_q, block_m), batch * heads_q), reads, ("dq",),
                           dict(BLOCK_M=block_m, BLOCK_N=block_n, **constexprs), warps, stages), *UNIT_ARGS)
        )  # fmt: skip
    inputs = {"q": dtype, "k": dtype, "v": dtype, "out": dtype, "dout": dtype, "lse": "float32", **_cu_inputs(packed)}
    return Plan(inputs, buffers, tuple(launches), ("dq", "dk", "dv"))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def visible(seqlen_q: int, seqlen_k: int, causal=False, window=(-1, -1)) -> np.ndarray:
    """(Sq, Sk) bool: key j visible to query i (bottom-right aligned, flash-attn's convention)."""
    left, right = window
    right = 0 if causal else right
    i = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    j = np.arange(seqlen_k)[None, :]
    mask = np.ones((seqlen_q, seqlen_k), bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def _forward64(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
    """(out, P, tanh term, expanded k, expanded v, scale) in float64, heads of k / v repeated for GQA."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    group = q.shape[2] // max(k.shape[2], 1)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = None
    if softcap > 0:
        t = np.tanh(s / softcap)
        s = softcap * t
    mask = visible(q.shape[1], k.shape[1], causal, tuple(window))
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = p.sum(axis=-1, keepdims=True)
    p = p / np.where(total == 0, 1.0, total)  # rows that see no key: P = 0, output 0
    return np.einsum("bhqk,bkhd->bqhd", p, v), p, t, k, v, scale


def reference(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
    return (_forward64(q, k, v, causal, window, softmax_scale, softcap)[0],)


def reference_vjp(kwargs, cotangents):
    q, k_in = kwargs["q"], kwargs["k"]
    options = {n: kwargs[n] for n in ("causal", "window", "softmax_scale", "softcap") if n in kwargs}
    _, p, t, k, v, scale = _forward64(q, k_in, kwargs["v"], **options)
    do = cotangents[0].astype(np.float64)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q.astype(np.float64)) * scale
    heads_k = k_in.shape[2]

    def fold(g):  # sum the query heads of each key/value head's group
        return g.reshape(g.shape[0], g.shape[1], heads_k, q.shape[2] // max(heads_k, 1), g.shape[3]).sum(axis=3)

    return {"q": dq, "k": fold(dk), "v": fold(dv)}


def cost(kwargs) -> tuple[Cost, Cost]:
    """flops: 4 B Hq D per visible (query, key) pair forward (two GEMMs), 2.5x that backward (five GEMMs); bytes:
    q, k, v, out (+ lse) forward; those, dout and the three gradients backward."""
    q, k = kwargs["q"], kwargs["k"]
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    pairs = int(visible(seqlen_q, seqlen_k, kwargs.get("causal", False), tuple(kwargs.get("window", (-1, -1)))).sum())
    item = ITEMSIZE[str(q.dtype)]
    q_bytes, kv_bytes, rows = q.size * item, k.size * item, batch * heads_q * seqlen_q
    fwd = Cost(2 * q_bytes + 2 * kv_bytes + 4 * rows, 4 * batch * heads_q * head_dim * pairs)
    bwd = Cost(4 * q_bytes + 4 * kv_bytes + 12 * rows, 10 * batch * heads_q * head_dim * pairs)
    return fwd, bwd


LONG_SEQUENCE = 64  # a sequence length taken from the drawn shape as it is (benchmarks); shorter ones are drawn


def sample(rng: np.random.Generator, shape, dtype: str, causal=False, window=False, gqa=1, cross=False,
           softcap=False) -> dict:  # fmt: skip
    """q (B, Sq, Hk * gqa, D), k / v (B, Sk, Hk, D) from a drawn shape (..., n): B = shape[0] (at most 4; 1 without
    leading dims); Hk = shape[2] (as it is from 16 on, else at most 4; 2 if absent); D = n up to 64 (or 128 / 256),
    else 16, 32 or 64 (the interpreter stays fast); Sq = shape[1] if it is 0 or >= LONG_SEQUENCE (a benchmark's
    shape), else drawn in [1, 64]; Sk = Sq unless `cross` (then drawn in [1, 80]). A window draws (left, right) in
    [-1, 24] each."""
    lead, n = tuple(shape[:-1]), shape[-1]
    batch = min(lead[0], 4) if lead else 1
    seqlen = lead[1] if len(lead) > 1 and (lead[1] == 0 or lead[1] >= LONG_SEQUENCE) else int(rng.integers(1, 65))
    heads_k = lead[2] if len(lead) > 2 else 2
    heads_k = heads_k if heads_k >= 16 else min(heads_k, 4)
    head_dim = n if n <= 64 or n in (128, 256) else (16, 32, 64)[n % 3]
    seqlen_k = int(rng.integers(1, 81)) if cross and seqlen else seqlen
    left, right = (int(w) for w in rng.integers(-1, 25, 2)) if window else (-1, -1)

    def draw(s, h):
        return round_to(rng.standard_normal((batch, s, h, head_dim)), dtype)

    return {"q": draw(seqlen, heads_k * gqa), "k": draw(seqlen_k, heads_k), "v": draw(seqlen_k, heads_k),
            "causal": bool(causal), "window": (left, right), "softmax_scale": None,
            "softcap": 2.0 if softcap else 0.0}  # fmt: skip


def bad_inputs(kwargs) -> list[BadInput]:
    q, k, v = kwargs["q"], kwargs["k"], kwargs["v"]
    return [
        BadInput({"q": q[0]}, ValueError, "flash_attention: q must be 4-D"),
        BadInput({"q": q.astype(np.int32)}, TypeError, "flash_attention: q must have dtype"),
        BadInput({"k": k.astype(np.float16)}, TypeError, "flash_attention: k must have dtype"),
        BadInput({"v": v[:, :-1]}, ValueError, "flash_attention: v must have shape"),
        BadInput({"k": k[..., :-1], "v": v[..., :-1]}, ValueError, "flash_attention: k must have shape"),
        BadInput({"q": np.concatenate([q, q[:, :, :1]], axis=2)}, ValueError, "flash_attention: q's heads must be"),
        BadInput({"window": (-2, 0)}, ValueError, "flash_attention: window must be a pair"),
        BadInput({"softcap": -1.0}, ValueError, "flash_attention: softcap must be"),
        BadInput({"softmax_scale": "0.3"}, TypeError, "flash_attention: softmax_scale must be None or a finite"),
        BadInput({"softmax_scale": float("nan")}, ValueError, "flash_attention: softmax_scale must be None or a fin"),
        BadInput({"backend": "nope"}, ValueError, "flash_attention: backend must be one of"),
        *not_arrays(NAME, "q", "k", "v"),
    ]


def plans(target: Target):
    """Every configuration the plans can launch: each dtype, head-dim bucket (padded or not), softcap; the alternative
    block configurations (for an autotuner on the device) at the power-of-two head dims 64, 128 and 256."""
    for dtype in FLOAT_DTYPES:
        for head_dim in (16, 32, 40, 64, 96, 128, 192, 256):
            for softcap in (0.0, 1.0):
                for direction, build in (("fwd", forward), ("bwd", backward)):
                    count = len(configs(direction, head_dim, dtype, target)) if head_dim in (64, 128, 256) else 1
                    for config in range(count):
                        yield build(1, 128, 128, 2, 1, head_dim, dtype=dtype, causal=True, window=(-1, -1),
                                    scale=None, softcap=softcap, target=target, config=config)  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={
            "causal": (False, True),
            "window": (True, False),
            "gqa": (2, 3, 1),
            "cross": (True, False),
            "softcap": (True, False),
        },  # fmt: skip
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("q", "k", "v"),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
