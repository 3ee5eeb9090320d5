"""torch adapter of tile_kernels.core.matmul: op tile_kernels::matmul_fwd (no autograd)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import matmul as core

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated


def _operand(t: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """(t', column-major, leading dimension): t read in place when one of its strides is 1 (a transpose such as a
    Linear weight's .t() is column-major), else a row-major copy."""
    rows, cols = t.shape
    if cols == 1 or t.stride(1) == 1:
        return t, False, t.stride(0) if rows > 1 else cols
    if rows == 1 or t.stride(0) == 1:
        return t, True, t.stride(1) if cols > 1 else rows
    return t.contiguous(), False, cols


def _fwd(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Returns (M, N) in a's dtype."""
    (a, a_col, lda), (b, b_col, ldb) = _operand(a), _operand(b)
    inputs = [a, b]
    if bias is not None:
        inputs.append(bias.contiguous())
    ldr = None
    if residual is not None:
        residual = unit_last(residual)
        inputs.append(residual)
        ldr = residual.stride(0) if residual.shape[0] > 1 else residual.shape[1]
    (m, k), n = a.shape, b.shape[1]
    run = executor(core.forward, m, n, k, dtype=dtype_name(a.dtype), target=target(a.device), activation=activation,
                   has_bias=bias is not None, has_residual=residual is not None, a_col=a_col, b_col=b_col, lda=lda,
                   ldb=ldb, ldr=ldr)  # fmt: skip
    return run(*inputs, device=a.device)[0]


matmul_fwd = eager_op("matmul_fwd", _fwd)


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """act(a @ b + bias) + residual: a (M, K), b (K, N) (row- or column-major: `x @ W.t()` reads a Linear weight W
    in place), bias (N,), residual (M, N), all in a's dtype (float16 / bfloat16 / float32); fp32 accumulation, one
    rounding. activation: None, "silu", "gelu" (erf) or "gelu_tanh". Returns (M, N) in a's dtype. Not
    differentiable."""
    validated(core.NAME, core.check, ("a", "b", "bias", None, "residual"), a, b, bias, activation, residual)
    return matmul_fwd(a, b, bias, activation, residual)


register_public_op(
    "matmul(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, Tensor? residual=None) -> Tensor", matmul
)
