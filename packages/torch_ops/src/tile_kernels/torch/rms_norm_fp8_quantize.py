"""torch adapter of tile_kernels.core.rms_norm_fp8_quantize: op tile_kernels::rms_norm_fp8_quantize_fwd (no
autograd)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import rms_norm_fp8_quantize as core

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated
from .norms import NO_TENSOR


def _fwd(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, h or a placeholder). x and the residual are read at their row strides."""
    x, weight = unit_last(x), weight.contiguous()
    (r, k), ldx = x.shape, x.stride(0) if x.shape[0] > 1 else x.shape[1]
    ldr = None
    if residual is not None:
        residual = unit_last(residual)
        ldr = residual.stride(0) if r > 1 else k
    run = executor(core.forward, r, k, dtype=dtype_name(x.dtype), weight_dtype=dtype_name(weight.dtype), eps=eps,
                   target=target(x.device), has_residual=residual is not None, ldx=ldx, ldr=ldr)  # fmt: skip
    outs = run(x, weight, *(() if residual is None else (residual,)), device=x.device)
    return outs[0], outs[1], outs[2] if residual is not None else x.new_empty(NO_TENSOR)


rms_norm_fp8_quantize_fwd = eager_op("rms_norm_fp8_quantize_fwd", _fwd)


def rms_norm_fp8_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """rms_norm's output cast to FP8 in the same pass, fp8_matmul's a: x (R, K) float32 / float16 / bfloat16 with K
    a multiple of 128 up to 16384, weight (K,). Returns codes (R, K) float8_e4m3fn and scales (R, K / 128) float32
    (1 x 128 blocks, scale = amax / 448) of y = rms_norm(x, weight, eps, residual) as rms_norm would return it; with
    residual also h = x + residual. Not differentiable."""
    validated(core.NAME, core.check, ("x", "weight", None, "residual"), x, weight, eps, residual)
    codes, scales, h = rms_norm_fp8_quantize_fwd(x, weight, residual, float(eps))
    return (codes, scales) if residual is None else (codes, scales, h)


register_public_op(
    "rms_norm_fp8_quantize(Tensor x, Tensor weight, float eps=1e-06, Tensor? residual=None) -> Tensor[]",
    lambda x, weight, eps=1e-6, residual=None: list(rms_norm_fp8_quantize(x, weight, eps, residual)),
)
