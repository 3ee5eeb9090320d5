"""torch adapter of tile_kernels.core.grouped_matmul: ops tile_kernels::grouped_matmul_fwd / grouped_matmul_bwd with
autograd. backend="tilelang" runs the forward and the backward through the custom ops
tile_kernels::grouped_matmul_fwd_compiled / grouped_matmul_bwd_compiled (the TileLang Hopper kernel, for the forward
and dx; opaque to torch.compile, with fake implementations)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import grouped_matmul as core

from ._calls import cuda_arch, resolve_backend
from ._runtime import compiled_op, eager_op, executor, register_public_op, target, validated


def _plan(builder, x: torch.Tensor, weights: torch.Tensor, backend: str | None = None):
    """The Executor of `builder`'s plan for these operands: a Triton plan, or with `backend` a compiled one."""
    (t, k), (e, _, n) = x.shape, weights.shape
    settings = dict(dtype=dtype_name(x.dtype), target=target(x.device))
    if backend is None:
        return executor(builder, t, k, n, e, **settings)
    return executor(builder, backend, t, k, n, e, **settings, arch=cuda_arch(x.device))


@compiled_op("grouped_matmul_fwd_compiled")
def grouped_matmul_fwd_compiled(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, backend: str
) -> torch.Tensor:
    """The forward through the TileLang kernel (compact operands: other layouts are copied)."""
    x, weights, group_sizes = x.contiguous(), weights.contiguous(), group_sizes.contiguous()
    return _plan(core.compiled_forward, x, weights, backend)(x, weights, group_sizes, device=x.device)[0]


@grouped_matmul_fwd_compiled.register_fake
def _(x, weights, group_sizes, backend):
    return x.new_empty((x.shape[0], weights.shape[2]))


@compiled_op("grouped_matmul_bwd_compiled")
def grouped_matmul_bwd_compiled(
    dy: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward with dx through the TileLang kernel (dW Triton's; compact operands: other layouts are copied)."""
    dy, x, weights, group_sizes = dy.contiguous(), x.contiguous(), weights.contiguous(), group_sizes.contiguous()
    return _plan(core.compiled_backward, x, weights, backend)(dy, x, weights, group_sizes, device=x.device)


@grouped_matmul_bwd_compiled.register_fake
def _(dy, x, weights, group_sizes, backend):
    return x.new_empty(x.shape), weights.new_empty(weights.shape)


def _fwd(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, backend: str = "triton",
    backward_backend: str = "triton",
) -> torch.Tensor:  # fmt: skip
    """Returns (T, N) in x's dtype. `backend` and `backward_backend` (the backward's) are resolved names
    (tile_kernels.core.backends.resolve)."""
    if backend != "triton":
        return grouped_matmul_fwd_compiled(x, weights, group_sizes, backend)
    x, weights, group_sizes = x.contiguous(), weights.contiguous(), group_sizes.contiguous()
    return _plan(core.forward, x, weights)(x, weights, group_sizes, device=x.device)[0]


def _bwd(
    dy: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dy, x, weights, group_sizes = dy.contiguous(), x.contiguous(), weights.contiguous(), group_sizes.contiguous()
    return _plan(core.backward, x, weights)(dy, x, weights, group_sizes, device=x.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.backend = inputs[4]


def _backward(ctx, dy):
    if ctx.backend == "triton":
        dx, dweights = grouped_matmul_bwd(dy, *ctx.saved_tensors)
    else:
        dx, dweights = grouped_matmul_bwd_compiled(dy, *ctx.saved_tensors, ctx.backend)
    return dx, dweights, None, None, None


grouped_matmul_bwd = eager_op("grouped_matmul_bwd", _bwd)
grouped_matmul_fwd = eager_op("grouped_matmul_fwd", _fwd, _setup_context, _backward)


def grouped_matmul(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, backend: str | None = None
) -> torch.Tensor:
    """MoE expert GEMM: x (T, K) holds the tokens sorted by expert, group e the next group_sizes[e] rows (int32 (E,));
    out[rows of e] = x[rows of e] @ weights[e], weights (E, K, N) in x's dtype. Returns (T, N); rows past the sizes'
    sum are 0 (the sum is not checked: a host sync). Differentiable in x and weights. backend: "triton", "tilelang"
    (Hopper, float16 / bfloat16: the forward and dx; dW on Triton) or None for the fastest measured for these inputs
    on the device, per pass (core.preferred_backend: TileLang on Hopper from 4096 tokens)."""
    _, device = validated(core.NAME, core.check, ("x", "weights", "group_sizes"), x, weights, group_sizes)
    dims = (dtype_name(x.dtype), x.shape[0], *weights.shape[1:])
    forward, backward = (
        resolve_backend(core.NAME, backend, device, core.preferred_backend, *dims, bwd) for bwd in (False, True)
    )
    if forward != "triton":
        core.check_backend(forward, dims[0], *dims[2:], cuda_arch(device))
    return grouped_matmul_fwd(x, weights, group_sizes, forward, backward)


register_public_op(
    "grouped_matmul(Tensor x, Tensor weights, Tensor group_sizes, str? backend=None) -> Tensor", grouped_matmul
)
