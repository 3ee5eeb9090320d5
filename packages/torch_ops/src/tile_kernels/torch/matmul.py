"""torch adapter of tile_kernels.core.matmul: op tile_kernels::matmul_fwd (no autograd). backend="tilelang" runs
through the custom op tile_kernels::matmul_fwd_compiled (the TileLang Hopper kernel; opaque to torch.compile, with a
fake implementation)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import matmul as core

from ._calls import cuda_arch, resolve_backend
from ._runtime import compiled_op, eager_op, executor, register_public_op, target, unit_last, validated


def _operand(t: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """(t', column-major, leading dimension): t read in place when one of its strides is 1 (a transpose such as a
    Linear weight's .t() is column-major), else a row-major copy."""
    rows, cols = t.shape
    if cols == 1 or t.stride(1) == 1:
        return t, False, t.stride(0) if rows > 1 else cols
    if rows == 1 or t.stride(0) == 1:
        return t, True, t.stride(1) if cols > 1 else rows
    return t.contiguous(), False, cols


@compiled_op("matmul_fwd_compiled")
def matmul_fwd_compiled(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    residual: torch.Tensor | None, backend: str,
) -> torch.Tensor:  # fmt: skip
    """act(a @ b + bias) + residual through the TileLang kernel: b compact (K, N), or the transpose of a compact
    (N, K) (a Linear weight's .t(), read as it is); other layouts are copied."""
    b_col = b.shape[1] > 1 and b.stride(0) == 1 and b.t().is_contiguous()
    a, b = a.contiguous(), b.t() if b_col else b.contiguous()
    (m, k), n = a.shape, b.shape[0] if b_col else b.shape[1]
    run = executor(core.compiled_forward, backend, m, n, k, dtype=dtype_name(a.dtype), b_col=b_col,
                   arch=cuda_arch(a.device), target=target(a.device), activation=activation,
                   has_bias=bias is not None, has_residual=residual is not None)  # fmt: skip
    epilogue = [t.contiguous() for t in (bias, residual) if t is not None]
    return run(a, b, *epilogue, device=a.device)[0]


@matmul_fwd_compiled.register_fake
def _(a, b, bias, activation, residual, backend):
    return a.new_empty((a.shape[0], b.shape[1]))


def _fwd(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    residual: torch.Tensor | None, backend: str = "triton",
) -> torch.Tensor:  # fmt: skip
    """Returns (M, N) in a's dtype. `backend` is a resolved name (tile_kernels.core.backends.resolve)."""
    if backend != "triton":
        return matmul_fwd_compiled(a, b, bias, activation, residual, backend)
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
    residual: torch.Tensor | None = None, backend: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """act(a @ b + bias) + residual: a (M, K), b (K, N) (row- or column-major: `x @ W.t()` reads a Linear weight W
    in place), bias (N,), residual (M, N), all in a's dtype (float16 / bfloat16 / float32); fp32 accumulation, one
    rounding. activation: None, "silu", "gelu" (erf) or "gelu_tanh". Returns (M, N) in a's dtype. backend: "triton",
    "tilelang" (Hopper; float16 / bfloat16) or None for the fastest measured for these inputs
    on the device (core.preferred_backend: TileLang on Hopper where it runs). Not differentiable."""
    _, device = validated(core.NAME, core.check, ("a", "b", "bias", None, "residual"), a, b, bias, activation,
                          residual)  # fmt: skip
    backend = resolve_backend(
        core.NAME, backend, device, core.preferred_backend, dtype_name(a.dtype), *a.shape, b.shape[1]
    )
    if backend != "triton":
        core.check_backend(backend, dtype_name(a.dtype), a.shape[1], b.shape[1])
    return matmul_fwd(a, b, bias, activation, residual, backend)


register_public_op(
    "matmul(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, Tensor? residual=None, str? backend=None) "
    "-> Tensor",
    matmul,
)
