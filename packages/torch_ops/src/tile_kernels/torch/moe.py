"""torch adapter of tile_kernels.core.moe: ops tile_kernels::moe_route_fwd (no autograd), moe_permute_fwd / _bwd and
moe_unpermute_fwd / _bwd with autograd."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import moe as core

from ._runtime import eager_op, executor, register_public_op, target, validated


def _route(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = expert_ids.contiguous()
    positions, group_sizes = executor(core.route, *ids.shape, num_experts, target=target(ids.device))(
        ids, device=ids.device
    )
    return positions, group_sizes


def _permute(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x, positions = x.contiguous(), positions.contiguous()
    run = executor(core.permute, *positions.shape, x.shape[1], dtype=dtype_name(x.dtype), target=target(x.device))
    return run(x, positions, device=x.device)[0]


def _permute_bwd(dxs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    dxs, positions = dxs.contiguous(), positions.contiguous()
    run = executor(core.permute_backward, *positions.shape, dxs.shape[1], dtype=dtype_name(dxs.dtype),
                   target=target(dxs.device))  # fmt: skip
    return run(dxs, positions, device=dxs.device)[0]


def _unpermute_plan(builder, ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor):
    (t, k), (rows, d) = positions.shape, ys.shape
    return executor(builder, t, k, rows, d, dtype=dtype_name(ys.dtype), weights_dtype=dtype_name(weights.dtype),
                    target=target(ys.device))  # fmt: skip


def _unpermute(ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ys, positions, weights = ys.contiguous(), positions.contiguous(), weights.contiguous()
    return _unpermute_plan(core.unpermute, ys, positions, weights)(ys, positions, weights, device=ys.device)[0]


def _unpermute_bwd(
    dout: torch.Tensor, ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dout, ys, positions, weights = (t.contiguous() for t in (dout, ys, positions, weights))
    run = _unpermute_plan(core.unpermute_backward, ys, positions, weights)
    dys, dweights = run(dout, ys, positions, weights, device=ys.device)
    return dys, dweights


def _save_positions(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])  # x is not needed: its gradient sums the rows it was copied to


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _permute_backward(ctx, dxs):
    return moe_permute_bwd(dxs, *ctx.saved_tensors), None


def _unpermute_backward(ctx, dout):
    dys, dweights = moe_unpermute_bwd(dout, *ctx.saved_tensors)
    return dys, None, dweights


moe_route_fwd = eager_op("moe_route_fwd", _route)
moe_permute_bwd = eager_op("moe_permute_bwd", _permute_bwd)
moe_permute_fwd = eager_op("moe_permute_fwd", _permute, _save_positions, _permute_backward)
moe_unpermute_bwd = eager_op("moe_unpermute_bwd", _unpermute_bwd)
moe_unpermute_fwd = eager_op("moe_unpermute_fwd", _unpermute, _save_inputs, _unpermute_backward)


def moe_route(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorts each token's top-k choices expert_ids (T, k) int32 by expert, stably: returns positions (T, k) int32
    (the row of choice (t, j) in expert order; -1 for an id outside [0, num_experts), which is dropped) and
    group_sizes (num_experts,) int32, grouped_matmul's. Not differentiable."""
    validated("moe_route", core.check_route, ("expert_ids", None), expert_ids, num_experts)
    return moe_route_fwd(expert_ids, num_experts)


def moe_permute(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """xs[positions[t, j]] = x[t]: x (T, D) copied to its tokens' k rows in expert order, xs (T k, D) (rows of
    dropped choices 0). Differentiable in x."""
    validated("moe_permute", core.check_permute, ("x", "positions"), x, positions)
    return moe_permute_fwd(x, positions)


def moe_unpermute(ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] ys[positions[t, j]] (dropped choices skipped), fp32 sums: ys (rows, D) in expert
    order back to (T, D) in ys's dtype, weighted by the gates weights (T, k) (float32 or ys's dtype).
    Differentiable in ys and weights."""
    validated("moe_unpermute", core.check_unpermute, ("ys", "positions", "weights"), ys, positions, weights)
    return moe_unpermute_fwd(ys, positions, weights)


register_public_op("moe_route(Tensor expert_ids, int num_experts) -> (Tensor, Tensor)", moe_route)
register_public_op("moe_permute(Tensor x, Tensor positions) -> Tensor", moe_permute)
register_public_op("moe_unpermute(Tensor ys, Tensor positions, Tensor weights) -> Tensor", moe_unpermute)
