"""torch adapter of tile_kernels.core.cross_entropy: ops tile_kernels::cross_entropy_fwd / _bwd with autograd."""

from __future__ import annotations

import torch

from tile_kernels.core import cross_entropy as core
from tile_kernels.core import dtype_name

from ._distributed import is_dtensor, replicated
from ._runtime import as_rows, compact_key, compact_run, eager_op, executor, register_public_op, target, validated


def _settings(logits, labels, ignore_index, reduction, label_smoothing):
    return dict(dtype=dtype_name(logits.dtype), target_dtype=dtype_name(labels.dtype), reduction=reduction,
                ignore_index=ignore_index, label_smoothing=label_smoothing, target=target(logits.device))  # fmt: skip


def _fwd(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, lse, count): loss () or (N,) in logits' dtype; lse (N,) and count (1,) fp32 for the backward."""
    rows, classes = logits.shape
    key = compact_key(_fwd, logits, target)
    key = key and (*key, ignore_index, reduction, label_smoothing)
    logits2, run = logits, compact_run(key)
    if run is None:
        logits2, _, stride = as_rows(logits, classes)
        settings = _settings(logits, target, ignore_index, reduction, label_smoothing)
        run = executor(core.forward, 1, rows, classes, stride_row=stride, **settings)
        compact_run(key, run)
    shapes = {"loss": () if reduction != "none" else (rows,), "lse": (rows,)}
    loss, lse, count = run(logits2, target.contiguous(), device=logits.device, shapes=shapes)
    return loss, lse, count


def _bwd(
    dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, count: torch.Tensor,
    ignore_index: int, reduction: str, label_smoothing: float,
) -> torch.Tensor:  # fmt: skip
    rows, classes = logits.shape
    logits2, _, stride = as_rows(logits, classes)
    settings = _settings(logits, target, ignore_index, reduction, label_smoothing)
    run = executor(core.backward, 1, rows, classes, stride_row=stride, **settings)
    inputs = (logits2, target.contiguous(), lse, dloss.contiguous(), count)
    return run(*inputs, device=logits.device, shapes={"dlogits": (rows, classes)})[0]


def _setup_context(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.reduction, ctx.label_smoothing = inputs
    _, lse, count = output
    ctx.save_for_backward(logits, target, lse, count)
    ctx.set_materialize_grads(False)  # lse and count get no zero-filled cotangents


def _backward(ctx, dloss, _dlse, _dcount):
    if dloss is None:  # only lse or count was used: neither is differentiable
        return None, None, None, None, None
    dlogits = cross_entropy_bwd(dloss, *ctx.saved_tensors, ctx.ignore_index, ctx.reduction, ctx.label_smoothing)
    return dlogits, None, None, None, None


cross_entropy_bwd = eager_op("cross_entropy_bwd", _bwd)
cross_entropy_fwd = eager_op("cross_entropy_fwd", _fwd, _setup_context, _backward)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """As F.cross_entropy(logits, target, ...) for 2-D logits (N, V) and integer class targets."""
    validated(core.NAME, core.check, ("logits", "target", None, None, None), logits, target, ignore_index, reduction,
              label_smoothing)  # fmt: skip
    ignore_index = int(ignore_index)
    if reduction == "mean" and is_dtensor(logits):  # rows may be split: the summed loss over the summed count
        loss, _, count = cross_entropy_fwd(logits, target, ignore_index, "sum", float(label_smoothing))
        return (loss.float() / replicated(count.detach().view(()))).to(logits.dtype)  # one all-reduce (the count)
    return cross_entropy_fwd(logits, target, ignore_index, reduction, float(label_smoothing))[0]


register_public_op(
    "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, str reduction='mean', "
    "float label_smoothing=0.0) -> Tensor",
    cross_entropy,
)
