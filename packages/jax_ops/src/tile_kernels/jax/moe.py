"""JAX adapter of tile_kernels.core.moe: moe_route (no VJP), moe_permute and moe_unpermute with custom_vjp; a vmap
runs its problems one after another."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import moe as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local, vary_alike


def _kernel_call(kernel: str, plan_of):
    """The call of sharding.KERNELS[kernel], its plan built by plan_of(arrays, target)."""

    def call(*arrays):
        return list(run_plan(plan_of(arrays, target(mode(kernel))), mode(kernel), *arrays))

    return jax.custom_batching.sequential_vmap(row_local(kernel, call, sharding.KERNELS[kernel]()))


@functools.cache
def _route_call(num_experts: int):
    return _kernel_call("moe_route_fwd", lambda a, tgt: core.route(*a[0].shape, num_experts, target=tgt))


def _unpermute_plan(builder, ys, positions, weights, tgt):
    return builder(*positions.shape, *ys.shape, dtype=dtype_name(ys.dtype), weights_dtype=dtype_name(weights.dtype),
                   target=tgt)  # fmt: skip


_permute_fwd = _kernel_call(
    "moe_permute_fwd", lambda a, tgt: core.permute(*a[1].shape, a[0].shape[1], dtype=dtype_name(a[0].dtype), target=tgt)
)
_permute_bwd = _kernel_call(
    "moe_permute_bwd",
    lambda a, tgt: core.permute_backward(*a[1].shape, a[0].shape[1], dtype=dtype_name(a[0].dtype), target=tgt),
)
_unpermute_fwd = _kernel_call("moe_unpermute_fwd", lambda a, tgt: _unpermute_plan(core.unpermute, *a, tgt))
_unpermute_bwd = _kernel_call("moe_unpermute_bwd", lambda a, tgt: _unpermute_plan(core.unpermute_backward, *a[1:], tgt))


@jax.custom_vjp
def _permute(x, positions):
    return _permute_fwd(x, positions)[0]


_permute.defvjp(lambda x, positions: (_permute(x, positions), positions),
                lambda positions, dxs: (_permute_bwd(dxs, positions)[0], None))  # fmt: skip


@jax.custom_vjp
def _unpermute(ys, positions, weights):
    return _unpermute_fwd(ys, positions, weights)[0]


def _unpermute_vjp_bwd(saved, dout):
    dys, dweights = _unpermute_bwd(dout, *saved)
    return dys, None, dweights


_unpermute.defvjp(lambda *args: (_unpermute(*args), args), _unpermute_vjp_bwd)


@jit_when_eager("expert_ids")
def moe_route(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Sorts each token's top-k choices expert_ids (T, k) int32 by expert, stably: returns positions (T, k) int32
    (the row of choice (t, j) in expert order; -1 for an id outside [0, num_experts), which is dropped) and
    group_sizes (num_experts,) int32, grouped_matmul's. Not differentiable."""
    core.check_route(expert_ids, num_experts)
    positions, group_sizes = _route_call(num_experts)(expert_ids)
    return positions, group_sizes


@jit_when_eager("x", "positions")
def moe_permute(x: jax.Array, positions: jax.Array) -> jax.Array:
    """xs[positions[t, j]] = x[t]: x (T, D) copied to its tokens' k rows in expert order, xs (T k, D) (rows of
    dropped choices 0). Differentiable in x."""
    core.check_permute(x, positions)
    return _permute(*vary_alike(x, positions))


@jit_when_eager("ys", "positions", "weights")
def moe_unpermute(ys: jax.Array, positions: jax.Array, weights: jax.Array) -> jax.Array:
    """out[t] = sum_j weights[t, j] ys[positions[t, j]] (dropped choices skipped), fp32 sums: ys (rows, D) in expert
    order back to (T, D) in ys's dtype, weighted by the gates weights (T, k) (float32 or ys's dtype).
    Differentiable in ys and weights."""
    core.check_unpermute(ys, positions, weights)
    return _unpermute(*vary_alike(ys, positions, weights))
