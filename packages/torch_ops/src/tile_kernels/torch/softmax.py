"""torch adapter of tile_kernels.core.softmax: ops tile_kernels::softmax_fwd / softmax_bwd with autograd."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import softmax as core

from ._runtime import as_rows, compact_key, compact_run, eager_op, executor, register_public_op, target, validated


def _fwd(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim."""
    key = compact_key(_fwd, x)
    x2, run = x, compact_run(key)
    if run is None:
        n = x.shape[-1]
        x2, rows, stride_x = as_rows(x, n)
        run = executor(core.forward, rows, n, dtype=dtype_name(x.dtype), target=target(x.device), stride_x=stride_x)
        compact_run(key, run)
    return run(x2, device=x.device, shapes={"y": x})[0]


def _bwd(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    key = compact_key(_bwd, y, dy)
    y2, dy2, run = y, dy, compact_run(key)
    if run is None:
        n = y.shape[-1]
        (y2, rows, stride_y), (dy2, _, stride_dy) = as_rows(y, n), as_rows(dy, n)
        run = executor(
            core.backward, rows, n, dtype=dtype_name(y.dtype), target=target(y.device), stride_y=stride_y,
            stride_dy=stride_dy,
        )  # fmt: skip
        compact_run(key, run)
    return run(y2, dy2, device=y.device, shapes={"dx": y})[0]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd(y, dy)


softmax_bwd = eager_op("softmax_bwd", _bwd)
softmax_fwd = eager_op("softmax_fwd", _fwd, _setup_context, _backward)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """As torch.nn.functional.softmax(x, dim); any dim other than the last is moved there and back."""
    dim, _ = validated(core.NAME, core.check, ("x", None), x, dim)
    if x.dim() == 0:
        return softmax_fwd(x.reshape(1)).reshape(())
    last = x.dim() - 1
    if dim == last:
        return softmax_fwd(x)
    return softmax_fwd(x.movedim(dim, last)).movedim(last, dim)


register_public_op("softmax(Tensor x, int dim=-1) -> Tensor", softmax)
