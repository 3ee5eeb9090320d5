"""JAX adapter of tile_kernels.core.rms_norm_fp8_quantize (no VJP). eps is static; a vmap runs its problems one
after another."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import rms_norm_fp8_quantize as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(eps: float, has_residual: bool):
    def call(x, *rest):  # the kernel's order: x, [residual], weight
        residual, weight = rest if has_residual else (None, rest[0])
        kind = mode(core.NAME)
        plan = core.forward(*x.shape, dtype=dtype_name(x.dtype), weight_dtype=dtype_name(weight.dtype), eps=eps,
                            target=target(kind), has_residual=has_residual)  # fmt: skip
        return list(run_plan(plan, kind, x, weight, *(() if residual is None else (residual,))))

    kernel = sharding.KERNELS["rms_norm_fp8_quantize_fwd"](has_residual)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel))


@jit_when_eager("x", "weight", "residual")
def rms_norm_fp8_quantize(
    x: jax.Array, weight: jax.Array, eps: float = 1e-6, residual: jax.Array | None = None
) -> tuple[jax.Array, ...]:
    """rms_norm's output cast to FP8 in the same pass, fp8_matmul's a: x (R, K) float32 / float16 / bfloat16 with K
    a multiple of 128 up to 16384, weight (K,). Returns codes (R, K) float8_e4m3fn and scales (R, K / 128) float32
    (1 x 128 blocks, scale = amax / 448) of y = rms_norm(x, weight, eps, residual) as rms_norm would return it; with
    residual also h = x + residual. Not differentiable."""
    core.check(x, weight, eps, residual)
    arrays = (x, weight) if residual is None else (x, residual, weight)
    return tuple(_call(float(eps), residual is not None)(*arrays))
