"""torch side of `tile-kernels bench`: tile-kernels' torch ops and the peers a torch user would otherwise call —
eager torch, torch.compile of the same eager code, Liger-Kernel where it has the op, and for flash_attention SDPA's
cuDNN and flash backends.

Two times per call. Device time: the call captured in a CUDA graph and replayed (median per call), so Python and
launch overhead are not timed: what the kernels cost. Eager wall time: back-to-back plain calls, the host included:
what an eager PyTorch user gets (the larger of host and device time per call, in steady state). fwd = forward without
autograd; bwd = torch.autograd.grad of one recorded forward, replayed with retain_graph; step = forward with autograd
recording + backward, the training cost. "tile-kernels compiled" is torch.compile of the call of our op."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import torch
import torch.nn.functional as F

import tile_kernels.torch as tk
from tile_kernels.core.bench import FUSED_BACKWARD, Case, Ceilings, Timing, other_backends
from tile_kernels.core.registry import REGISTRY

# compiled backwards are replayed with retain_graph; one code object is compiled for every shape of the sweep
torch._functorch.config.donated_buffer = False
for _name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 1024)


# ----------------------------------------------------------------------------- the ops as a torch user writes them


def rms_norm(x, weight, eps=1e-6, residual=None):
    h = x if residual is None else x + residual
    y = F.rms_norm(h, h.shape[-1:], weight, eps)
    return y if residual is None else (y, h)


def layer_norm(x, weight, bias=None, eps=1e-5, residual=None):
    h = x if residual is None else x + residual
    y = F.layer_norm(h, h.shape[-1:], weight, bias, eps)
    return y if residual is None else (y, h)


def softmax(x, dim=-1):
    return torch.softmax(x, dim)


def swiglu(gate, up):
    return F.silu(gate) * up


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)  # fmt: skip


def apply_rotary(x, cos, sin, interleaved=False):
    c, s = cos[:, None, :], sin[:, None, :]  # (S, 1, D/2) against x (B, S, H, D)
    if interleaved:
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2).to(x.dtype)
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)


def fused_linear_cross_entropy(hidden, weight, target, ignore_index=-100, reduction="mean", chunk_size=None):
    """The unfused version: the (N, V) logits in the input dtype, then the loss."""
    return F.cross_entropy(hidden @ weight.T, target, ignore_index=ignore_index, reduction=reduction)


def flash_attention(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
    """F.scaled_dot_product_attention (cuDNN / flash backends on a GPU) with the key/value heads expanded for GQA;
    windows, softcap and bottom-right causal with Sq != Sk through an explicit mask (rows that see no key give 0)."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if softcap == 0 and tuple(window) == (-1, -1) and (not causal or seqlen_q == seqlen_k):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale).transpose(1, 2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    s = (qt.float() @ kt.float().transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    left, right = window[0], 0 if causal else window[1]
    seen = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    return (p @ vt.float()).to(q.dtype).transpose(1, 2)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           window=(-1, -1), softmax_scale=None, softcap=0.0):  # fmt: skip
    """The packed sequences padded to (B, max_seqlen, H, D) (a gather, no host sync), attended by SDPA with each
    sequence's mask (bottom-right causal, windows, its length; heads expanded for GQA), or in float32 with softcap;
    packed back (rows that see no key give 0)."""
    lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    qp, kp, vp = (_padded(t, cu, n) for t, cu, n in ((q, cu_seqlens_q, max_seqlen_q), (k, cu_seqlens_k, max_seqlen_k),
                                                     (v, cu_seqlens_k, max_seqlen_k)))  # fmt: skip
    group = q.shape[1] // max(k.shape[1], 1)
    qt, kt, vt = (t.transpose(1, 2) for t in (qp, kp.repeat_interleave(group, 2), vp.repeat_interleave(group, 2)))
    i = torch.arange(max_seqlen_q, device=q.device)[None, :, None] + (lengths_k - lengths_q)[:, None, None]
    j = torch.arange(max_seqlen_k, device=q.device)[None, None, :]
    left, right = window[0], 0 if causal else window[1]
    seen = (j < lengths_k[:, None, None]) & ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
    if softcap > 0:
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        s = softcap * torch.tanh((qt.float() @ kt.float().transpose(-1, -2)) * scale / softcap)
        p = torch.softmax(s.masked_fill(~seen[:, None], float("-inf")), -1).nan_to_num(0.0)
        out = (p @ vt.float()).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen[:, None], scale=softmax_scale)
    out = out.transpose(1, 2).nan_to_num(0.0) * seen.any(-1)[..., None, None]
    rows = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:], rows, right=True)
    return out[seq, rows - cu_seqlens_q[seq]]


