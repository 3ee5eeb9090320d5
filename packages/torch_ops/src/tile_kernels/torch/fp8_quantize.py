"""torch adapter of tile_kernels.core.fp8_quantize: op tile_kernels::fp8_quantize_fwd (no autograd)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import fp8_quantize as core

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated


def _fwd(x: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (codes, scales). x is read at its row stride."""
    x = unit_last(x)
    (r, k), ldx = x.shape, x.stride(0) if x.shape[0] > 1 else x.shape[1]
    run = executor(core.forward, r, k, dtype=dtype_name(x.dtype), target=target(x.device), block_rows=block_rows,
                   ldx=ldx)  # fmt: skip
    codes, scales = run(x, device=x.device)
    return codes, scales


fp8_quantize_fwd = eager_op("fp8_quantize_fwd", _fwd)


def fp8_quantize(x: torch.Tensor, block_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 block quantization, fp8_matmul's input: x (R, K) float32 / float16 / bfloat16, K a multiple of 128, R of
    block_rows. Returns codes (R, K) float8_e4m3fn and scales (R / block_rows, K / 128) float32 with
    x ~= codes * scale per block (block_rows 1: 1 x 128 blocks, an activation's; 128: 128 x 128, a weight's); scale
    = amax / 448. Not differentiable."""
    validated(core.NAME, core.check, ("x", None), x, block_rows)
    return fp8_quantize_fwd(x, block_rows)


register_public_op("fp8_quantize(Tensor x, int block_rows=1) -> (Tensor, Tensor)", fp8_quantize)
