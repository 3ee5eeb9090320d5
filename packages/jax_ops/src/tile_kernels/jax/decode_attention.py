"""JAX adapter of tile_kernels.core.decode_attention (inference: no VJP). cache_seqlens and block_table are traced
operands, softmax_scale is static; custom_vmap folds a vmapped axis into the batch (one launch per kernel): vmapped
page pools are stacked into one, each problem's block table offset to its own pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import decode_attention as core
from tile_kernels.core import dtype_name, sharding

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


def _fold(a: jax.Array) -> jax.Array:
    """(P, B, ...) -> (P * B, ...): vmapped problems are more batch entries (or more pages of one pool)."""
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


@functools.cache
def _call(scale: float, v_scale: float, paged: bool, q_ndim: int, heads_q: int, heads_k: int):
    def call(q, k, v, seqlens, *table):  # a leading problem axis on each; q (P, B, [T,] Hq, D)
        kind = mode(core.NAME)
        problems, batch, heads_q, head_dim = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]  # local pieces' heads
        tokens = q.shape[2] if q.ndim == 5 else 1
        pages, slots, heads_k = k.shape[1], k.shape[2], k.shape[3]
        inputs = [_fold(q), _fold(k), _fold(v), _fold(seqlens)]
        if paged:  # problem i's pages follow the pages of the problems before it in the stacked pool
            offsets = (jnp.arange(problems, dtype=jnp.int32) * pages)[:, None, None]
            inputs.append(_fold(table[0] + offsets))
        capacity = slots * (table[0].shape[2] if paged else 1)
        plan = core.forward(problems * batch, heads_q, heads_k, head_dim, capacity, dtype=dtype_name(q.dtype),
                            scale=scale, target=target(kind), page_size=slots if paged else None,
                            tokens=tokens, cache_dtype=dtype_name(k.dtype), v_scale=v_scale)  # fmt: skip
        (out,) = run_plan(plan, kind, *inputs)
        return [out.reshape(q.shape)]

    kernel = sharding.KERNELS["decode_attention_fwd"](heads_q, heads_k, q_ndim, paged)
    return batched_row_local(core.NAME, call, kernel)


@jit_when_eager("q", "k_cache", "v_cache", "cache_seqlens", "block_table")
def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cache_seqlens: jax.Array,
    block_table: jax.Array | None = None, softmax_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:  # fmt: skip
    """Attention of new tokens, q (B, Hq, D) (one a sequence) or (B, T, Hq, D) (T a sequence, causal among them: token
    t sees cache_seqlens[b] - (T - 1 - t) positions), over the first cache_seqlens[b] (int32 (B,)) positions of each
    sequence's KV cache, their own K / V already written: contiguous k_cache / v_cache (B, Smax, Hk, D), or paged
    (num_blocks, page_size, Hk, D) with block_table (B, max_pages) int32 (position p in page block_table[b, p //
    page_size], slot p % page_size); Hq % Hk == 0; softmax_scale defaults to 1 / sqrt(D). Caches in q's dtype, or
    float8_e4m3fn (NVIDIA sm_89+) holding K / k_scale and V / v_scale (per-tensor scales, static, default 1). Returns
    q's shape and dtype; 0 for a token that sees no position. Not differentiable."""
    core.check(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, k_scale, v_scale)
    paged = block_table is not None
    scale, v_scale = core.options(q, softmax_scale, k_scale, v_scale)
    call = _call(scale, v_scale, paged, q.ndim, q.shape[-2], k_cache.shape[2])
    arrays = (q, k_cache, v_cache, cache_seqlens) + ((block_table,) if paged else ())
    return call(*(a[None] for a in arrays))[0][0]