def _padded(t, cu_seqlens, longest):
    """Packed rows (total, H, D) -> (B, longest, H, D): row p of sequence b is row cu[b] + p (clamped: masked later)."""
    rows = cu_seqlens[:-1, None] + torch.arange(longest, device=t.device)[None, :]
    return t[rows.clamp(0, max(t.shape[0] - 1, 0))] if t.shape[0] else t.new_zeros(rows.shape + t.shape[1:])


def dequant_weight(qweight, scales, group_size=128, zeros=None):
    """W (K, N) in scales' dtype: the int4 codes unpacked by shifts, (code - zero) * scale in float32."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1]).float()
    zero = 8.0 if zeros is None else zeros.float().repeat_interleave(group_size, 0)
    return ((codes - zero) * scales.float().repeat_interleave(group_size, 0)).to(scales.dtype)


def dequant_matmul(a, qweight, scales, group_size=128, zeros=None):
    """The weight dequantized on every call, then a @ W (cuBLAS)."""
    return a @ dequant_weight(qweight, scales, group_size, zeros)


_ACTIVATIONS = {None: lambda y: y, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}


def matmul(a, b, bias=None, activation=None, residual=None):
    """cuBLAS (a @ b, + bias through addmm), then torch's activation and the residual add."""
    y = _ACTIVATIONS[activation](a @ b if bias is None else torch.addmm(bias, a, b))
    return y if residual is None else y + residual


def fp8_matmul(a, a_scales, b, b_scales, out_dtype="bfloat16"):
    """a and b dequantized (code x its block's scale, in float32) to out_dtype on every call, then cuBLAS."""
    dtype = getattr(torch, out_dtype)
    wa = (a.float().unflatten(1, (-1, 128)) * a_scales[:, :, None]).flatten(1).to(dtype)
    wb = (
        (b.float().unflatten(0, (-1, 128)).unflatten(2, (-1, 128)) * b_scales[:, None, :, None])
        .flatten(2)
        .flatten(0, 1)
    )
    return wa @ wb.to(dtype).t()


def fp8_quantize(x, block_rows=1):
    """amax per block, scale = amax / 448 (1 for zeros), codes x / scale cast to e4m3, in float32."""
    blocks = x.float().unflatten(0, (-1, block_rows)).unflatten(2, (-1, 128))
    amax = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / 448.0, 1.0)
    return (blocks / scales[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.float8_e4m3fn), scales


def _scaled_mm(block_scales: bool):
    """torch._scaled_mm (cuBLAS FP8): with the op's block scales (a_scales column-major, as cuBLAS reads them), or
    with per-tensor scales of 1 (the same products, coarser scaling: the FP8 GEMM ceiling)."""

    def scaled_mm(a, a_scales, b, b_scales, out_dtype="bfloat16"):
        if block_scales:
            sa, sb = a_scales.t().contiguous().t(), b_scales.t()
        else:
            sa = sb = torch.ones((), device=a.device)
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=getattr(torch, out_dtype))

    return scaled_mm


def rms_norm_fp8_quantize(x, weight, eps=1e-6, residual=None):
    """rms_norm's peer, then fp8_quantize's: the unfused pair."""
    out = rms_norm(x, weight, eps, residual)
    y, h = (out, None) if residual is None else out
    return fp8_quantize(y) + (() if h is None else (h,))


def swiglu_fp8_quantize(gate, up):
    """swiglu's peer, then fp8_quantize's: the unfused pair."""
    return fp8_quantize(swiglu(gate, up))


