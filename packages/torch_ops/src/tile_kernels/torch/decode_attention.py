"""torch adapter of tile_kernels.core.decode_attention: op tile_kernels::decode_attention_fwd (inference: no
autograd; the output does not require grad)."""

from __future__ import annotations

import torch

from tile_kernels.core import decode_attention as core
from tile_kernels.core import dtype_name

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated


def _fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None, softmax_scale: float, v_scale: float,
) -> torch.Tensor:  # fmt: skip
    """Returns out shaped as q ((B, Hq, D) or (B, T, Hq, D)) in q's dtype. softmax_scale: times k_scale (options)."""
    q, k, v = unit_last(q), unit_last(k_cache), unit_last(v_cache)
    tokens = core.tokens_of(q)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    batch, _, heads_q, head_dim = q4.shape
    _, slots, heads_k, _ = k.shape
    inputs = [q4, k, v, cache_seqlens.contiguous()]
    paged = dict(page_size=None)
    if block_table is not None:
        block_table = unit_last(block_table)
        paged = dict(page_size=slots, stride_bt=block_table.stride(0))
        inputs.append(block_table)
    capacity = slots * (block_table.shape[1] if block_table is not None else 1)
    run = executor(core.forward, batch, heads_q, heads_k, head_dim, capacity, dtype=dtype_name(q.dtype),
                   scale=softmax_scale, target=target(q.device), strides_q=tuple(q4.stride()[:3]),
                   strides_k=tuple(k.stride()[:3]), strides_v=tuple(v.stride()[:3]), tokens=tokens,
                   cache_dtype=dtype_name(k.dtype), v_scale=v_scale, **paged)  # fmt: skip
    return run(*inputs, device=q.device, shapes={"out": q})[0]


decode_attention_fwd = eager_op("decode_attention_fwd", _fwd)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of new tokens, q (B, Hq, D) (one a sequence) or (B, T, Hq, D) (T a sequence, causal among them: token
    t sees cache_seqlens[b] - (T - 1 - t) positions), over the first cache_seqlens[b] (int32 (B,)) positions of each
    sequence's KV cache, their own K / V already written: contiguous k_cache / v_cache (B, Smax, Hk, D), or paged
    (num_blocks, page_size, Hk, D) with block_table (B, max_pages) int32 (position p in page block_table[b, p //
    page_size], slot p % page_size); Hq % Hk == 0; softmax_scale defaults to 1 / sqrt(D). Caches in q's dtype, or
    torch.float8_e4m3fn (NVIDIA sm_89+) holding K / k_scale and V / v_scale (per-tensor scales, default 1). Returns
    q's shape and dtype; 0 for a token that sees no position. Not differentiable."""
    validated(core.NAME, core.check, ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", None, None, None), q,
              k_cache, v_cache, cache_seqlens, block_table, softmax_scale, k_scale, v_scale)  # fmt: skip
    scale, v_scale = core.options(q, softmax_scale, k_scale, v_scale)
    return decode_attention_fwd(q, k_cache, v_cache, cache_seqlens, block_table, scale, v_scale)


register_public_op(
    "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table=None, "
    "float? softmax_scale=None, float? k_scale=None, float? v_scale=None) -> Tensor",
    decode_attention,
)
