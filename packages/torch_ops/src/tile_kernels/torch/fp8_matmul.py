"""torch adapter of tile_kernels.core.fp8_matmul: op tile_kernels::fp8_matmul_fwd (no autograd). backend="tilelang"
runs through the custom op tile_kernels::fp8_matmul_fwd_compiled (the TileLang Hopper kernel; opaque to
torch.compile, with a fake implementation)."""

from __future__ import annotations

import torch

from tile_kernels.core import fp8_matmul as core

from ._calls import cuda_arch, resolve_backend
from ._runtime import compiled_op, eager_op, executor, register_public_op, target, unit_last, validated


@compiled_op("fp8_matmul_fwd_compiled")
def fp8_matmul_fwd_compiled(
    a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, out_dtype: str, backend: str
) -> torch.Tensor:
    """fp8_matmul through the TileLang kernel (compact operands, a_scales row-major: other layouts are copied)."""
    a, a_scales, b, b_scales = (t.contiguous() for t in (a, a_scales, b, b_scales))
    (m, k), n = a.shape, b.shape[0]
    run = executor(core.compiled_forward, backend, m, n, k, out_dtype=out_dtype, arch=cuda_arch(a.device),
                   target=target(a.device))  # fmt: skip
    return run(a, a_scales, b, b_scales, device=a.device)[0]


@fp8_matmul_fwd_compiled.register_fake
def _(a, a_scales, b, b_scales, out_dtype, backend):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=getattr(torch, out_dtype))


def _fwd(
    a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, out_dtype: str,
    backend: str = "triton",
) -> torch.Tensor:  # fmt: skip
    """Returns (M, N) in out_dtype. a and b are read at their row strides, a_scales at its strides (any layout).
    `backend` is a resolved name (tile_kernels.core.backends.resolve)."""
    if backend != "triton":
        return fp8_matmul_fwd_compiled(a, a_scales, b, b_scales, out_dtype, backend)
    a, b, b_scales = unit_last(a), unit_last(b), b_scales.contiguous()
    (m, k), n = a.shape, b.shape[0]
    run = executor(core.forward, m, n, k, out_dtype=out_dtype, target=target(a.device), lda=a.stride(0) if m > 1 else k,
                   ldb=b.stride(0) if n > 1 else k, a_scales_strides=tuple(a_scales.stride()))  # fmt: skip
    return run(a, a_scales, b, b_scales, device=a.device)[0]


fp8_matmul_fwd = eager_op("fp8_matmul_fwd", _fwd)


def fp8_matmul(
    a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
    out_dtype: torch.dtype | str | None = torch.bfloat16, backend: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Block-scaled FP8 GEMM (DeepSeek-V3 layout): out[m, n] = sum_k a[m, k] a_scales[m, k // 128] b[n, k]
    b_scales[n // 128, k // 128]. a (M, K) and b (N, K) float8_e4m3fn (b a Linear weight's layout), a_scales
    (M, K / 128) float32 (row- or column-major), b_scales (N / 128, K / 128) float32; K and N multiples of 128.
    Returns (M, N) in out_dtype (bfloat16 default, float16, float32). backend: "triton", "tilelang" (Hopper) or None
    for the fastest measured for these inputs on the device (core.preferred_backend: TileLang on Hopper from 128
    rows). Not differentiable."""
    out_dtype = core.out_dtype_name(torch.bfloat16 if out_dtype is None else out_dtype)
    _, device = validated(core.NAME, core.check, ("a", "a_scales", "b", "b_scales", None), a, a_scales, b, b_scales,
                          out_dtype)  # fmt: skip
    backend = resolve_backend(core.NAME, backend, device, core.preferred_backend, a.shape[0])
    if backend != "triton":
        core.check_backend(backend, cuda_arch(device))
    return fp8_matmul_fwd(a, a_scales, b, b_scales, out_dtype, backend)


register_public_op(
    "fp8_matmul(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, ScalarType? out_dtype=None, str? backend=None) "
    "-> Tensor",
    fp8_matmul,
)