def moe_route(expert_ids, num_experts):
    """A stable torch.sort of the choices by expert (dropped ones keyed past the last expert), bincount."""
    ids = expert_ids.flatten().long()
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = torch.sort(key, stable=True).indices
    positions = torch.empty_like(ids).scatter_(0, order, torch.arange(ids.numel(), device=ids.device))
    positions = torch.where(key < num_experts, positions, -1).view(expert_ids.shape).int()
    return positions, torch.bincount(key, minlength=num_experts + 1)[:num_experts].int()


def moe_permute(x, positions):
    """index_put of each token's row at its k positions (dropped ones to a spare last row)."""
    rows = positions.numel()
    index = torch.where(positions >= 0, positions, rows).flatten().long()
    xs = x.new_zeros(rows + 1, x.shape[1]).index_put((index,), x.repeat_interleave(positions.shape[1], 0))
    return xs[:rows]


def moe_unpermute(ys, positions, weights):
    """The k rows gathered, weighted (dropped ones 0) and summed in float32."""
    gates = torch.where(positions >= 0, weights.float(), 0.0)
    rows = ys[positions.clamp(min=0).long()].float()
    return (rows * gates[..., None]).sum(1).to(ys.dtype)


def grouped_matmul(x, weights, group_sizes):
    """One cuBLAS GEMM per expert over its rows (the sizes read on the host); rows past the sizes' sum 0."""
    out = x.new_zeros(x.shape[0], weights.shape[2])
    start = 0
    for e, size in enumerate(group_sizes.tolist()):
        out[start : start + size] = x[start : start + size] @ weights[e]
        start += size
    return out


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None,
                     v_scale=None):  # fmt: skip
    """The cache gathered (through the block table when paged) and masked past each length, heads expanded for GQA,
    softmax in float32 (a sequence of length 0 gives 0); FP8 caches times their scales in float32."""
    if block_table is not None:  # (B, max_pages * page_size, Hk, D)
        k_cache, v_cache = (c[block_table.long()].flatten(1, 2) for c in (k_cache, v_cache))
    group = q.shape[1] // k_cache.shape[2]
    k, v = (c.float().repeat_interleave(group, 2) * (x or 1.0) for c, x in ((k_cache, k_scale), (v_cache, v_scale)))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    s = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale
    seen = torch.arange(k.shape[1], device=q.device)[None, :] < cache_seqlens[:, None]
    p = torch.softmax(s.masked_fill(~seen[:, None, :], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhs,bshd->bhd", p, v).to(q.dtype)


def mla_decode(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False):
    """The latent caches gathered (through the block table when paged), scores of both parts masked past each
    length, softmax in float32 (a sequence of length 0 gives 0 and lse -inf)."""
    if block_table is not None:  # (B, max_pages * page_size, D)
        kv_c, k_pe = (c[block_table.long()].flatten(1, 2) for c in (kv_c, k_pe))
    scale = softmax_scale if softmax_scale is not None else (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    kv = kv_c.float()
    s = torch.einsum("bhc,bsc->bhs", q_nope.float(), kv) + torch.einsum("bhr,bsr->bhs", q_pe.float(), k_pe.float())
    seen = torch.arange(kv.shape[1], device=kv.device)[None, None, :] < cache_seqlens[:, None, None]
    s = (s * scale).masked_fill(~seen, float("-inf"))
    out = torch.einsum("bhs,bsc->bhc", torch.softmax(s, -1).nan_to_num(0.0), kv).to(q_nope.dtype)
    return (out, torch.logsumexp(s, -1)) if return_lse else out


EAGER = {f.__name__: f for f in (rms_norm, layer_norm, softmax, swiglu, cross_entropy, apply_rotary,
                                  fused_linear_cross_entropy, flash_attention, flash_attention_varlen,
                                  decode_attention, dequant_matmul, matmul, fp8_matmul, fp8_quantize,
                                  grouped_matmul, mla_decode, moe_route, moe_permute, moe_unpermute,
                                  rms_norm_fp8_quantize, swiglu_fp8_quantize)}  # fmt: skip


# Peers left out of torch.compile: Inductor's code for the padded varlen peer raised a device-side assert at the
# benchmark's shape on the H200 (2026-12-02), which ends the process's CUDA context and with it every later row.
NOT_COMPILED = {"flash_attention_varlen"}


def _sdpa(backend: str):
    """flash_attention through one of SDPA's backends (CUDNN_ATTENTION, FLASH_ATTENTION): the anchors of the
    attention benchmark. They lack windows and softcap; causal with Sq != Sk would be top-left aligned."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
        if softcap or tuple(window) != (-1, -1) or (causal and q.shape[1] != k.shape[1]):
            raise NotImplementedError(f"SDPA's {backend}: no window, softcap or bottom-right causal")
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return flash_attention(q, k, v, causal, window, softmax_scale, softcap)

    return attention


def _sdpa_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None, v_scale=None):
    """decode_attention through F.scaled_dot_product_attention over the padded cache (a paged cache gathered first,
    as a caller without a paged kernel runs it; FP8 caches widened to q's dtype times their scales first): one query
    token a sequence, a length mask, GQA by enable_gqa."""
    if q.dim() != 3:
        raise NotImplementedError("SDPA over the padded cache: one query token a sequence")
    if block_table is not None:  # (B, max_pages * page_size, Hk, D)
        k_cache, v_cache = (c[block_table.long()].flatten(1, 2) for c in (k_cache, v_cache))
    if k_cache.dtype != q.dtype:
        k_cache, v_cache = (c.to(q.dtype) * (x or 1.0) for c, x in ((k_cache, k_scale), (v_cache, v_scale)))
    seen = torch.arange(k_cache.shape[1], device=q.device) < cache_seqlens[:, None]
    k, v = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, seen[:, None, None], scale=softmax_scale, enable_gqa=True)
    return out[:, :, 0]


def _flashinfer(module: str):
    """FlashInfer's `module` ("flashinfer", "flashinfer.mla"), or None where flashinfer-python is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _flashinfer_missing(**_):
    raise NotImplementedError("flashinfer-python is not installed")


def _page_lists(cache_seqlens, block_table, page: int, device) -> tuple:
    """FlashInfer's page table of the sequences' used pages: (lengths (B,) int64 on the host, indptr (B + 1,) int32,
    indices (the pages in order) int32), from cache_seqlens and block_table (B, max_pages)."""
    lengths = cache_seqlens.long().cpu()
    pages = (lengths + page - 1) // page
    indices = torch.cat([block_table[b, : int(n)] for b, n in enumerate(pages)]).int()
    indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).int().to(device)
    return lengths, indptr, indices


def _flashinfer_decode(tensor_cores: bool = False):
    """FlashInfer's paged decode (BatchDecodeWithPagedKVCacheWrapper over the same NHD pages; `tensor_cores`: its
    use_tensor_cores kernels, which it recommends for grouped query heads), planned at the first call of a case (its
    host-side schedule: a serving engine plans once a step) and timed on run(). Sequences of length 0 are outside its
    page table's convention (the benchmark's are full)."""
    flashinfer = _flashinfer("flashinfer")
    if flashinfer is None:
        return _flashinfer_missing
    wrappers = {}

    def decode(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None, v_scale=None):
        if block_table is None or q.dim() != 3:
            raise NotImplementedError("FlashInfer's paged decode: paged caches, one query token a sequence")
        key = (q.data_ptr(), k_cache.data_ptr(), block_table.data_ptr(), cache_seqlens.data_ptr())
        if key not in wrappers:
            page = k_cache.shape[1]
            lengths, indptr, indices = _page_lists(cache_seqlens, block_table, page, q.device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(128 << 20, dtype=torch.uint8, device=q.device), "NHD", use_tensor_cores=tensor_cores
            )
            wrapper.plan(indptr, indices, ((lengths - 1) % page + 1).int().to(q.device), q.shape[1], k_cache.shape[2],
                         q.shape[2], page, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                         sm_scale=softmax_scale)  # fmt: skip
            wrappers.clear()
            wrappers[key] = wrapper
        scales = {} if k_cache.dtype == q.dtype else {"k_scale": k_scale, "v_scale": v_scale}
        return wrappers[key].run(q, (k_cache, v_cache), **scales)

    return decode


def _flashinfer_mla():
    """FlashInfer's MLA decode (BatchMLAPagedAttentionWrapper, its backend choice for the device) over the same pages
    (kv_c and k_pe as its separate ckv / kpe caches), planned at the first call of a case and timed on run()."""
    mla_module = _flashinfer("flashinfer.mla")
    if mla_module is None:
        return _flashinfer_missing
    wrappers = {}

    def mla(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False):
        if block_table is None:
            raise NotImplementedError("FlashInfer's MLA decode: paged caches")
        key = (q_nope.data_ptr(), kv_c.data_ptr(), block_table.data_ptr(), cache_seqlens.data_ptr())
        if key not in wrappers:
            batch, heads, latent = q_nope.shape
            page = kv_c.shape[1]
            _, kv_indptr, indices = _page_lists(cache_seqlens, block_table, page, q_nope.device)
            qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q_nope.device)
            scale = softmax_scale or (latent + q_pe.shape[-1]) ** -0.5
            wrapper = mla_module.BatchMLAPagedAttentionWrapper(
                torch.zeros(128 << 20, dtype=torch.uint8, device=q_nope.device)
            )
            wrapper.plan(qo_indptr, kv_indptr, indices, cache_seqlens.int(), heads, latent, q_pe.shape[-1], page,
                         False, scale, q_nope.dtype, kv_c.dtype)  # fmt: skip
            wrappers.clear()
            wrappers[key] = wrapper
        return wrappers[key].run(q_nope, q_pe, kv_c, k_pe)

    return mla


def _dequantized_once(a, qweight, scales, group_size=128, zeros=None):
    """a @ W with W dequantized at the first call of these weights (cached by qweight's pointer): cuBLAS alone."""
    key = (qweight.data_ptr(), scales.data_ptr(), group_size)
    if key not in _DEQUANTIZED:
        _DEQUANTIZED.clear()
        _DEQUANTIZED[key] = dequant_weight(qweight, scales, group_size, zeros)
    return a @ _DEQUANTIZED[key]


_DEQUANTIZED: dict = {}


def _as_batch(attention):
    """flash_attention_varlen through a (B, S, H, D) attention, for packed sequences of one length S."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, window=(-1, -1),
               softmax_scale=None, softcap=0.0):  # fmt: skip
        batch = cu_seqlens_q.shape[0] - 1
        qb, kb, vb = (t.view(batch, -1, *t.shape[1:]) for t in (q, k, v))
        return attention(qb, kb, vb, causal, window, softmax_scale, softcap).view(q.shape)

    return varlen


def _liger(op: str):
    """Liger-Kernel's function for `op` with our argument names, or None where it has none."""
    try:
        from liger_kernel.transformers import functional as lf
    except ImportError:
        return None

    def swiglu(gate, up):
        return lf.liger_swiglu(gate, up)

    def rms(x, weight, eps=1e-6, residual=None):
        if residual is None:
            return lf.liger_rms_norm(x, weight, eps, in_place=False)
        return lf.liger_fused_add_rms_norm(x, residual, weight, eps, in_place=False)

    def layer(x, weight, bias=None, eps=1e-5, residual=None):  # no fused residual add: torch adds first
        h = x if residual is None else x + residual
        y = lf.liger_layer_norm(h, weight, bias, eps)
        return y if residual is None else (y, h)

    def ce(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        return lf.liger_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                      label_smoothing=label_smoothing)  # fmt: skip

    def flce(hidden, weight, target, ignore_index=-100, reduction="mean", chunk_size=None):
        return lf.liger_fused_linear_cross_entropy(hidden, weight, target, ignore_index=ignore_index,
                                                   reduction=reduction)  # fmt: skip

    def soft(x, dim=-1):
        if dim not in (-1, x.dim() - 1):
            raise NotImplementedError("Liger's softmax is over the last dim only")
        return lf.liger_softmax(x)

    return {"rms_norm": rms, "layer_norm": layer, "softmax": soft, "swiglu": swiglu, "cross_entropy": ce,
            "fused_linear_cross_entropy": flce}.get(op)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- measuring


def _tensor(a, device):
    if not isinstance(a, (np.ndarray, np.generic)):
        return a
    host = a.astype(np.float32) if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a
    return torch.from_numpy(np.ascontiguousarray(host)).to(device, getattr(torch, a.dtype.name))


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _graph_ms(fn, stream) -> tuple[float, str]:
    """(median ms per call, note): `fn` captured back to back in a CUDA graph and replayed, so that host overhead
    (Python, dispatch, launches) is not timed; where capture fails, Triton's do_bench (events around each call, L2
    flushed before it), which times the host too if it is slower than the device."""
    from triton.testing import do_bench

    fn()  # compiles, autotunes
    torch.cuda.set_sync_debug_mode("error")  # a call that waits for the host (e.g. .item()) cannot be captured
    try:
        fn()
        synchronizes = False
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        synchronizes = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if synchronizes:  # timed with the debug mode off again, as it was set only to find out
        return do_bench(fn), "eager timing (synchronizes with the host: not capturable in a CUDA graph)."
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, min(50, int(30 / max(start.elapsed_time(end) / 3, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    except Exception as e:  # noqa: BLE001 — e.g. a host sync inside fn
        torch.cuda.synchronize()
        return do_bench(fn), f"eager timing ({type(e).__name__} in CUDA graph capture)."
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return float(np.median(times)), ""


def _wall_ms(fn, rounds: int = 5) -> float:
    """Median wall time per call of back-to-back calls of `fn` (no synchronization between them: the host runs ahead
    until the device, or the host itself, is the bottleneck), over enough calls to take ~20 ms a round."""
    import time

    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls = max(5, min(2000, int(0.02 / max((time.perf_counter() - started) / 3, 1e-7))))
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) / calls * 1e3)
    return float(np.median(times))


def _copy_gbs(device) -> float:
    from triton.testing import do_bench

    src = torch.randn(1 << 28, device=device, dtype=torch.bfloat16)  # 512 MiB each way
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / do_bench(lambda: dst.copy_(src), rep=200) / 1e6


class Provider:
    def __init__(self, device: str = "cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("bench: no CUDA/ROCm device visible to torch")
        self.device = torch.device(device)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def versions(self) -> dict:
        out = {"torch": torch.__version__}
        for dist in ("triton", "liger-kernel", "tile-kernels"):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out

    def ceilings(self) -> Ceilings:
        from triton.testing import do_bench

        copy = _copy_gbs(self.device)
        a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        gemm = 2 * 8192**3 / do_bench(lambda: a @ b, rep=200) / 1e9
        return Ceilings(copy_gbs=copy, gemm_tflops=gemm)

    def implementations(self, op: str) -> dict:
        ours = getattr(tk, op, None)
        impls = {"tile-kernels": ours} | other_backends(op, ours, "cuda")
        impls["tile-kernels compiled"] = ours and torch.compile(ours, dynamic=False, fullgraph=True)
        impls["torch eager"] = EAGER.get(op)
        if op in EAGER and op not in NOT_COMPILED:
            impls["torch.compile"] = torch.compile(EAGER[op], dynamic=False)
        impls["liger"] = _liger(op)
        if op == "flash_attention":
            impls |= {"sdpa cudnn": _sdpa("CUDNN_ATTENTION"), "sdpa flash": _sdpa("FLASH_ATTENTION")}
        if op == "grouped_matmul" and hasattr(torch, "_grouped_mm"):  # torch's grouped GEMM (offsets: the sizes' sums)
            impls["torch._grouped_mm"] = lambda x, weights, group_sizes: torch._grouped_mm(
                x, weights, offs=group_sizes.cumsum(0, dtype=torch.int32)
            )
        if op == "fp8_matmul":
            impls |= {"torch._scaled_mm (block scales)": _scaled_mm(True),
                      "torch._scaled_mm (per-tensor scales)": _scaled_mm(False)}  # fmt: skip
        if op == "decode_attention":
            impls |= {"sdpa (padded cache)": _sdpa_decode, "flashinfer": _flashinfer_decode(),
                      "flashinfer tensor cores": _flashinfer_decode(tensor_cores=True)}  # fmt: skip
        if op == "mla_decode":
            impls["flashinfer"] = _flashinfer_mla()
        if op == "dequant_matmul":  # the anchor: cuBLAS on the weight dequantized once, in a's dtype
            impls["torch.mm (dequantized weight)"] = _dequantized_once
        if op == "flash_attention_varlen":  # the benchmark's sequences have one length: the same work as a batch
            impls |= {
                f"{name} (as a batch)": _as_batch(fn)
                for name, fn in (
                    ("tile-kernels flash_attention", tk.flash_attention),
                    ("sdpa cudnn", _sdpa("CUDNN_ATTENTION")),
                )
            }
        return impls

    def measure(self, case: Case, only=None) -> list[Timing]:
        args = {k: _tensor(v, self.device) for k, v in case.kwargs.items()}
        grad_args = [k for k in REGISTRY[case.op].grad_args if args.get(k) is not None]
        timings = []
        for name, fn in self.implementations(case.op).items():
            if only and not any(s in name for s in only):
                continue
            if fn is None:
                timings.append(Timing(name, None, None, note="no such op"))
                continue
            try:
                timings.append(self._time(name, fn, args, grad_args))
            except Exception as e:  # a peer that cannot run this case is reported, not dropped
                timings.append(Timing(name, None, None, note=f"{type(e).__name__}: {e}".splitlines()[0]))
            torch.cuda.empty_cache()
        return timings

    def _time(self, name, fn, args, grad_args) -> Timing:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # the recorded autograd graph and the CUDA graphs share this stream
            fwd_ms, note = _graph_ms(lambda: fn(**args), stream)
            eager_fwd_ms = _wall_ms(lambda: fn(**args))
            leaves = {k: args[k].detach().clone().requires_grad_() for k in grad_args}
            call = {**args, **leaves}
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            outs = [o for o in _as_tuple(fn(**call)) if o.requires_grad]
            if not outs:
                return Timing(name, fwd_ms, None, note=note, eager_fwd_ms=eager_fwd_ms)
            cts = [torch.randn_like(o) for o in outs]
            torch.autograd.grad(outs, list(leaves.values()), cts, retain_graph=True)
            peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20

            def step():  # one training step: forward with autograd recording, then backward
                o = [o for o in _as_tuple(fn(**call)) if o.requires_grad]
                torch.autograd.grad(o, list(leaves.values()), cts)

            step_ms, step_note = _graph_ms(step, stream)
            eager_step_ms = _wall_ms(step)
            try:  # replay the recorded backward
                torch.autograd.grad(outs, list(leaves.values()), cts, retain_graph=True)
                bwd_ms, bwd_note = _graph_ms(
                    lambda: torch.autograd.grad(outs, list(leaves.values()), cts, retain_graph=True), stream
                )
            except RuntimeError:  # a backward that cannot run twice (gradients scaled in place)
                del outs
                train_fwd_ms, _ = _graph_ms(lambda: fn(**call), stream)
                bwd_ms, bwd_note = step_ms - train_fwd_ms, "bwd = step - forward with autograd recording."
                if bwd_ms < 0.05 * step_ms:  # the forward computed the gradients (fused_linear_cross_entropy)
                    bwd_ms, bwd_note = None, FUSED_BACKWARD
        notes = " ".join(dict.fromkeys(n for n in (note, bwd_note, step_note) if n))
        return Timing(name, fwd_ms, bwd_ms, step_ms=step_ms, peak_mib=peak, note=notes, eager_fwd_ms=eager_fwd_ms,
                      eager_step_ms=eager_step_ms)  # fmt: skip
