"""JAX adapter of tile_kernels.core.swiglu: custom_vjp for grad, custom_vmap (one launch) for vmap."""

from __future__ import annotations

import math

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import swiglu as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local, vary_alike


def _forward_call(gate, up):  # (problems, ..., n) each
    kind = mode(core.NAME)
    plan = core.forward(math.prod(gate.shape[:-1]), gate.shape[-1], dtype=dtype_name(gate.dtype), target=target(kind))
    return [run_plan(plan, kind, gate, up)[0].reshape(gate.shape)]


def _backward_call(dy, gate, up):
    kind = mode(core.NAME)
    plan = core.backward(math.prod(gate.shape[:-1]), gate.shape[-1], dtype=dtype_name(gate.dtype), target=target(kind))
    return [g.reshape(gate.shape) for g in run_plan(plan, kind, dy, gate, up)]


_forward_batched = batched_row_local(core.NAME, _forward_call, sharding.KERNELS["swiglu_fwd"]())
_backward_batched = batched_row_local(core.NAME, _backward_call, sharding.KERNELS["swiglu_bwd"]())


@jax.custom_vjp
def _swiglu(gate, up):
    return _forward_batched(gate[None], up[None])[0][0]


def _fwd(gate, up):
    return _swiglu(gate, up), (gate, up)


def _bwd(saved, dy):
    gate, up = saved
    dgate, dup = _backward_batched(dy[None], gate[None], up[None])
    return dgate[0], dup[0]


_swiglu.defvjp(_fwd, _bwd)


@jit_when_eager("gate", "up")
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up."""
    core.check(gate, up)
    return _swiglu(*vary_alike(gate, up))
