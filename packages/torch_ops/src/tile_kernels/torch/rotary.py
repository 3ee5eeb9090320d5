"""torch adapter of tile_kernels.core.rotary: ops tile_kernels::apply_rotary_fwd / _bwd with autograd."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import rotary as core

from ._runtime import as_rows, eager_op, executor, register_public_op, target, validated


def _rotate(x, cos, sin, interleaved, conjugate):
    batch, seqlen, heads, head_dim = x.shape
    x2, rows, stride = as_rows(x, head_dim)
    per_sequence = cos.dim() == 3  # a table per sequence: a problem per sequence
    problems = batch if per_sequence else 1
    run = executor(
        core.rotate, problems, rows // max(problems, 1), seqlen, heads, head_dim, dtype=dtype_name(x.dtype),
        table_dtype=dtype_name(cos.dtype), interleaved=interleaved, conjugate=conjugate, target=target(x.device),
        stride_x=stride, table_batched=per_sequence,
    )  # fmt: skip
    return run(x2, cos.contiguous(), sin.contiguous(), device=x.device, shapes={"y": x})[0]


def _fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, interleaved, conjugate=False)


def _bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation by the opposite angle."""
    return _rotate(dy, cos, sin, interleaved, conjugate=True)


def _setup_context(ctx, inputs, output):
    _, cos, sin, ctx.interleaved = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dy):
    return apply_rotary_bwd(dy, *ctx.saved_tensors, ctx.interleaved), None, None, None


apply_rotary_bwd = eager_op("apply_rotary_bwd", _bwd)
apply_rotary_fwd = eager_op("apply_rotary_fwd", _fwd, _setup_context, _backward)


def _check(x, cos, sin, interleaved):
    core.check(x, cos, sin, interleaved, per_sequence=True)  # tables may be one a sequence


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of x (B, S, H, D) by cos/sin (S, D/2), or (B, S, D/2) for a table per sequence (positions
    that differ between sequences); GPT-NeoX halves, GPT-J pairs when interleaved."""
    validated(core.NAME, _check, ("x", "cos", "sin", None), x, cos, sin, interleaved)
    return apply_rotary_fwd(x, cos, sin, bool(interleaved))


register_public_op("apply_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor", apply_rotary)
