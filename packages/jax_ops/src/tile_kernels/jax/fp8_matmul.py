"""JAX adapter of tile_kernels.core.fp8_matmul (no VJP). out_dtype is static; a vmap runs its problems one after
another (each has its own b)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import fp8_matmul as core
from tile_kernels.core import sharding

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(out_dtype: str):
    def call(a, a_scales, b, b_scales):
        (m, k), n = a.shape, b.shape[0]
        plan = core.forward(m, n, k, out_dtype=out_dtype, target=target(mode(core.NAME)))
        return list(run_plan(plan, mode(core.NAME), a, a_scales, b, b_scales))

    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, sharding.KERNELS["fp8_matmul_fwd"]()))


@jit_when_eager("a", "a_scales", "b", "b_scales")
def fp8_matmul(
    a: jax.Array, a_scales: jax.Array, b: jax.Array, b_scales: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:  # fmt: skip
    """Block-scaled FP8 GEMM (DeepSeek-V3 layout): out[m, n] = sum_k a[m, k] a_scales[m, k // 128] b[n, k]
    b_scales[n // 128, k // 128]. a (M, K) and b (N, K) float8_e4m3fn, a_scales (M, K / 128) and b_scales
    (N / 128, K / 128) float32; K and N multiples of 128. Returns (M, N) in out_dtype (bfloat16 default, float16,
    float32). Not differentiable."""
    core.check(a, a_scales, b, b_scales, out_dtype)
    return _call(core.out_dtype_name(out_dtype))(a, a_scales, b, b_scales)[0]
