"""MLA decode (DeepSeek-V2/V3 multi-head latent attention with absorbed weights), one new token a sequence:
mla_decode(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False).

q_nope (B, H, Dc) and q_pe (B, H, Dr) attend to the first L_b = cache_seqlens[b] positions of sequence b's latent
cache kv_c (Dc wide) and rope-key cache k_pe (Dr wide), one latent row shared by every head (MQA):
    s[h, p] = scale * (q_nope[b, h] . kv_c_b[p] + q_pe[b, h] . k_pe_b[p]),   out[b, h] = sum_p softmax_p(s[h]) kv_c_b[p]
    lse[b, h] = log sum_p exp(s[h, p]) (natural log; -inf for L_b = 0, whose output is 0)
scale = softmax_scale or 1 / sqrt(Dc + Dr) (FlashMLA's default). Caches contiguous (B, Smax, Dc) / (B, Smax, Dr), or
paged (num_blocks, page_size, Dc) / (num_blocks, page_size, Dr) with block_table (B, max_pages) int32, position p of
sequence b in page block_table[b, p // page_size], slot p % page_size (FlashMLA pages 64 positions; any size works).
The lengths are values, read on the device only, clamped to [0, capacity].

Kernels (flash-decoding as tile_kernels.core.decode_attention, whose combine kernel this reuses):
  * split: grid (B, cdiv(H, BLOCK_H), S). A program holds BLOCK_H heads of one sequence as the rows of a tile (>= 16
    for tensor cores) and takes split s of its positions. Each block of BLOCK_N latent rows is loaded once and
    serves both products: the scores (q_nope kv^T + q_pe k_pe^T) and the output (P kv). Online softmax in base 2,
    fp32 accumulation. Writes (B, H, S, Dc) / (B, H, S) partials, or with S = 1 the output and lse themselves.
  * combine (decode_attention's): weights 2^(lse_s - max), the output in q's dtype and the lse.
Dc up to 512 and Dr up to 64, each padded to a power of two >= 16 with masks. Design limit of this Triton path:
the (BLOCK_H, Dc) fp32 accumulator and a (BLOCK_N, Dc) tile live in registers (no warp specialization, no split of
Dc across warp groups), 64 heads a tile at Dc 512 on warp-32 GPUs; it is the portable path.
Backends (backends.py): "triton" (the kernels here) and "tilelang", a Hopper split kernel
(mla_decode_tilelang.py: Dc 512 / Dr 64, float16 / bfloat16, sm_90a, pages a multiple of its position block) run
by `compiled_forward` as a Plan of a TileLang Call and, with S > 1, this module's combine Launch; same out and lse."""

from __future__ import annotations

import functools
import math

import numpy as np
import triton
import triton.language as tl

from . import backends, checks, mla_decode_tilelang
from .backends import Call
from .decode_attention import (
    COMBINE_SPLITS,
    MAX_SPLITS,
    MIN_SPLIT_BLOCKS,
    UNITS,
    cache_rows,
    decode_combine_kernel,
    draw_lengths,
    finish,
    gather,
    online_softmax,
    pages_a_block,
    pdl_combine,
    split_range,
    splits_for,
)
from .flash_attention import dot
from .host import ieee_dots
from .plan import (
    FLOAT_DTYPES,
    ITEMSIZE,
    BufferSpec,
    Launch,
    Plan,
    Target,
    cdiv,
    dtype_name,
    in_units,
    next_power_of_2,
)
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "mla_decode"
# backend="tilelang" runs mla_decode_tilelang's split kernel (and the Triton combine); backend=None: preferred_backend.
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.mla_decode_tilelang"})
MAX_LATENT_DIM = 512
MAX_ROPE_DIM = 64
# the int arguments the split kernel builds addresses from, in units of 16 (or 8) elements where they all divide
# (plan.in_units, as decode_attention's): its rows then load 16 bytes at a time under jax-triton too
UNIT_ARGS = ("latent_dim", "rope_dim", "stride_qnb", "stride_qnh", "stride_qpb", "stride_qph", "stride_kvb",
             "stride_kvs", "stride_kpb", "stride_kps")  # fmt: skip


