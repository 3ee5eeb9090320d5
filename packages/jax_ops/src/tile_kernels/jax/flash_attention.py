"""JAX adapter of tile_kernels.core.flash_attention: custom_vjp for grad (the forward's lse saved as a residual),
custom_vmap for vmap (the vmapped axis folds into the batch: one launch per kernel). backend="tilelang" runs the
forward's Plan of Calls (TileLang, through `_calls.run_calls`) in place of the Triton plan, and its backward's for head
dims up to 128 on sm_90a (the Triton backward elsewhere: core.compiled_backward_unsupported). backend=None picks the
forward's and the backward's backends apart (core.preferred_backend), as the torch adapter does: either backward reads
either forward's out and lse."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import flash_attention as core

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


def _problem(a: jax.Array) -> jax.Array:
    """(P, B, S, H, D) -> (P * B, S, H, D): vmapped problems are more batch entries."""
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


@functools.cache
def _forward_call(
    causal: bool, window: tuple[int, int], scale: float, softcap: float, heads_q: int, heads_k: int, backend: str
):  # fmt: skip
    def call(q5, k5, v5):  # (P, B, S, H, D)
        kind = mode(core.NAME)
        problems, batch, seqlen_q, hq, head_dim = q5.shape
        sizes = (problems * batch, seqlen_q, k5.shape[2], hq, k5.shape[3], head_dim)
        options = dict(dtype=dtype_name(q5.dtype), causal=causal, window=window, scale=scale, softcap=softcap)
        if backend != "triton":  # the TileLang forward
            plan = core.compiled_forward(backend, *sizes, **options, arch=cuda_arch())
            out, lse = run_calls(plan, _problem(q5), _problem(k5), _problem(v5))
        else:
            plan = core.forward(*sizes, **options, target=target(kind))
            out, lse = run_plan(plan, kind, _problem(q5), _problem(k5), _problem(v5))
        return [out.reshape(q5.shape), lse.reshape((problems, batch, hq, seqlen_q))]

    return batched_row_local(core.NAME, call, sharding.KERNELS["flash_attention_fwd"](heads_q, heads_k))


@functools.cache
def _backward_call(
    causal: bool, window: tuple[int, int], scale: float, softcap: float, heads_q: int, heads_k: int, backend: str
):  # fmt: skip
    def call(do5, q5, k5, v5, out5, lse4):
        kind = mode(core.NAME)
        problems, batch, seqlen_q, hq, head_dim = q5.shape
        sizes = (problems * batch, seqlen_q, k5.shape[2], hq, k5.shape[3], head_dim)
        options = dict(dtype=dtype_name(q5.dtype), causal=causal, window=window, scale=scale, softcap=softcap)
        lse = lse4.reshape((problems * batch,) + lse4.shape[2:])
        if backend != "triton":  # the TileLang backward
            plan = core.compiled_backward(backend, *sizes, **options, arch=cuda_arch())
            dq, dk, dv = run_calls(plan, *map(_problem, (q5, k5, v5, out5, do5)), lse)
        else:
            plan = core.backward(*sizes, **options, target=target(kind))
            dq, dk, dv = run_plan(plan, kind, *map(_problem, (q5, k5, v5, out5, do5)), lse)
        return [dq.reshape(q5.shape), dk.reshape(k5.shape), dv.reshape(v5.shape)]

    return batched_row_local(core.NAME, call, sharding.KERNELS["flash_attention_bwd"](heads_q, heads_k))


def _options(q, k, causal, window, scale, softcap):
    return causal, window, scale, softcap, q.shape[2], k.shape[2]


def _forward(q, k, v, causal, window, scale, softcap, backend, backward_backend):
    call = _forward_call(*_options(q, k, causal, window, scale, softcap), backend)
    out, lse = call(q[None], k[None], v[None])
    return out[0], (q, k, v, out[0], lse[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _flash_attention(q, k, v, causal, window, scale, softcap, backend, backward_backend):
    return _forward(q, k, v, causal, window, scale, softcap, backend, backward_backend)[0]


def _flash_attention_bwd(causal, window, scale, softcap, _forward_backend, backend, saved, dout):
    q, k, v, out, lse = saved
    arch = cuda_arch() if backend != "triton" else 0
    if core.compiled_backward_unsupported(backend, dtype_name(q.dtype), q.shape[-1], arch):
        backend = "triton"  # the backend's forward with the Triton backward (it reads the same out, lse)
    call = _backward_call(*_options(q, k, causal, window, scale, softcap), backend)
    dq, dk, dv = call(dout.astype(q.dtype)[None], q[None], k[None], v[None], out[None], lse[None])
    return dq[0], dk[0], dv[0]


_flash_attention.defvjp(_forward, _flash_attention_bwd)


@jit_when_eager("q", "k", "v")
def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False, window: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None, softcap: float = 0.0, backend: str | None = None,
) -> jax.Array:  # fmt: skip
    """Attention of q (B, Sq, Hq, D) over k, v (B, Sk, Hk, D), Hq % Hk == 0; causal aligned bottom-right; window
    (left, right) as flash-attn (-1 = unbounded); softmax_scale defaults to 1 / sqrt(D); softcap > 0 caps the scores
    with softcap * tanh(s / softcap). Returns (B, Sq, Hq, D). backend: "triton", "tilelang" (its forward; float16 /
    bfloat16; its backward too on sm_90a for head dims up to 128), or None for the fastest measured for these inputs
    on the device, for the forward and for a backward on its own (core.preferred_backend: they may differ)."""
    core.check(q, k, v, causal, window, softmax_scale, softcap)
    dims = (dtype_name(q.dtype), q.shape[-1])
    backward_backend = backend
    if backend is None:
        backward_backend = resolve_backend(core.NAME, None, core.preferred_backend, *dims, True)
    backend = resolve_backend(core.NAME, backend, core.preferred_backend, *dims)
    causal, window, scale, softcap = core.options(q, causal, window, softmax_scale, softcap, backend)
    return _flash_attention(q, k, v, causal, window, scale, softcap, backend, backward_backend)
