"""JAX adapter of tile_kernels.core.flash_attention_varlen: custom_vjp for grad (the forward's lse saved as a
residual), custom_vmap for vmap (the vmapped problems' sequences pack into one call: one launch per kernel).
cu_seqlens are traced operands; max_seqlen and the options are static."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import flash_attention_varlen as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


def _rows(a: jax.Array) -> jax.Array:
    """(P, T, H, D) -> (P * T, H, D): the problems' rows one after another."""
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _offsets(cu: jax.Array, total: int) -> jax.Array:
    """(P, B + 1) offsets of P problems of `total` rows each -> (P * B + 1,) offsets of their sequences packed."""
    if cu.shape[0] == 1:
        return cu[0]
    starts = cu[:, :-1] + (jnp.arange(cu.shape[0], dtype=jnp.int32) * total)[:, None]
    return jnp.concatenate([starts.reshape(-1), jnp.full((1,), cu.shape[0] * total, jnp.int32)])


def _plan(build, q, k, cu, options):
    problems, total_q, heads_q, head_dim = q.shape
    total_k, heads_k = k.shape[1], k.shape[2]
    max_q, max_k, causal, window, scale, softcap = options
    return build(problems * (cu.shape[1] - 1), problems * total_q, problems * total_k, max_q, max_k, heads_q, heads_k,
                 head_dim, dtype=dtype_name(q.dtype), causal=causal, window=window, scale=scale, softcap=softcap,
                 target=target(mode(core.NAME)))  # fmt: skip


@functools.cache
def _forward_call(options: tuple, heads_q: int, heads_k: int):
    def call(q, k, v, cu_q, cu_k):  # q (P, total_q, Hq, D), cu (P, B + 1)
        problems, total_q, hq, _ = q.shape
        plan = _plan(core.forward, q, k, cu_q, options)
        cu = _offsets(cu_q, total_q), _offsets(cu_k, k.shape[1])
        out, lse = run_plan(plan, mode(core.NAME), _rows(q), _rows(k), _rows(v), *cu)
        return [out.reshape(q.shape), lse.reshape(hq, problems, total_q).transpose(1, 0, 2)]

    return batched_row_local(core.NAME, call, sharding.KERNELS["flash_attention_varlen_fwd"](heads_q, heads_k))


@functools.cache
def _backward_call(options: tuple, heads_q: int, heads_k: int):
    def call(dout, q, k, v, out, lse, cu_q, cu_k):  # lse (P, Hq, total_q)
        problems, total_q, hq, _ = q.shape
        plan = _plan(core.backward, q, k, cu_q, options)
        lse = lse.transpose(1, 0, 2).reshape(hq, problems * total_q)
        cu = _offsets(cu_q, total_q), _offsets(cu_k, k.shape[1])
        dq, dk, dv = run_plan(plan, mode(core.NAME), *map(_rows, (q, k, v, out, dout)), lse, *cu)
        return [dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)]

    return batched_row_local(core.NAME, call, sharding.KERNELS["flash_attention_varlen_bwd"](heads_q, heads_k))


def _forward(q, k, v, cu_q, cu_k, options):
    out, lse = _forward_call(options, q.shape[1], k.shape[1])(q[None], k[None], v[None], cu_q[None], cu_k[None])
    return out[0], (q, k, v, cu_q, cu_k, out[0], lse[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _varlen(q, k, v, cu_q, cu_k, options):
    return _forward(q, k, v, cu_q, cu_k, options)[0]


def _varlen_bwd(options, saved, dout):
    q, k, v, cu_q, cu_k, out, lse = saved
    call = _backward_call(options, q.shape[1], k.shape[1])
    dq, dk, dv = call(*(a[None] for a in (dout.astype(q.dtype), q, k, v, out, lse, cu_q, cu_k)))
    return dq[0], dk[0], dv[0], None, None


_varlen.defvjp(_forward, _varlen_bwd)


@jit_when_eager("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
def flash_attention_varlen(
    q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = False, window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> jax.Array:  # fmt: skip
    """flash_attention over B packed sequences: q (total_q, Hq, D), k / v (total_k, Hk, D), sequence b in rows
    [cu_seqlens[b], cu_seqlens[b + 1]) (int32 (B + 1,), from 0 to the total), max_seqlen_* (static) at least every
    sequence's length; causal / window / softmax_scale / softcap as flash_attention's, within each sequence. Returns
    (total_q, Hq, D)."""
    core.check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softmax_scale, softcap)
    causal, window, scale, softcap = core.options(q, causal, window, softmax_scale, softcap)
    options = (int(max_seqlen_q), int(max_seqlen_k), causal, window, scale, softcap)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
