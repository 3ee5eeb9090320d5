"""JAX adapter of tile_kernels.core.softmax: custom_vjp for grad, custom_vmap (one launch) for vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tile_kernels.core import dtype_name
from tile_kernels.core import softmax as core

from ._runtime import as_problem, mode, problem_batched, run_plan, target


def _forward_call(x3):
    kind = mode(core.NAME)
    batch, rows, n = x3.shape
    plan = core.forward(batch * rows, n, dtype=dtype_name(x3.dtype), target=target(kind))
    return [run_plan(plan, kind, x3)[0].reshape(x3.shape)]


def _backward_call(y3, dy3):
    kind = mode(core.NAME)
    batch, rows, n = y3.shape
    plan = core.backward(batch * rows, n, dtype=dtype_name(y3.dtype), target=target(kind))
    return [run_plan(plan, kind, y3, dy3)[0].reshape(y3.shape)]


_forward_batched = problem_batched(_forward_call, shareable=(False,))
_backward_batched = problem_batched(_backward_call, shareable=(False, False))


@jax.custom_vjp
def _softmax_last(x):
    return _forward_batched(as_problem(x))[0].reshape(x.shape)


def _fwd(x):
    y = _softmax_last(x)
    return y, y


def _bwd(y, dy):
    return (_backward_batched(as_problem(y), as_problem(dy))[0].reshape(y.shape),)


_softmax_last.defvjp(_fwd, _bwd)


def softmax(x: jax.Array, dim: int = -1) -> jax.Array:
    """As jax.nn.softmax(x, axis=dim); any dim other than the last is moved there and back."""
    dim = core.check(x, dim)
    if x.ndim == 0:
        return _softmax_last(x.reshape(1)).reshape(())
    return jnp.moveaxis(_softmax_last(jnp.moveaxis(x, dim, -1)), -1, dim)
