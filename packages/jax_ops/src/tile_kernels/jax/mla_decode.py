"""JAX adapter of tile_kernels.core.mla_decode (inference: no VJP). cache_seqlens and block_table are traced operands,
softmax_scale and return_lse static; custom_vmap folds a vmapped axis into the batch (one launch per kernel), vmapped
page pools stacked into one, each problem's block table offset to its own pages (as decode_attention's)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import mla_decode as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


def _fold(a):
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


@functools.cache
def _call(scale: float, paged: bool):
    def call(q_nope, q_pe, kv_c, k_pe, seqlens, *table):  # a leading problem axis on each
        kind = mode(core.NAME)
        problems, batch, heads, latent_dim = q_nope.shape
        pages, slots = kv_c.shape[1], kv_c.shape[2]
        inputs = [_fold(a) for a in (q_nope, q_pe, kv_c, k_pe, seqlens)]
        if paged:
            offsets = (jnp.arange(problems, dtype=jnp.int32) * pages)[:, None, None]
            inputs.append(_fold(table[0] + offsets))
        capacity = slots * (table[0].shape[2] if paged else 1)
        plan = core.forward(problems * batch, heads, latent_dim, q_pe.shape[-1], capacity,
                            dtype=dtype_name(q_nope.dtype), scale=scale, target=target(kind),
                            page_size=slots if paged else None)  # fmt: skip
        out, lse = run_plan(plan, kind, *inputs)
        return [out.reshape(q_nope.shape), lse.reshape(q_nope.shape[:-1])]

    return batched_row_local(core.NAME, call, sharding.KERNELS["mla_decode_fwd"](paged))


@jit_when_eager("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table")
def mla_decode(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False):
    """DeepSeek-V3 MLA decode with absorbed weights, one new token a sequence: q_nope (B, H, Dc) and q_pe (B, H, Dr)
    over the first cache_seqlens[b] (int32 (B,)) positions of the latent cache kv_c and the rope keys k_pe,
    contiguous (B, Smax, Dc) / (B, Smax, Dr) or paged (num_blocks, page_size, Dc) / (num_blocks, page_size, Dr)
    with block_table (B, max_pages) int32. scores = (q_nope . kv_c + q_pe . k_pe) * softmax_scale (default
    1 / sqrt(Dc + Dr)), out = softmax(scores) @ kv_c, (B, H, Dc) in q's dtype; with return_lse also the
    log-sum-exp of the scores (B, H) float32, natural log (-inf for an empty sequence, whose output is 0).
    Not differentiable."""
    core.check(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, return_lse)
    paged = block_table is not None
    arrays = (q_nope, q_pe, kv_c, k_pe, cache_seqlens) + ((block_table,) if paged else ())
    out, lse = _call(core.options(q_nope, q_pe, softmax_scale), paged)(*(a[None] for a in arrays))
    return (out[0], lse[0]) if return_lse else out[0]
