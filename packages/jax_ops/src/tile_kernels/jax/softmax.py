"""JAX adapter of tile_kernels.core.softmax: custom_vjp for grad, custom_vmap (one launch) for vmap."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import softmax as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _forward_call(x):  # x (problems, ..., n)
    kind = mode(core.NAME)
    plan = core.forward(_rows(x), x.shape[-1], dtype=dtype_name(x.dtype), target=target(kind))
    return [run_plan(plan, kind, x)[0].reshape(x.shape)]


def _backward_call(y, dy):
    kind = mode(core.NAME)
    plan = core.backward(_rows(y), y.shape[-1], dtype=dtype_name(y.dtype), target=target(kind))
    return [run_plan(plan, kind, y, dy)[0].reshape(y.shape)]


_forward_batched = batched_row_local(core.NAME, _forward_call, sharding.KERNELS["softmax_fwd"]())
_backward_batched = batched_row_local(core.NAME, _backward_call, sharding.KERNELS["softmax_bwd"]())


@jax.custom_vjp
def _softmax_last(x):
    return _forward_batched(x[None])[0][0]


def _fwd(x):
    y = _softmax_last(x)
    return y, y


def _bwd(y, dy):
    return (_backward_batched(y[None], dy[None])[0][0],)


_softmax_last.defvjp(_fwd, _bwd)


@jit_when_eager("x")
def softmax(x: jax.Array, dim: int = -1) -> jax.Array:
    """As jax.nn.softmax(x, axis=dim); any dim other than the last is moved there and back."""
    dim = core.check(x, dim)
    if x.ndim == 0:
        return _softmax_last(x.reshape(1)).reshape(())
    return jnp.moveaxis(_softmax_last(jnp.moveaxis(x, dim, -1)), -1, dim)
