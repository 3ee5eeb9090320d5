"""JAX adapter of tile_kernels.core.matmul (no VJP). b, bias and residual are traced operands, activation and
backend are static; a vmap runs its problems one after another (each has its own b). backend="tilelang" runs the
core's compiled_forward (the TileLang Hopper kernel) through `_calls.run_calls`."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import matmul as core

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(activation: str | None, has_bias: bool, has_residual: bool, backend: str = "triton"):
    def call(a, b, *epilogue):
        (m, k), n = a.shape, b.shape[1]
        kind = mode(core.NAME)
        if backend != "triton":  # the TileLang kernel, b row-major
            plan = core.compiled_forward(backend, m, n, k, dtype=dtype_name(a.dtype), b_col=False, arch=cuda_arch(),
                                         target=target(kind), activation=activation, has_bias=has_bias,
                                         has_residual=has_residual)  # fmt: skip
            return list(run_calls(plan, a, b, *epilogue))
        plan = core.forward(m, n, k, dtype=dtype_name(a.dtype), target=target(kind), activation=activation,
                            has_bias=has_bias, has_residual=has_residual)  # fmt: skip
        return list(run_plan(plan, kind, a, b, *epilogue))

    kernel = sharding.KERNELS["matmul_fwd"](has_bias, has_residual)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel))


@jit_when_eager("a", "b", "bias", "residual")
def matmul(
    a: jax.Array, b: jax.Array, bias: jax.Array | None = None, activation: str | None = None,
    residual: jax.Array | None = None, backend: str | None = None,
) -> jax.Array:  # fmt: skip
    """act(a @ b + bias) + residual: a (M, K), b (K, N), bias (N,), residual (M, N), all in a's dtype (float16 /
    bfloat16 / float32); fp32 accumulation, one rounding. activation: None, "silu", "gelu" (erf) or "gelu_tanh".
    Returns (M, N) in a's dtype. backend: "triton", "tilelang" (Hopper; float16 / bfloat16) or None for
    the fastest measured for these inputs on the device (core.preferred_backend). Not differentiable."""
    core.check(a, b, bias, activation, residual)
    backend = resolve_backend(core.NAME, backend, core.preferred_backend, dtype_name(a.dtype), *a.shape, b.shape[1])
    core.check_backend(backend, dtype_name(a.dtype), a.shape[1], b.shape[1])
    arrays = (a, b) + tuple(x for x in (bias, residual) if x is not None)
    return _call(activation, bias is not None, residual is not None, backend)(*arrays)[0]
