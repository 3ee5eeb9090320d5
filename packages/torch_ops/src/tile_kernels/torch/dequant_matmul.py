"""torch adapter of tile_kernels.core.dequant_matmul: op tile_kernels::dequant_matmul_fwd (inference: no autograd)."""

from __future__ import annotations

import torch

from tile_kernels.core import dequant_matmul as core
from tile_kernels.core import dtype_name

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _fwd(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, zeros: torch.Tensor | None
) -> torch.Tensor:
    """Returns (M, N) in a's dtype."""
    a, qweight, scales = unit_last(a), unit_last(qweight), unit_last(scales)
    inputs = [a, qweight, scales]
    strides = dict(stride_a=_row_stride(a), stride_qw=_row_stride(qweight), stride_s=_row_stride(scales))
    if zeros is not None:
        zeros = unit_last(zeros)
        inputs.append(zeros)
        strides["stride_z"] = _row_stride(zeros)
    (m, k), n = a.shape, qweight.shape[1]
    run = executor(core.forward, m, n, k, dtype=dtype_name(a.dtype), group_size=group_size,
                   has_zeros=zeros is not None, target=target(a.device), **strides)  # fmt: skip
    return run(*inputs, device=a.device)[0]


dequant_matmul_fwd = eager_op("dequant_matmul_fwd", _fwd)


def dequant_matmul(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int = 128,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """a (M, K) @ W for int4 weights W (K, N): qweight (K / 8, N) int32 packs 8 codes along K (code k = 8 i + j in
    bits 4j .. 4j + 3 of qweight[i, n], GPTQ / AWQ layout), W[k, n] = (code - zeros[g, n]) * scales[g, n] with
    g = k // group_size (zeros = 8 when None); scales / zeros (K / group_size, N) in a's dtype. Returns (M, N) in
    a's dtype. Not differentiable."""
    validated(core.NAME, core.check, ("a", "qweight", "scales", None, "zeros"), a, qweight, scales, group_size, zeros)
    return dequant_matmul_fwd(a, qweight, scales, int(group_size), zeros)


register_public_op(
    "dequant_matmul(Tensor a, Tensor qweight, Tensor scales, int group_size=128, Tensor? zeros=None) -> Tensor",
    dequant_matmul,
)
