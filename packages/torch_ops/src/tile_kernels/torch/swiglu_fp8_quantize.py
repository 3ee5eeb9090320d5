"""torch adapter of tile_kernels.core.swiglu_fp8_quantize: op tile_kernels::swiglu_fp8_quantize_fwd (no autograd)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import swiglu_fp8_quantize as core

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated


def _fwd(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales). gate and up are read at their row strides."""
    gate, up = unit_last(gate), unit_last(up)
    r, k = gate.shape
    run = executor(core.forward, r, k, dtype=dtype_name(gate.dtype), target=target(gate.device),
                   ldg=gate.stride(0) if r > 1 else k, ldu=up.stride(0) if r > 1 else k)  # fmt: skip
    codes, scales = run(gate, up, device=gate.device)
    return codes, scales


swiglu_fp8_quantize_fwd = eager_op("swiglu_fp8_quantize_fwd", _fwd)


def swiglu_fp8_quantize(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """swiglu's output cast to FP8 in the same pass, fp8_matmul's a: gate and up (R, K) float32 / float16 /
    bfloat16, K a multiple of 128. Returns codes (R, K) float8_e4m3fn and scales (R, K / 128) float32 (1 x 128
    blocks, scale = amax / 448) of silu(gate) * up as swiglu would return it. Not differentiable."""
    validated(core.NAME, core.check, ("gate", "up"), gate, up)
    return swiglu_fp8_quantize_fwd(gate, up)


register_public_op("swiglu_fp8_quantize(Tensor gate, Tensor up) -> (Tensor, Tensor)", swiglu_fp8_quantize)
