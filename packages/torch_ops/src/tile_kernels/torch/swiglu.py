"""torch adapter of tile_kernels.core.swiglu: ops tile_kernels::swiglu_fwd / swiglu_bwd with autograd."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import swiglu as core

from ._runtime import as_rows, eager_op, executor, register_public_op, target, validated


def _fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    n = gate.shape[-1]
    (g2, rows, stride_g), (u2, _, stride_u) = as_rows(gate, n), as_rows(up, n)
    run = executor(core.forward, rows, n, dtype=dtype_name(gate.dtype), target=target(gate.device),
                   stride_gate=stride_g, stride_up=stride_u)  # fmt: skip
    return run(g2, u2, device=gate.device, shapes={"y": gate})[0]


def _bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = gate.shape[-1]
    (dy2, _, stride_dy), (g2, rows, stride_g), (u2, _, stride_u) = as_rows(dy, n), as_rows(gate, n), as_rows(up, n)
    run = executor(core.backward, rows, n, dtype=dtype_name(gate.dtype), target=target(gate.device),
                   stride_dy=stride_dy, stride_gate=stride_g, stride_up=stride_u)  # fmt: skip
    return run(dy2, g2, u2, device=gate.device, shapes={"dgate": gate, "dup": up})


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    return swiglu_bwd(dy, *ctx.saved_tensors)


swiglu_bwd = eager_op("swiglu_bwd", _bwd)
swiglu_fwd = eager_op("swiglu_fwd", _fwd, _setup_context, _backward)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    validated(core.NAME, core.check, ("gate", "up"), gate, up)
    return swiglu_fwd(gate, up)


register_public_op("swiglu(Tensor gate, Tensor up) -> Tensor", swiglu)
