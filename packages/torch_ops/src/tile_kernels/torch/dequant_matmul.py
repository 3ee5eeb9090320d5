"""torch adapter of tile_kernels.core.dequant_matmul: op tile_kernels::dequant_matmul_fwd (inference: no autograd).
backend="tilelang" runs through the custom op tile_kernels::dequant_matmul_fwd_compiled (the TileLang Hopper kernel;
opaque to torch.compile, with a fake implementation)."""

from __future__ import annotations

import torch

from tile_kernels.core import dequant_matmul as core
from tile_kernels.core import dtype_name

from ._calls import cuda_arch, resolve_backend
from ._runtime import compiled_op, eager_op, executor, register_public_op, target, unit_last, validated


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


@compiled_op("dequant_matmul_fwd_compiled")
def dequant_matmul_fwd_compiled(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, zeros: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:  # fmt: skip
    """dequant_matmul through the TileLang kernel (compact operands: other layouts are copied)."""
    inputs = [t.contiguous() for t in (a, qweight, scales, zeros) if t is not None]
    (m, k), n = a.shape, qweight.shape[1]
    run = executor(core.compiled_forward, backend, m, n, k, dtype=dtype_name(a.dtype), group_size=group_size,
                   has_zeros=zeros is not None, arch=cuda_arch(a.device),
                   target=target(a.device))  # fmt: skip
    return run(*inputs, device=a.device)[0]


@dequant_matmul_fwd_compiled.register_fake
def _(a, qweight, scales, group_size, zeros, backend):
    return a.new_empty((a.shape[0], qweight.shape[1]))


def _fwd(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, zeros: torch.Tensor | None,
    backend: str = "triton",
) -> torch.Tensor:  # fmt: skip
    """Returns (M, N) in a's dtype. `backend` is a resolved name (tile_kernels.core.backends.resolve)."""
    if backend != "triton":
        return dequant_matmul_fwd_compiled(a, qweight, scales, group_size, zeros, backend)
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
    zeros: torch.Tensor | None = None, backend: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """a (M, K) @ W for int4 weights W (K, N): qweight (K / 8, N) int32 packs 8 codes along K (code k = 8 i + j in
    bits 4j .. 4j + 3 of qweight[i, n], GPTQ / AWQ layout), W[k, n] = (code - zeros[g, n]) * scales[g, n] with
    g = k // group_size (zeros = 8 when None); scales / zeros (K / group_size, N) in a's dtype. Returns (M, N) in
    a's dtype. backend: "triton", "tilelang" (Hopper, prefill sizes; float16 / bfloat16) or None for the device's
    default (Triton). Not differentiable."""
    _, device = validated(core.NAME, core.check, ("a", "qweight", "scales", None, "zeros"), a, qweight, scales,
                          group_size, zeros)  # fmt: skip
    backend = resolve_backend(core.NAME, backend, device)
    if backend != "triton":
        core.check_backend(backend, dtype_name(a.dtype), qweight.shape[1], int(group_size), cuda_arch(device))
    return dequant_matmul_fwd(a, qweight, scales, int(group_size), zeros, backend)


register_public_op(
    "dequant_matmul(Tensor a, Tensor qweight, Tensor scales, int group_size=128, Tensor? zeros=None, "
    "str? backend=None) -> Tensor",
    dequant_matmul,
)
