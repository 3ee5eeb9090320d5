"""JAX adapter of tile_kernels.core.mla_decode (inference: no VJP). cache_seqlens and block_table are traced operands,
softmax_scale and return_lse static; custom_vmap folds a vmapped axis into the batch (one launch per kernel), vmapped
page pools stacked into one, each problem's block table offset to its own pages (as decode_attention's).
backend="tilelang" runs the core's compiled_forward (the TileLang split kernel through `_calls.run_calls`, the combine
through jax-triton) in place of the Triton plan."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import mla_decode as core

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


def _fold(a):
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


@functools.cache
def _call(scale: float, paged: bool, backend: str = "triton"):
    def call(q_nope, q_pe, kv_c, k_pe, seqlens, *table):  # a leading problem axis on each
        kind = mode(core.NAME)
        problems, batch, heads, latent_dim = q_nope.shape
        pages, slots = kv_c.shape[1], kv_c.shape[2]
        inputs = [_fold(a) for a in (q_nope, q_pe, kv_c, k_pe, seqlens)]
        if paged:
            offsets = (jnp.arange(problems, dtype=jnp.int32) * pages)[:, None, None]
            inputs.append(_fold(table[0] + offsets))
        capacity = slots * (table[0].shape[2] if paged else 1)
        sizes = (problems * batch, heads, latent_dim, q_pe.shape[-1], capacity)
        options = dict(dtype=dtype_name(q_nope.dtype), scale=scale, target=target(kind),
                       page_size=slots if paged else None)  # fmt: skip
        if backend != "triton":  # the TileLang split kernel
            out, lse = run_calls(core.compiled_forward(backend, *sizes, **options, arch=cuda_arch()), *inputs)
        else:
            out, lse = run_plan(core.forward(*sizes, **options), kind, *inputs)
        return [out.reshape(q_nope.shape), lse.reshape(q_nope.shape[:-1])]

    return batched_row_local(core.NAME, call, sharding.KERNELS["mla_decode_fwd"](paged))


@jit_when_eager("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table")
def mla_decode(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False,
               backend=None):  # fmt: skip
    """DeepSeek-V3 MLA decode with absorbed weights, one new token a sequence: q_nope (B, H, Dc) and q_pe (B, H, Dr)
    over the first cache_seqlens[b] (int32 (B,)) positions of the latent cache kv_c and the rope keys k_pe,
    contiguous (B, Smax, Dc) / (B, Smax, Dr) or paged (num_blocks, page_size, Dc) / (num_blocks, page_size, Dr)
    with block_table (B, max_pages) int32. scores = (q_nope . kv_c + q_pe . k_pe) * softmax_scale (default
    1 / sqrt(Dc + Dr)), out = softmax(scores) @ kv_c, (B, H, Dc) in q's dtype; with return_lse also the
    log-sum-exp of the scores (B, H) float32, natural log (-inf for an empty sequence, whose output is 0).
    backend: "triton", "tilelang" (Hopper; Dc 512, Dr 64, float16 / bfloat16, pages a multiple of 64) or None for
    the fastest measured for these inputs on the device (core.preferred_backend: TileLang where it runs). Not
    differentiable."""
    core.check(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, return_lse)
    paged = block_table is not None
    dims = dtype_name(q_nope.dtype), q_nope.shape[-1], q_pe.shape[-1], kv_c.shape[1] if paged else None
    backend = resolve_backend(core.NAME, backend, core.preferred_backend, *dims)
    arrays = (q_nope, q_pe, kv_c, k_pe, cache_seqlens) + ((block_table,) if paged else ())
    scale = core.options(q_nope, q_pe, softmax_scale, backend, block_table, kv_c)
    out, lse = _call(scale, paged, backend)(*(a[None] for a in arrays))
    return (out[0], lse[0]) if return_lse else out[0]
