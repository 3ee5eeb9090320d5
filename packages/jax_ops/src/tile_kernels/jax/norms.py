"""JAX adapter of the norm family (tile_kernels.core.norms): rms_norm and layer_norm, with custom_vjp for grad and
custom_vmap (one launch; per-problem weights and weight gradients) for vmap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import dtype_name, norms
from tile_kernels.core import layer_norm as layer_core
from tile_kernels.core import rms_norm as rms_core

from ._runtime import as_problem, mode, problem_batched, run_plan, target


@functools.cache
def _forward_call(eps: float, is_rms: bool, has_bias: bool, has_residual: bool):
    def call(x3, w2, *rest):  # rest: [bias2], [residual3]
        kind = mode("layer_norm" if not is_rms else "rms_norm")
        batch, rows, n = x3.shape
        if has_bias and rest[0].shape[0] != w2.shape[0]:  # one stride serves both: per-problem for both or neither
            w2, bias2 = (jnp.broadcast_to(p, (batch, n)) for p in (w2, rest[0]))
            rest = (bias2,) + rest[1:]
        plan = norms.forward(
            batch, rows, n, is_rms=is_rms, x_dtype=dtype_name(x3.dtype), weight_dtype=dtype_name(w2.dtype),
            has_residual=has_residual, has_bias=has_bias, eps=eps, target=target(kind),
            weight_batched=w2.shape[0] > 1,
        )  # fmt: skip
        return list(run_plan(plan, kind, x3, w2, *rest))  # y, [h], [mean], rstd

    return problem_batched(call, shareable=(False, True) + (True,) * has_bias + (False,) * has_residual)


@functools.cache
def _backward_call(is_rms: bool, has_bias: bool, has_dh: bool):
    def call(dy3, h3, w2, *stats_and_dh):  # [mean2], rstd2, [dh3]
        kind = mode("layer_norm" if not is_rms else "rms_norm")
        batch, rows, n = h3.shape
        plan = norms.backward(
            batch, rows, n, is_rms=is_rms, x_dtype=dtype_name(h3.dtype), weight_dtype=dtype_name(w2.dtype),
            has_bias=has_bias, has_dh=has_dh, target=target(kind), weight_batched=w2.shape[0] > 1,
        )  # fmt: skip
        return list(run_plan(plan, kind, dy3, h3, w2, *stats_and_dh))  # dx, dweight, [dbias]

    stats = 1 if is_rms else 2
    return problem_batched(call, shareable=(False, False, True) + (False,) * (stats + has_dh))


def _forward(x, weight, bias, residual, eps, is_rms):
    n = x.shape[-1]
    args = [as_problem(x), weight.reshape(1, n)]
    args += ([] if bias is None else [bias.reshape(1, n)]) + ([] if residual is None else [as_problem(residual)])
    outs = _forward_call(eps, is_rms, bias is not None, residual is not None)(*args)
    y = outs[0].reshape(x.shape)
    h = None if residual is None else outs[1].reshape(x.shape)
    stats = tuple(outs[-1:] if is_rms else outs[-2:])  # (rstd,) or (mean, rstd), each (1, rows)
    return (y, h), (x if h is None else h, weight, bias, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _norm(x, weight, bias, residual, eps, is_rms):
    return _forward(x, weight, bias, residual, eps, is_rms)[0]


def _norm_bwd(eps, is_rms, saved, cotangents):
    h, weight, bias, stats = saved
    dy, dh = cotangents
    n = h.shape[-1]
    extra = [] if dh is None else [as_problem(dh)]
    call = _backward_call(is_rms, bias is not None, dh is not None)
    grads = call(as_problem(dy), as_problem(h), weight.reshape(1, n), *stats, *extra)
    dx = grads[0].reshape(h.shape)
    dbias = None if bias is None else grads[2].reshape(bias.shape)
    return dx, grads[1].reshape(weight.shape), dbias, (None if dh is None else dx)


_norm.defvjp(_forward, _norm_bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6, residual: jax.Array | None = None):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; with residual, h = x + residual and returns (y, h)."""
    rms_core.check(x, weight, residual, eps)
    y, h = _norm(x, weight, None, residual, float(eps), True)
    return y if residual is None else (y, h)


def layer_norm(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, eps: float = 1e-5,
    residual: jax.Array | None = None,
):  # fmt: skip
    """Layer norm over the last dim (as F.layer_norm); with residual, h = x + residual and returns (y, h)."""
    layer_core.check(x, weight, bias, eps, residual)
    y, h = _norm(x, weight, bias, residual, float(eps), False)
    return y if residual is None else (y, h)
