"""JAX adapter of tile_kernels.core.swiglu: custom_vjp for grad, custom_vmap (one launch) for vmap."""

from __future__ import annotations

import jax

from tile_kernels.core import dtype_name
from tile_kernels.core import swiglu as core

from ._runtime import as_problem, mode, problem_batched, run_plan, target


def _forward_call(gate3, up3):
    kind = mode(core.NAME)
    batch, rows, n = gate3.shape
    plan = core.forward(batch * rows, n, dtype=dtype_name(gate3.dtype), target=target(kind))
    return [run_plan(plan, kind, gate3, up3)[0].reshape(gate3.shape)]


def _backward_call(dy3, gate3, up3):
    kind = mode(core.NAME)
    batch, rows, n = gate3.shape
    plan = core.backward(batch * rows, n, dtype=dtype_name(gate3.dtype), target=target(kind))
    return [g.reshape(gate3.shape) for g in run_plan(plan, kind, dy3, gate3, up3)]


_forward_batched = problem_batched(_forward_call, shareable=(False, False))
_backward_batched = problem_batched(_backward_call, shareable=(False, False, False))


@jax.custom_vjp
def _swiglu(gate, up):
    return _forward_batched(as_problem(gate), as_problem(up))[0].reshape(gate.shape)


def _fwd(gate, up):
    return _swiglu(gate, up), (gate, up)


def _bwd(saved, dy):
    gate, up = saved
    dgate, dup = _backward_batched(as_problem(dy), as_problem(gate), as_problem(up))
    return dgate.reshape(gate.shape), dup.reshape(up.shape)


_swiglu.defvjp(_fwd, _bwd)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up."""
    core.check(gate, up)
    return _swiglu(gate, up)
