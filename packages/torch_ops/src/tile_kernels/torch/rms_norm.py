"""torch adapter of tile_kernels.core.rms_norm: ops tile_kernels::rms_norm_fwd / rms_norm_bwd with autograd."""

from __future__ import annotations

import torch
from torch.library import triton_op

from tile_kernels.core import dtype_name
from tile_kernels.core import rms_norm as core

from ._runtime import as_rows, check_device, register_public_op, run_plan, target

NO_TENSOR = (0,)  # shape of the placeholder returned for h when there is no residual


@triton_op("tile_kernels::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, h, rstd); h = x + residual, or an empty placeholder when residual is None."""
    n = x.shape[-1]
    x2, stride_x = as_rows(x, n)
    r2, stride_r = as_rows(residual, n) if residual is not None else (None, None)
    plan = core.forward(
        1, x2.shape[0], n, x_dtype=dtype_name(x.dtype), weight_dtype=dtype_name(weight.dtype),
        has_residual=residual is not None, eps=eps, target=target(x.device), stride_x=stride_x,
        stride_residual=stride_r,
    )  # fmt: skip
    outs = run_plan(plan, *(t for t in (x2, weight, r2) if t is not None), device=x.device)
    y, rstd = outs[0].view(x.shape), outs[-1].view(x.shape[:-1])
    h = outs[1].view(x.shape) if residual is not None else x.new_empty(NO_TENSOR)
    return y, h, rstd


@triton_op("tile_kernels::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight); dx is also the residual's gradient. h is the normalized input (x or x + residual)."""
    n = h.shape[-1]
    dy2, stride_dy = as_rows(dy, n)
    h2, stride_h = as_rows(h, n)
    dh2, stride_dh = as_rows(dh, n) if dh is not None else (None, None)
    plan = core.backward(
        1, h2.shape[0], n, x_dtype=dtype_name(h.dtype), weight_dtype=dtype_name(weight.dtype),
        has_dh=dh is not None, target=target(h.device), stride_dy=stride_dy, stride_h=stride_h, stride_dh=stride_dh,
    )  # fmt: skip
    inputs = (dy2, h2, weight, rstd.reshape(-1)) + ((dh2,) if dh is not None else ())
    dx, dweight = run_plan(plan, *inputs, device=h.device)
    return dx.view(h.shape), dweight.view(n)


def _setup_context(ctx, inputs, output):
    x, weight, residual, _ = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)


def _backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_bwd(dy, h, weight, rstd, dh if ctx.has_residual and dh is not None else None)
    return dx, dweight, (dx if ctx.has_residual else None), None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; with residual, h = x + residual and returns (y, h)."""
    core.check(x, weight, residual, eps)
    check_device(core.NAME, x=x, weight=weight, residual=residual)
    y, h, _ = rms_norm_fwd(x, weight, residual, float(eps))
    return y if residual is None else (y, h)


register_public_op(
    "rms_norm(Tensor x, Tensor weight, float eps=1e-06, Tensor? residual=None) -> Tensor[]",
    lambda x, weight, eps=1e-6, residual=None: (
        [rms_norm(x, weight, eps)] if residual is None else list(rms_norm(x, weight, eps, residual))
    ),
)
