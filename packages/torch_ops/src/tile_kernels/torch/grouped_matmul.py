"""torch adapter of tile_kernels.core.grouped_matmul: ops tile_kernels::grouped_matmul_fwd / grouped_matmul_bwd with
autograd."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import grouped_matmul as core

from ._runtime import eager_op, executor, register_public_op, target, validated


def _plan(builder, x: torch.Tensor, weights: torch.Tensor):
    (t, k), (e, _, n) = x.shape, weights.shape
    return executor(builder, t, k, n, e, dtype=dtype_name(x.dtype), target=target(x.device))


def _fwd(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    x, weights, group_sizes = x.contiguous(), weights.contiguous(), group_sizes.contiguous()
    return _plan(core.forward, x, weights)(x, weights, group_sizes, device=x.device)[0]


def _bwd(
    dy: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dy, x, weights, group_sizes = dy.contiguous(), x.contiguous(), weights.contiguous(), group_sizes.contiguous()
    return _plan(core.backward, x, weights)(dy, x, weights, group_sizes, device=x.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    dx, dweights = grouped_matmul_bwd(dy, *ctx.saved_tensors)
    return dx, dweights, None


grouped_matmul_bwd = eager_op("grouped_matmul_bwd", _bwd)
grouped_matmul_fwd = eager_op("grouped_matmul_fwd", _fwd, _setup_context, _backward)


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """MoE expert GEMM: x (T, K) holds the tokens sorted by expert, group e the next group_sizes[e] rows (int32 (E,));
    out[rows of e] = x[rows of e] @ weights[e], weights (E, K, N) in x's dtype. Returns (T, N); rows past the sizes'
    sum are 0 (the sum is not checked: a host sync). Differentiable in x and weights."""
    validated(core.NAME, core.check, ("x", "weights", "group_sizes"), x, weights, group_sizes)
    return grouped_matmul_fwd(x, weights, group_sizes)


register_public_op("grouped_matmul(Tensor x, Tensor weights, Tensor group_sizes) -> Tensor", grouped_matmul)
