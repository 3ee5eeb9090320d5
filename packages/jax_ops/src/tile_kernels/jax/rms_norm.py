"""JAX adapter of tile_kernels.core.rms_norm: custom_vjp for grad, custom_vmap (one launch) for vmap."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name
from tile_kernels.core import rms_norm as core

from ._runtime import as_problem, mode, problem_batched, run_plan, target


@functools.cache
def _forward_call(eps: float, has_residual: bool):
    def call(x3, w2, *residual3):
        kind = mode(core.NAME)
        batch, rows, n = x3.shape
        plan = core.forward(
            batch, rows, n, x_dtype=dtype_name(x3.dtype), weight_dtype=dtype_name(w2.dtype),
            has_residual=has_residual, eps=eps, target=target(kind), weight_batched=w2.shape[0] > 1,
        )  # fmt: skip
        return list(run_plan(plan, kind, x3, w2, *residual3))  # y, [h], rstd

    return problem_batched(call, shareable=(False, True, False))


@functools.cache
def _backward_call(has_dh: bool):
    def call(dy3, h3, w2, rstd2, *dh3):
        kind = mode(core.NAME)
        batch, rows, n = h3.shape
        plan = core.backward(
            batch, rows, n, x_dtype=dtype_name(h3.dtype), weight_dtype=dtype_name(w2.dtype), has_dh=has_dh,
            target=target(kind), weight_batched=w2.shape[0] > 1,
        )  # fmt: skip
        return list(run_plan(plan, kind, dy3, h3, w2, rstd2, *dh3))  # dx, dweight

    return problem_batched(call, shareable=(False, False, True, False, False))


def _forward(x, weight, residual, eps):
    n = x.shape[-1]
    args = [as_problem(x), weight.reshape(1, n)] + ([] if residual is None else [as_problem(residual)])
    outs = _forward_call(eps, residual is not None)(*args)
    y = outs[0].reshape(x.shape)
    h = None if residual is None else outs[1].reshape(x.shape)
    return (y, h), (x if h is None else h, weight, outs[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm(x, weight, residual, eps):
    return _forward(x, weight, residual, eps)[0]


def _rms_norm_bwd(eps, saved, cotangents):
    h, weight, rstd = saved
    dy, dh = cotangents
    n = h.shape[-1]
    extra = [] if dh is None else [as_problem(dh)]
    dx, dweight = _backward_call(dh is not None)(as_problem(dy), as_problem(h), weight.reshape(1, n), rstd, *extra)
    dx = dx.reshape(h.shape)
    return dx, dweight.reshape(weight.shape), (None if dh is None else dx)


_rms_norm.defvjp(_forward, _rms_norm_bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6, residual: jax.Array | None = None):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; with residual, h = x + residual and returns (y, h)."""
    core.check(x, weight, residual, eps)
    y, h = _rms_norm(x, weight, residual, float(eps))
    return y if residual is None else (y, h)