@triton.jit
def mla_split_kernel(
    Q_NOPE, Q_PE, KV, K_PE, SEQLENS, BLOCK_TABLE, heads, latent_dim, rope_dim, seqlen_k, page_size, stride_bt,
    stride_qnb, stride_qnh, stride_qpb, stride_qph, stride_kvb, stride_kvs, stride_kpb, stride_kps, scale,
    PARTIAL_O, PARTIAL_LSE, OUT, LSE,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, PAGED: tl.constexpr,
    IEEE: tl.constexpr, SPLIT: tl.constexpr, UNIT: tl.constexpr, PAGES_A_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, cdiv(H, BLOCK_H), S). stride_kvb / stride_kpb: of the batch (contiguous) or of a page (PAGED).
    SPLIT (S > 1): PARTIAL_O (B, H, S, Dc) and PARTIAL_LSE (B, H, S) fp32 (base-2 lse); else OUT (B, H, Dc) in q's
    dtype and LSE (B, H) fp32 (natural log). The absent pair is never stored to (decode_split_kernel says why).
    PDL: as decode_split_kernel's."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = tl.cast(scale, tl.float32) * 1.4426950408889634  # base 2; torch.compile passes floats as fp64
    latent_dim, rope_dim = latent_dim * UNIT, rope_dim * UNIT  # plan.in_units: UNIT_ARGS
    stride_qnb, stride_qnh = stride_qnb * UNIT, stride_qnh * UNIT
    stride_qpb, stride_qph = stride_qpb * UNIT, stride_qph * UNIT
    stride_kvb, stride_kvs = stride_kvb * UNIT, stride_kvs * UNIT
    stride_kpb, stride_kps = stride_kpb * UNIT, stride_kps * UNIT
    b = tl.program_id(0).to(tl.int64)
    split, splits = tl.program_id(2), tl.num_programs(2)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    h_ok = h < heads
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    c_ok, r_ok = c < latent_dim, r < rope_dim
    q_nope = tl.load(Q_NOPE + b * stride_qnb + h[:, None] * stride_qnh + c[None, :], mask=h_ok[:, None] & c_ok[None, :],
                     other=0.0)  # fmt: skip
    q_pe = tl.load(Q_PE + b * stride_qpb + h[:, None] * stride_qph + r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                   other=0.0)  # fmt: skip
    _, start, end = split_range(SEQLENS, b, seqlen_k, split, splits, BLOCK_N)
    kv_base, kp_base = KV, K_PE
    if not PAGED:
        kv_base += b * stride_kvb
        kp_base += b * stride_kpb
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        kv_rows = cache_rows(BLOCK_TABLE, b, stride_bt, n0, end, cols, page_size, stride_kvb, stride_kvs,
                             PAGED, PAGES_A_BLOCK)  # fmt: skip
        kp_rows = cache_rows(BLOCK_TABLE, b, stride_bt, n0, end, cols, page_size, stride_kpb, stride_kps,
                             PAGED, PAGES_A_BLOCK)  # fmt: skip
        kv = tl.load(kv_base + kv_rows[:, None] + c[None, :], mask=col_ok[:, None] & c_ok[None, :], other=0.0)
        kp = tl.load(kp_base + kp_rows[:, None] + r[None, :], mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        s = (dot(q_nope, tl.trans(kv), IEEE) + dot(q_pe, tl.trans(kp), IEEE)) * scale  # (H, N)
        p, alpha, m_i, l_i = online_softmax(tl.where(col_ok[None, :], s, -float("inf")), m_i, l_i)
        acc = acc * alpha[:, None] + dot(p.to(kv.dtype), kv, IEEE)  # the latent tile serves as the values too
    out, lse = finish(acc, m_i, l_i)
    row = b * heads + h
    mask = h_ok[:, None] & c_ok[None, :]
    if not SPLIT:
        tl.store(OUT + row[:, None] * latent_dim + c[None, :], out.to(OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + row, lse * 0.6931471805599453, mask=h_ok)
    else:
        part = row * splits + split
        tl.store(PARTIAL_O + part[:, None] * latent_dim + c[None, :], out, mask=mask)
        tl.store(PARTIAL_LSE + part, lse, mask=h_ok)


# ---------------------------------------------------------------------------------------------------------------------
# configurations, validation and plans


def config(latent_dim: int, rope_dim: int, heads: int, dtype: str, target: Target) -> tuple[int, ...]:
    """(BLOCK_H, BLOCK_N, BLOCK_C, BLOCK_R, num_warps, num_stages) of the split kernel: the heads of a tile bounded
    so that the (BLOCK_H, Dc) accumulator and a (BLOCK_N, Dc) latent tile fit the registers. 16-bit on warp-32
    GPUs: 64 heads x 64 positions, 8 warps, 2 stages, the best of benchmarks/sweep_mla_decode.py on an H200 at Dc
    512 and 32 x 8K (2.1-2.4x the 32 x 32 tiles there, 1.2-1.7x at 1 x 32K: 64 query rows are one wgmma's M). On
    sm_100 Triton's tcgen05 path holds that tile's operands in shared memory (2 stages: 345 KiB of 227): 1 stage."""
    block_c, block_r = max(16, next_power_of_2(latent_dim)), max(16, next_power_of_2(rope_dim))
    wide = block_c >= 256
    fp32 = dtype == "float32"
    wave64 = target.warp_size == 64  # one wave a SIMD, 512 VGPRs a lane: smaller tiles, 4 waves
    block_h = min(16 if fp32 or wave64 and wide else 64, max(16, next_power_of_2(heads)))
    block_n = 16 if fp32 or wide and wave64 else 64
    warps = 4 if wave64 else 8 if wide or fp32 else 4
    one_stage = wave64 or (block_h == 64 and wide and target.cuda_arch >= 100)
    return block_h, block_n, block_c, block_r, warps, 1 if one_stage else 2


def split_count(batch: int, heads: int, seqlen_k: int, latent_dim: int, rope_dim: int, dtype: str,
                target: Target) -> int:  # fmt: skip
    """Splits of the sequences (decode_attention.splits_for), a function of shapes only. Split programs an SM holds
    at Dc 512 as Triton 3.6 builds them for sm_90 (shared memory bounds them): 1 with 64-head tiles (216 KiB), 2 with
    16-head tiles (92 KiB); not timed."""
    block_h, block_n = config(latent_dim, rope_dim, heads, dtype, target)[:2]
    resident = 1 if block_h >= 64 else 2
    return splits_for(batch * cdiv(heads, block_h), seqlen_k, block_n, target, resident)


def default_scale(latent_dim: int, rope_dim: int) -> float:
    return 1.0 / math.sqrt(latent_dim + rope_dim) if latent_dim + rope_dim else 1.0


def check(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False) -> None:
    dtype = checks.check_float(NAME, "q_nope", q_nope)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        checks.check_array(NAME, name, t)
        if len(t.shape) != 3:
            raise ValueError(f"{NAME}: {name} must be 3-D (batch, heads, dim), got shape {tuple(t.shape)}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        checks.check_array(NAME, name, t)
        if len(t.shape) != 3:
            what = "(batch, seqlen, dim) or paged (num_blocks, page_size, dim)"
            raise ValueError(f"{NAME}: {name} must be 3-D {what}, got shape {tuple(t.shape)}")
    for name, t in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        checks.check_same_dtype(NAME, name, t, dtype, "that of q_nope")
    checks.check_same_dtype(NAME, "cache_seqlens", cache_seqlens, "int32", "the tokens in each sequence's cache")
    batch, heads, latent_dim = q_nope.shape
    rope_dim = q_pe.shape[2]
    checks.check_shape(NAME, "q_pe", q_pe, (batch, heads, rope_dim), "q_nope's batch and heads")
    checks.check_shape(NAME, "cache_seqlens", cache_seqlens, (batch,), "q_nope's batch")
    blocks, slots, _ = kv_c.shape
    if block_table is not None:
        checks.check_block_table(NAME, block_table, batch, "q_nope", "kv_c", kv_c, "(num_blocks, page_size, dim)")
        checks.check_shape(NAME, "kv_c", kv_c, (blocks, slots, latent_dim), "q_nope's dim")
    else:
        checks.check_shape(NAME, "kv_c", kv_c, (batch, slots, latent_dim), "q_nope's batch and dim")
    checks.check_shape(NAME, "k_pe", k_pe, (blocks, slots, rope_dim), "kv_c's first two and q_pe's dim")
    if latent_dim > MAX_LATENT_DIM or rope_dim > MAX_ROPE_DIM:
        raise ValueError(f"{NAME}: the latent dim must be at most {MAX_LATENT_DIM} and the rope dim at most "
                         f"{MAX_ROPE_DIM}, got {latent_dim} and {rope_dim}")  # fmt: skip
    if softmax_scale is not None:
        checks.check_real(NAME, "softmax_scale", softmax_scale, "None or a finite number")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{NAME}: return_lse must be a bool, got {type(return_lse).__name__}")


def check_backend(backend: str, dtype: str, latent_dim: int, rope_dim: int, page_size: int | None = None,
                  arch: int | None = None) -> None:  # fmt: skip
    """Raises ValueError naming the input a resolved backend cannot run (the TileLang kernel: float32, other dims,
    pages that are not a multiple of its position block, a GPU other than Hopper). The TileLang module is imported
    directly (it imports TileLang itself only to build): torch.compile traces this check."""
    if backend != "tilelang":
        return
    why = mla_decode_tilelang.unsupported(dtype, latent_dim, rope_dim, arch)
    if why is None and page_size is not None:
        why = mla_decode_tilelang.unsupported_page_size(page_size)
    if why:
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")


def preferred_backend(arch: int, dtype: str, latent_dim: int, rope_dim: int, page_size: int | None = None) -> str:
    """backend=None's choice on compute capability `arch` (0: not a CUDA device): "tilelang" wherever its kernel runs
    (sm_90, float16 / bfloat16, Dc 512, Dr 64, pages a multiple of its position block), about 2x the Triton path
    there (H200, 2026-12-03, 128 heads bf16, TFLOP/s: B 64 x 4K 409 against 203, B 1 x 32K 242 against 114;
    benchmarks/results/h200/notes.md); "triton" elsewhere. resolve falls back to "triton" where TileLang cannot
    build."""
    if arch != 90 or mla_decode_tilelang.unsupported(dtype, latent_dim, rope_dim, arch):
        return "triton"
    return "triton" if page_size is not None and mla_decode_tilelang.unsupported_page_size(page_size) else "tilelang"


def options(q_nope, q_pe, softmax_scale, backend: str = "triton", block_table=None, kv_c=None) -> float:
    """The scale the kernels take, once `check` has passed and the backend is resolved; raises what that backend
    cannot run (check_backend: the page size is kv_c's second dim when block_table is given)."""
    page_size = kv_c.shape[1] if block_table is not None and kv_c is not None else None
    check_backend(backend, dtype_name(q_nope.dtype), q_nope.shape[-1], q_pe.shape[-1], page_size)
    return default_scale(q_nope.shape[-1], q_pe.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _combine(buffers: dict, batch: int, heads: int, latent_dim: int, splits: int, block_d: int,
             pdl: bool = False) -> Launch:  # fmt: skip
    """The split kernels' (B, H, S, Dc) / (B, H, S) fp32 partials, added to `buffers`, and the launch of
    decode_attention's combine that merges them into out and lse (both backends); `pdl`: after a split kernel that
    lets it start early (decode_attention.pdl_combine)."""
    buffers |= {"partial_o": BufferSpec((batch, heads, splits, latent_dim), "float32"),
                "partial_lse": BufferSpec((batch, heads, splits), "float32")}  # fmt: skip
    reads = ("partial_o", "partial_lse", heads, latent_dim, splits)
    constexprs = dict(BLOCK_S=COMBINE_SPLITS, BLOCK_D=block_d, HAS_LSE=True, PDL=pdl)
    combine = Launch(decode_combine_kernel, (batch, heads), reads, ("out", "lse"), constexprs, num_warps=4, pdl=pdl)
    return in_units(combine, "head_dim", units=UNITS)


PROGRAM_BLOCKS, COMBINE_BLOCKS = 2, 4  # tilelang_split_count's model (guesses until measured)


def tilelang_split_count(batch: int, heads: int, seqlen_k: int, num_sms: int, block_n: int) -> int:
    """Splits of the TileLang kernel, whose programs each fill a multiprocessor (224 KiB of shared memory): the count
    of the least modelled time, in blocks of positions: waves x (blocks a split + PROGRAM_BLOCKS, a program's own
    cost: queries, prologue, epilogue) + COMBINE_BLOCKS when split (the partials' writes and the combine); ties to
    the fewest splits; every split at least MIN_SPLIT_BLOCKS blocks of the capacity. A function of shapes only."""
    programs = batch * cdiv(heads, mla_decode_tilelang.BLOCK_H)
    if programs == 0 or seqlen_k == 0:
        return 1
    blocks = cdiv(seqlen_k, block_n)
    most = max(1, min(MAX_SPLITS, cdiv(seqlen_k, MIN_SPLIT_BLOCKS * block_n)))

    def time(s: int) -> int:
        return cdiv(programs * s, num_sms) * (cdiv(blocks, s) + PROGRAM_BLOCKS) + (COMBINE_BLOCKS if s > 1 else 0)

    return min(range(1, most + 1), key=lambda s: (time(s), s))


def compiled_forward(
    backend: str, batch: int, heads: int, latent_dim: int, rope_dim: int, seqlen_k: int, *, dtype: str,
    scale: float | None, arch: int, target: Target, page_size: int | None = None, num_splits: int | None = None,
    tile_config: str | None = None,
) -> Plan:  # fmt: skip
    """The TileLang backend's forward for compute capability `arch` (90): inputs as `forward`'s, compact; outputs out
    and lse exactly as `forward`'s. A Call of the split kernel (mla_decode_tilelang.py), and with S > 1 splits the
    combine Launch (Triton, as `forward`'s). `tile_config`: one of mla_decode_tilelang.CONFIGS (None: its default; the
    benchmark tries the others). An empty cache (capacity 0) or an empty output runs `forward`'s plan (its kernels
    write 0 and -inf; a TMA descriptor cannot describe an empty cache)."""
    module = backends.module(NAME, backend)
    tile_config = tile_config or module.DEFAULT_CONFIG
    check_backend(backend, dtype, latent_dim, rope_dim, page_size, arch)
    why = module.unsupported_page_size(page_size, tile_config) if page_size is not None else None
    if why:
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")
    if batch * heads == 0 or seqlen_k == 0:
        return forward(batch, heads, latent_dim, rope_dim, seqlen_k, dtype=dtype, scale=scale, target=target,
                       page_size=page_size)  # fmt: skip
    paged = page_size is not None
    block_n = module.CONFIGS[tile_config][0]
    splits = num_splits or tilelang_split_count(batch, heads, seqlen_k, target.num_sms, block_n)
    inputs = {"q_nope": dtype, "q_pe": dtype, "kv_c": dtype, "k_pe": dtype, "cache_seqlens": "int32"}
    if paged:
        inputs["block_table"] = "int32"
    buffers = {"out": BufferSpec((batch, heads, latent_dim), dtype), "lse": BufferSpec((batch, heads), "float32")}
    kernel = module.kernel_name(paged, splits > 1, tile_config)
    load = functools.partial(module.function, kernel, dtype, dtype, arch)
    writes = ("out", "lse") if splits == 1 else ("partial_o", "partial_lse")
    attrs = {"scale": default_scale(latent_dim, rope_dim) if scale is None else float(scale)}
    steps = (Call(f"tile_kernels_{backend}_{kernel}_{dtype}_sm{arch}", load, tuple(inputs), writes, attrs),)
    if splits > 1:
        steps += (_combine(buffers, batch, heads, latent_dim, splits, latent_dim),)
    return Plan(inputs, buffers, steps, ("out", "lse"))


def forward(
    batch: int, heads: int, latent_dim: int, rope_dim: int, seqlen_k: int, *, dtype: str, scale: float | None,
    target: Target, page_size: int | None = None, strides_q_nope=None, strides_q_pe=None, strides_kv=None,
    strides_k_pe=None, stride_bt: int | None = None, num_splits: int | None = None,
) -> Plan:  # fmt: skip
    """Inputs q_nope (B, H, Dc), q_pe (B, H, Dr), kv_c / k_pe (contiguous (B, seqlen_k, D), or paged (num_blocks,
    page_size, D) with seqlen_k = max_pages * page_size), cache_seqlens (B,) int32, and block_table (B, max_pages)
    int32 when paged; unit last-dim strides, the others given ((batch, head) for q, (batch or page, position) for the
    caches, the row stride of block_table; None = compact). Outputs out (B, H, Dc) in dtype and lse (B, H) fp32
    (natural log), compact. `num_splits` None: the heuristic's (the tests force others)."""
    paged = page_size is not None
    inputs = {"q_nope": dtype, "q_pe": dtype, "kv_c": dtype, "k_pe": dtype, "cache_seqlens": "int32"}
    if paged:
        inputs["block_table"] = "int32"
    empty = batch * heads == 0
    buffers = {"out": BufferSpec((batch, heads, latent_dim), dtype, zeroed=empty),
               "lse": BufferSpec((batch, heads), "float32", zeroed=empty)}  # fmt: skip
    if empty:  # no output element (a capacity of 0 still launches: it writes 0 and -inf)
        return Plan(inputs, buffers, (), ("out", "lse"))
    block_h, block_n, block_c, block_r, warps, stages = config(latent_dim, rope_dim, heads, dtype, target)
    splits = num_splits or split_count(batch, heads, seqlen_k, latent_dim, rope_dim, dtype, target)
    positions = page_size if paged else seqlen_k
    sqn = tuple(strides_q_nope) if strides_q_nope is not None else (heads * latent_dim, latent_dim)
    sqp = tuple(strides_q_pe) if strides_q_pe is not None else (heads * rope_dim, rope_dim)
    skv = tuple(strides_kv) if strides_kv is not None else (positions * latent_dim, latent_dim)
    skp = tuple(strides_k_pe) if strides_k_pe is not None else (positions * rope_dim, rope_dim)
    stride_bt = (seqlen_k // page_size if stride_bt is None else stride_bt) if paged else 0
    ieee = ieee_dots(dtype)
    pdl = pdl_combine(splits, target)
    reads = ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table" if paged else None, heads, latent_dim,
             rope_dim, seqlen_k, page_size if paged else seqlen_k, stride_bt, *sqn, *sqp, *skv, *skp,
             default_scale(latent_dim, rope_dim) if scale is None else float(scale))  # fmt: skip
    writes = (None, None, "out", "lse") if splits == 1 else ("partial_o", "partial_lse", None, None)
    constexprs = dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_R=block_r, PAGED=paged, IEEE=ieee,
                      SPLIT=splits > 1, PAGES_A_BLOCK=pages_a_block(page_size, block_n), PDL=pdl)  # fmt: skip
    split = Launch(mla_split_kernel, (batch, cdiv(heads, block_h), splits), reads, writes, constexprs, warps, stages)
    launches = (in_units(split, *UNIT_ARGS, units=UNITS),)
    if splits > 1:
        launches += (_combine(buffers, batch, heads, latent_dim, splits, block_c, pdl),)
    return Plan(inputs, buffers, launches, ("out", "lse"))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False):
    batch, heads, latent_dim = q_nope.shape
    scale = default_scale(latent_dim, q_pe.shape[2]) if softmax_scale is None else softmax_scale
    out, lse = np.zeros(q_nope.shape), np.full((batch, heads), -np.inf)  # an empty sequence: 0 and -inf
    capacity = kv_c.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    for b in range(batch):
        length = int(np.clip(cache_seqlens[b], 0, capacity))
        if length == 0 or heads == 0:
            continue
        kv = gather(kv_c, b, length, block_table).astype(np.float64)  # (L, Dc)
        kp = gather(k_pe, b, length, block_table).astype(np.float64)
        s = (q_nope[b].astype(np.float64) @ kv.T + q_pe[b].astype(np.float64) @ kp.T) * scale  # (H, L)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[b] = p @ kv / p.sum(axis=1, keepdims=True)
        lse[b] = m[:, 0] + np.log(p.sum(axis=1))
    return (out, lse) if return_lse else (out,)


def reference_vjp(kwargs, cotangents):
    return {}  # not differentiable (grad_args is empty)


def cost(kwargs) -> tuple[Cost, Cost]:
    """flops: 2 H (2 Dc + Dr) per attended position (scores and output); bytes: q, the attended latent and rope
    rows (read once for every head), out. No backward."""
    q_nope, q_pe, kv = kwargs["q_nope"], kwargs["q_pe"], kwargs["kv_c"]
    heads, latent_dim = q_nope.shape[1:]
    rope_dim = q_pe.shape[2]
    capacity = kv.shape[1] * (kwargs["block_table"].shape[1] if kwargs.get("block_table") is not None else 1)
    positions = int(np.clip(kwargs["cache_seqlens"], 0, capacity).sum())
    item = ITEMSIZE[str(q_nope.dtype)]
    flops = 2 * positions * heads * (2 * latent_dim + rope_dim)
    bytes_ = (2 * q_nope.size + q_pe.size) * item + positions * (latent_dim + rope_dim) * item + 4 * q_nope.shape[0]
    return Cost(bytes_, flops), Cost(0, 0)


LONG_CONTEXT = 256  # a capacity taken from the drawn shape as it is (benchmarks: every sequence full); else drawn


def sample(rng: np.random.Generator, shape, dtype: str, paged=False, page_size=None, return_lse=False) -> dict:
    """q_nope (B, H, Dc), q_pe (B, H, Dr), caches of capacity C, from a drawn shape (..., n): C = shape[1] if it is
    0 or >= LONG_CONTEXT (a benchmark's shape: every sequence full, B = shape[0] and H = shape[2] as they are), else
    drawn in [1, 96], B = shape[0] at most 4 (1 without leading dims), H = shape[2] up to 16 (3 if absent); Dc = n
    up to 64 or 512 (then Dr = 64), else 16, 32 or 48, Dr = 16 (8 under Dc 32). Lengths among 0, 1, page_size +- 1,
    C and uniform ones. Paged: page_size drawn from 1, 7, 16, 64 (unless given), the pool's pages shuffled, 3 spare."""
    lead, n = tuple(shape[:-1]), shape[-1]
    given = len(lead) > 1 and (lead[1] == 0 or lead[1] >= LONG_CONTEXT)
    batch = (lead[0] if given else min(lead[0], 4)) if lead else 1
    capacity = lead[1] if given else int(rng.integers(1, 97))
    heads = lead[2] if len(lead) > 2 else 3
    heads = heads if given else min(heads, 16)
    latent_dim = n if n <= 64 or n == MAX_LATENT_DIM else (16, 32, 48)[n % 3]
    rope_dim = MAX_ROPE_DIM if latent_dim == MAX_LATENT_DIM else 8 if latent_dim < 32 else 16
    page = int(page_size or rng.choice([1, 7, 16, 64])) if paged else 16
    max_pages = cdiv(capacity, page)
    capacity = max_pages * page if paged else capacity
    lengths = draw_lengths(rng, batch, capacity, page, full=given)
    kwargs = {"q_nope": round_to(rng.standard_normal((batch, heads, latent_dim)), dtype),
              "q_pe": round_to(rng.standard_normal((batch, heads, rope_dim)), dtype)}  # fmt: skip
    rows = batch * max_pages + 3 if paged else batch
    slots = page if paged else capacity
    kwargs["kv_c"] = round_to(rng.standard_normal((rows, slots, latent_dim)), dtype)
    kwargs["k_pe"] = round_to(rng.standard_normal((rows, slots, rope_dim)), dtype)
    table = rng.permutation(rows)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32) if paged else None
    return kwargs | {"cache_seqlens": lengths, "block_table": table, "softmax_scale": None,
                     "return_lse": return_lse}  # fmt: skip


def bad_inputs(kwargs) -> list[BadInput]:
    q_nope, q_pe, kv, kp, lengths = (kwargs[k] for k in ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens"))
    table = np.zeros((q_nope.shape[0], 2), np.int32)
    return [
        BadInput({"q_nope": q_nope[0]}, ValueError, "mla_decode: q_nope must be 3-D"),
        BadInput({"q_nope": q_nope.astype(np.int32)}, TypeError, "mla_decode: q_nope must have dtype"),
        BadInput({"q_pe": q_pe[:, :-1] if q_pe.shape[1] else q_pe[..., None]}, ValueError, "mla_decode: q_pe must"),
        BadInput({"kv_c": kv.astype(np.float16 if kv.dtype != np.float16 else np.float32)}, TypeError,
                 "mla_decode: kv_c must have dtype"),  # fmt: skip
        BadInput({"kv_c": kv[0]}, ValueError, "mla_decode: kv_c must be 3-D"),
        BadInput({"k_pe": kp[:, :-1]}, ValueError, "mla_decode: k_pe must have shape"),
        BadInput({"cache_seqlens": lengths.astype(np.float32)}, TypeError,
                 "mla_decode: cache_seqlens must have dtype int32"),  # fmt: skip
        BadInput({"cache_seqlens": lengths[:-1]}, ValueError, "mla_decode: cache_seqlens must have shape"),
        BadInput({"block_table": table.astype(np.float32)}, TypeError, "mla_decode: block_table must have dtype int32"),
        BadInput({"softmax_scale": "0.3"}, TypeError, "mla_decode: softmax_scale must be None or a finite"),
        BadInput({"return_lse": 1}, TypeError, "mla_decode: return_lse must be a bool"),
        *not_arrays(NAME, "q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens"),
    ]  # fmt: skip


def plans(target: Target):
    """Every dtype at DeepSeek's dims (Dc 512, Dr 64) with 16 and 128 heads, contiguous and paged (page 64), and at
    a small padded shape (Dc 48, Dr 8); the unsplit kernel (one split) at DeepSeek's dims, 128 heads. The split count
    of a split kernel is a runtime value."""
    for dtype in FLOAT_DTYPES:
        for heads in (16, 128):
            for page_size in (None, 64):
                yield forward(2, heads, 512, 64, 4096, dtype=dtype, scale=None, target=target, page_size=page_size)
        yield forward(2, 3, 48, 8, 256, dtype=dtype, scale=None, target=target, page_size=16)
        yield forward(2, 128, 512, 64, 4096, dtype=dtype, scale=None, target=target, num_splits=1)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"paged": (True, False), "return_lse": (True, False)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
