"""JAX adapter of tile_kernels.core.grouped_matmul: custom_vjp for grad; a vmap runs its problems one after another
(each has its own experts)."""

from __future__ import annotations

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import grouped_matmul as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local, vary_alike


def _call(builder, name: str):
    def call(*arrays):  # forward: x, weights, group_sizes; backward: dy first
        (t, k), (e, _, n) = arrays[-3].shape, arrays[-2].shape
        plan = builder(t, k, n, e, dtype=dtype_name(arrays[-3].dtype), target=target(mode(core.NAME)))
        return list(run_plan(plan, mode(core.NAME), *arrays))

    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, sharding.KERNELS[name]()))


_forward_call = _call(core.forward, "grouped_matmul_fwd")
_backward_call = _call(core.backward, "grouped_matmul_bwd")


@jax.custom_vjp
def _grouped_matmul(x, weights, group_sizes):
    return _forward_call(x, weights, group_sizes)[0]


def _fwd(x, weights, group_sizes):
    return _grouped_matmul(x, weights, group_sizes), (x, weights, group_sizes)


def _bwd(saved, dy):
    dx, dweights = _backward_call(dy, *saved)
    return dx, dweights, None


_grouped_matmul.defvjp(_fwd, _bwd)


@jit_when_eager("x", "weights", "group_sizes")
def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """MoE expert GEMM: x (T, K) holds the tokens sorted by expert, group e the next group_sizes[e] rows (int32 (E,));
    out[rows of e] = x[rows of e] @ weights[e], weights (E, K, N) in x's dtype. Returns (T, N); rows past the sizes'
    sum are 0 (as jax.lax.ragged_dot). Differentiable in x and weights."""
    core.check(x, weights, group_sizes)
    return _grouped_matmul(*vary_alike(x, weights, group_sizes))  # in a shard_map: dx summed over the devices
