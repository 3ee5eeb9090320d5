"""torch adapter of tile_kernels.core.fused_linear_cross_entropy, with autograd.

Ops: tile_kernels::fused_linear_cross_entropy_fwd (the chunked forward; for sum/mean with gradients wanted it also
returns the unscaled gradients), fused_linear_cross_entropy_bwd (reduction 'none': recomputes the chunks),
fused_linear_cross_entropy_scale_ (sum/mean: scales gradients in place by the cotangent) and the public composite
tile_kernels::fused_linear_cross_entropy, differentiable through `_FusedLinearCrossEntropy`.

Why an autograd.Function and not register_autograd on the _fwd op: the sum/mean backward scales the forward's gradient
buffers in place (a second (V, D) buffer would cost as much as dweight). Those buffers must then be private to the
autograd node. Had the _fwd op's autograd saved its own outputs dhidden / dweight and scaled them, the caller of the
op would see its outputs change after backward in eager mode but not under torch.compile (AOTAutograd functionalizes
the backward's mutation), and opcheck's AOT-dispatch test fails. Here the _fwd op is a plain function (no autograd
formula: backward through it is an error), and the node returns only the loss and the count; the gradient buffers are
its intermediates. The node also leaves autograd nothing to fill with zeros: a cotangent for each (V, D) output that
nobody differentiates would have cost as much as the gradients themselves."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import fused_linear_cross_entropy as core

from ._distributed import is_dtensor, replicated
from ._runtime import eager_op, executor, register_public_op, validated
from ._runtime import target as device_target


def _settings(hidden, labels, ignore_index, chunk_size):
    return dict(dtype=dtype_name(hidden.dtype), target_dtype=dtype_name(labels.dtype), ignore_index=ignore_index,
                chunk_size=chunk_size, target=device_target(hidden.device))  # fmt: skip


def _fwd(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
    chunk_size: int | None, grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (loss, lse, count, dhidden, dweight): loss () or (N,) in float32; lse (N,) and count (1,) fp32;
    for sum/mean the gradients for a unit cotangent where grad_* asks for them, else (0, D) placeholders. Not
    differentiable itself (see the module docstring): the public op is."""
    rows, dim = hidden.shape
    run = executor(core.forward, rows, weight.shape[0], dim, reduction=reduction, grad_hidden=grad_hidden,
                   grad_weight=grad_weight, **_settings(hidden, target, ignore_index, chunk_size))  # fmt: skip
    loss, lse, count, dhidden, dweight = run(hidden, weight, target.contiguous(), device=hidden.device)
    return loss.view(() if reduction != "none" else (rows,)), lse, count, dhidden, dweight


def _bwd(
    dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
    ignore_index: int, chunk_size: int | None, grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reduction 'none': (dhidden, dweight) from the per-row cotangent dloss (N,); (0, D) placeholders where not
    asked for."""
    rows, dim = hidden.shape
    run = executor(core.backward, rows, weight.shape[0], dim, grad_hidden=grad_hidden, grad_weight=grad_weight,
                   **_settings(hidden, target, ignore_index, chunk_size))  # fmt: skip
    inputs = (dloss.float().contiguous(), hidden, weight, target.contiguous(), lse)
    dhidden, dweight = run(*inputs, device=hidden.device)
    return dhidden, dweight


def _scale_(
    dloss: torch.Tensor, count: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, reduction: str
) -> None:
    """Reduction sum/mean: dhidden and dweight *= dloss (sum) or dloss / count (mean), in place."""
    run = executor(core.scale_gradients, dhidden.numel(), dweight.numel(), dtype=dtype_name(dhidden.dtype),
                   reduction=reduction, target=device_target(dhidden.device))  # fmt: skip
    run(dloss.reshape(1).float(), count, dhidden, dweight, device=dhidden.device)


fused_linear_cross_entropy_fwd = eager_op("fused_linear_cross_entropy_fwd", _fwd)
fused_linear_cross_entropy_bwd = eager_op("fused_linear_cross_entropy_bwd", _bwd)
fused_linear_cross_entropy_scale_ = eager_op("fused_linear_cross_entropy_scale_", _scale_,
                                             mutates_args=("dhidden", "dweight"))  # fmt: skip


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """(loss, count) of fused_linear_cross_entropy_fwd, differentiable in hidden and weight (count, the rows that count,
    is not). For sum/mean the forward computes the gradients of a unit cotangent and keeps them (intermediates of this
    node, never handed to the caller); the backward scales them in place and returns them: no second copy, and a
    second backward through the same graph (retain_graph) is refused by torch's saved-tensor version check. For 'none'
    the backward recomputes the chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, chunk_size, grad_hidden, grad_weight):
        ctx.ignore_index, ctx.reduction, ctx.chunk_size = ignore_index, reduction, chunk_size
        fused = reduction != "none"
        loss, lse, count, dhidden, dweight = fused_linear_cross_entropy_fwd(
            hidden, weight, target, ignore_index, reduction, chunk_size, fused and grad_hidden, fused and grad_weight
        )
        ctx.save_for_backward(*((count, dhidden, dweight) if fused else (hidden, weight, target, lse)))
        ctx.mark_non_differentiable(count)
        ctx.set_materialize_grads(False)  # no zeros for count's gradient
        return loss, count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss, _dcount):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if ctx.reduction == "none":
            hidden, weight, target, lse = ctx.saved_tensors
            dhidden, dweight = fused_linear_cross_entropy_bwd(
                dloss, hidden, weight, target, lse, ctx.ignore_index, ctx.chunk_size, want_hidden, want_weight
            )
        else:  # the forward's gradients, scaled in place
            count, dhidden, dweight = ctx.saved_tensors
            fused_linear_cross_entropy_scale_(dloss, count, dhidden, dweight, ctx.reduction)
        return dhidden if want_hidden else None, dweight if want_weight else None, *(None,) * 6


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
    reduction: str = "mean", chunk_size: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """F.cross_entropy(hidden @ weight.T, target, ignore_index=..., reduction=...) for hidden (N, D), weight (V, D)
    and integer targets (N,), computed chunk_size rows at a time (None: a size chosen for the shapes) so that the
    (N, V) logits never exist. Differentiable in hidden and weight. The loss is float32 whatever the inputs' dtype
    (as the loss of logits upcast to float32, which Hugging Face models compute). Under torch.autocast hidden and
    weight are cast to autocast's dtype first, as the unfused `hidden @ weight.T` would be."""
    tensors = isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)  # (else the checks name them)
    if tensors and torch.is_autocast_enabled(hidden.device.type):  # as autocast runs the lm_head's linear
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    validated(core.NAME, core.check, ("hidden", "weight", "target", None, None, None), hidden, weight, target,
              ignore_index, reduction, chunk_size)  # fmt: skip
    grad = torch.is_grad_enabled()
    chunk = None if chunk_size is None else int(chunk_size)
    wants = (grad and hidden.requires_grad, grad and weight.requires_grad)
    summed = reduction == "mean" and is_dtensor(hidden)  # rows may be split: the summed loss over the summed count
    args = (hidden, weight, target, int(ignore_index), "sum" if summed else reduction, chunk)
    if any(wants):
        loss, count = _FusedLinearCrossEntropy.apply(*args, *wants)
    else:  # no graph to record: the forward alone
        loss, _, count, _, _ = fused_linear_cross_entropy_fwd(*args, False, False)
    if summed:
        return loss / replicated(count.detach().view(()))  # one all-reduce (the count)
    return loss


register_public_op(
    "fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, int ignore_index=-100, "
    "str reduction='mean', int? chunk_size=None) -> Tensor",
    fused_linear_cross_entropy,
)
