"""torch adapter of tile_kernels.core.fused_linear_cross_entropy, with autograd.

Ops: tile_kernels::fused_linear_cross_entropy_fwd (the chunked forward; for sum/mean with gradients wanted it also
returns the unscaled gradients), fused_linear_cross_entropy_bwd (reduction 'none': recomputes the chunks),
fused_linear_cross_entropy_scale_ (sum/mean: scales the forward's gradients in place by the cotangent) and the public
composite tile_kernels::fused_linear_cross_entropy."""

from __future__ import annotations

import torch
from torch.library import triton_op

from tile_kernels.core import dtype_name
from tile_kernels.core import fused_linear_cross_entropy as core

from ._distributed import is_dtensor, replicated
from ._runtime import check_device, register_public_op, run_plan
from ._runtime import target as device_target


def _settings(hidden, labels, ignore_index, chunk_size):
    return dict(dtype=dtype_name(hidden.dtype), target_dtype=dtype_name(labels.dtype), ignore_index=ignore_index,
                chunk_size=chunk_size, target=device_target(hidden.device))  # fmt: skip


@triton_op("tile_kernels::fused_linear_cross_entropy_fwd", mutates_args=())
def fused_linear_cross_entropy_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
    chunk_size: int | None, grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (loss, lse, count, dhidden, dweight): loss () or (N,) in hidden's dtype; lse (N,) and count (1,) fp32;
    for sum/mean the gradients for a unit cotangent where grad_* asks for them, else (0, D) placeholders."""
    rows, dim = hidden.shape
    plan = core.forward(rows, weight.shape[0], dim, reduction=reduction, grad_hidden=grad_hidden,
                        grad_weight=grad_weight, **_settings(hidden, target, ignore_index, chunk_size))  # fmt: skip
    loss, lse, count, dhidden, dweight = run_plan(plan, hidden, weight, target.contiguous(), device=hidden.device)
    return loss.view(() if reduction != "none" else (rows,)), lse, count, dhidden, dweight


@triton_op("tile_kernels::fused_linear_cross_entropy_bwd", mutates_args=())
def fused_linear_cross_entropy_bwd(
    dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
    ignore_index: int, chunk_size: int | None, grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reduction 'none': (dhidden, dweight) from the per-row cotangent dloss (N,); (0, D) placeholders where not
    asked for."""
    rows, dim = hidden.shape
    plan = core.backward(rows, weight.shape[0], dim, grad_hidden=grad_hidden, grad_weight=grad_weight,
                         **_settings(hidden, target, ignore_index, chunk_size))  # fmt: skip
    inputs = (dloss.contiguous(), hidden, weight, target.contiguous(), lse)
    dhidden, dweight = run_plan(plan, *inputs, device=hidden.device)
    return dhidden, dweight


@triton_op("tile_kernels::fused_linear_cross_entropy_scale_", mutates_args=("dhidden", "dweight"))
def fused_linear_cross_entropy_scale_(
    dloss: torch.Tensor, count: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, reduction: str
) -> None:
    """Reduction sum/mean: dhidden and dweight *= dloss (sum) or dloss / count (mean), in place."""
    plan = core.scale_gradients(dhidden.numel(), dweight.numel(), dtype=dtype_name(dhidden.dtype), reduction=reduction,
                                target=device_target(dhidden.device))  # fmt: skip
    run_plan(plan, dloss.reshape(1), count, dhidden, dweight, device=dhidden.device)


def _setup_context(ctx, inputs, output):
    hidden, weight, target, ctx.ignore_index, ctx.reduction, ctx.chunk_size, *ctx.computed = inputs
    _, lse, count, dhidden, dweight = output
    ctx.mark_non_differentiable(lse, count, dhidden, dweight)  # returned as gradients: they must carry no graph
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, target, lse)
    else:
        ctx.save_for_backward(count, dhidden, dweight)


def _backward(ctx, dloss, _dlse, _dcount, _ddhidden, _ddweight):
    want_hidden, want_weight = ctx.needs_input_grad[:2]
    if ctx.reduction == "none":
        hidden, weight, target, lse = ctx.saved_tensors
        dhidden, dweight = fused_linear_cross_entropy_bwd(
            dloss, hidden, weight, target, lse, ctx.ignore_index, ctx.chunk_size, want_hidden, want_weight
        )
    else:  # the forward computed them; scaled in place: no second (V, D) buffer
        if (want_hidden and not ctx.computed[0]) or (want_weight and not ctx.computed[1]):
            raise RuntimeError(
                f"{core.NAME}_fwd was called with grad_hidden={ctx.computed[0]}, grad_weight={ctx.computed[1]}, but "
                f"autograd needs (hidden, weight) = {(want_hidden, want_weight)}: call the public op, which sets them"
            )
        count, dhidden, dweight = ctx.saved_tensors
        fused_linear_cross_entropy_scale_(dloss, count, dhidden, dweight, ctx.reduction)
    return dhidden if want_hidden else None, dweight if want_weight else None, None, None, None, None, None, None


fused_linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
    reduction: str = "mean", chunk_size: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """F.cross_entropy(hidden @ weight.T, target, ignore_index=..., reduction=...) for hidden (N, D), weight (V, D)
    and integer targets (N,), computed chunk_size rows at a time (None: a size chosen for the shapes) so that the
    (N, V) logits never exist. Differentiable in hidden and weight."""
    core.check(hidden, weight, target, ignore_index, reduction, chunk_size)
    check_device(core.NAME, hidden=hidden, weight=weight, target=target)
    grad = torch.is_grad_enabled()
    chunk = None if chunk_size is None else int(chunk_size)
    wants = (grad and hidden.requires_grad, grad and weight.requires_grad)
    if reduction == "mean" and is_dtensor(hidden):  # rows may be split: the summed loss over the summed count
        loss, _, count, _, _ = fused_linear_cross_entropy_fwd(hidden, weight, target, int(ignore_index), "sum", chunk,
                                                              *wants)  # fmt: skip
        return (loss.float() / replicated(count.detach().view(()))).to(hidden.dtype)  # one all-reduce (the count)
    return fused_linear_cross_entropy_fwd(hidden, weight, target, int(ignore_index), reduction, chunk, *wants)[0]


register_public_op(
    "fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, int ignore_index=-100, "
    "str reduction='mean', int? chunk_size=None) -> Tensor",
    fused_linear_cross_entropy,
)
