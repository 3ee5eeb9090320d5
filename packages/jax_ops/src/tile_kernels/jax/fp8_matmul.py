"""JAX adapter of tile_kernels.core.fp8_matmul (no VJP). out_dtype and backend are static; a vmap runs its problems
one after another (each has its own b). backend="tilelang" runs the core's compiled_forward (the TileLang Hopper
kernel) through `_calls.run_calls`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import fp8_matmul as core
from tile_kernels.core import sharding

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(out_dtype: str, backend: str = "triton"):
    def call(a, a_scales, b, b_scales):
        (m, k), n = a.shape, b.shape[0]
        kind = mode(core.NAME)
        if backend != "triton":  # the TileLang kernel
            plan = core.compiled_forward(backend, m, n, k, out_dtype=out_dtype, arch=cuda_arch(), target=target(kind))
            return list(run_calls(plan, a, a_scales, b, b_scales))
        plan = core.forward(m, n, k, out_dtype=out_dtype, target=target(kind))
        return list(run_plan(plan, kind, a, a_scales, b, b_scales))

    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, sharding.KERNELS["fp8_matmul_fwd"]()))


@jit_when_eager("a", "a_scales", "b", "b_scales")
def fp8_matmul(
    a: jax.Array, a_scales: jax.Array, b: jax.Array, b_scales: jax.Array, out_dtype=jnp.bfloat16,
    backend: str | None = None,
) -> jax.Array:  # fmt: skip
    """Block-scaled FP8 GEMM (DeepSeek-V3 layout): out[m, n] = sum_k a[m, k] a_scales[m, k // 128] b[n, k]
    b_scales[n // 128, k // 128]. a (M, K) and b (N, K) float8_e4m3fn, a_scales (M, K / 128) and b_scales
    (N / 128, K / 128) float32; K and N multiples of 128. Returns (M, N) in out_dtype (bfloat16 default, float16,
    float32). backend: "triton", "tilelang" (Hopper) or None for the fastest measured for these inputs on the device
    (core.preferred_backend: TileLang on Hopper from 128 rows). Not differentiable."""
    core.check(a, a_scales, b, b_scales, out_dtype)
    backend = resolve_backend(core.NAME, backend, core.preferred_backend, a.shape[0])
    if backend != "triton":
        core.check_backend(backend, cuda_arch())
    return _call(core.out_dtype_name(out_dtype), backend)(a, a_scales, b, b_scales)[0]
