"""torch adapter of tile_kernels.core.swiglu: ops tile_kernels::swiglu_fwd / swiglu_bwd with autograd, and
swiglu_bwd_ (the backward written over its inputs) for swiglu_over_inputs."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import swiglu as core

from ._runtime import as_rows, eager_op, executor, plain_eager, register_public_op, target, validated


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


def _bwd_over_inputs(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """dgate written over gate and dup over up (both contiguous)."""
    n = gate.shape[-1]
    dy2, rows, stride_dy = as_rows(dy, n)
    run = executor(core.backward, rows, n, dtype=dtype_name(gate.dtype), target=target(gate.device),
                   stride_dy=stride_dy, over_inputs=True)  # fmt: skip
    run(dy2, gate, up, device=gate.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    return swiglu_bwd(dy, *ctx.saved_tensors)


swiglu_bwd = eager_op("swiglu_bwd", _bwd)
swiglu_fwd = eager_op("swiglu_fwd", _fwd, _setup_context, _backward)
swiglu_bwd_ = eager_op("swiglu_bwd_", _bwd_over_inputs, mutates_args=("gate", "up"))


class _SwiGLUOverInputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _fwd(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        swiglu_bwd_(dy, gate, up)
        return tuple(t.detach() if wanted else None for t, wanted in zip((gate, up), ctx.needs_input_grad))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    validated(core.NAME, core.check, ("gate", "up"), gate, up)
    return swiglu_fwd(gate, up)


def swiglu_over_inputs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """swiglu(gate, up) for a gate and an up that nothing reads afterwards (a module's intermediates, as in
    nn.SwiGLUMLP): the backward writes dgate and dup over them, so the backward's peak holds no second (rows, n)
    pair (448 MiB for a Llama-8B MLP on 8192 bf16 tokens). Plain eager calls with contiguous inputs in two storages
    and a gradient wanted; swiglu otherwise. A second backward through the graph is refused (autograd's saved-tensor
    check)."""
    grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if (grad and plain_eager(gate, up) and gate.is_contiguous() and up.is_contiguous()
            and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()):  # fmt: skip
        validated(core.NAME, core.check, ("gate", "up"), gate, up)
        return _SwiGLUOverInputs.apply(gate, up)
    return swiglu(gate, up)


register_public_op("swiglu(Tensor gate, Tensor up) -> Tensor", swiglu)
