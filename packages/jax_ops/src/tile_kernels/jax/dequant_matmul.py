"""JAX adapter of tile_kernels.core.dequant_matmul (inference: no VJP). qweight, scales and zeros are traced
operands, group_size and backend are static; a vmap runs its problems one after another (each has its own weights).
backend="tilelang" runs the core's compiled_forward (the TileLang Hopper kernel) through `_calls.run_calls`."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dequant_matmul as core
from tile_kernels.core import dtype_name, sharding

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(group_size: int, has_zeros: bool, backend: str = "triton"):
    def call(a, qweight, scales, *zeros):
        (m, k), n = a.shape, qweight.shape[1]
        kind, settings = mode(core.NAME), dict(dtype=dtype_name(a.dtype), group_size=group_size, has_zeros=has_zeros)
        if backend != "triton":  # the TileLang kernel
            plan = core.compiled_forward(backend, m, n, k, **settings, arch=cuda_arch(), target=target(kind))
            return list(run_calls(plan, a, qweight, scales, *zeros))
        plan = core.forward(m, n, k, **settings, target=target(kind))
        return list(run_plan(plan, kind, a, qweight, scales, *zeros))

    kernel = sharding.KERNELS["dequant_matmul_fwd"](has_zeros)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel))


@jit_when_eager("a", "qweight", "scales", "zeros")
def dequant_matmul(
    a: jax.Array, qweight: jax.Array, scales: jax.Array, group_size: int = 128, zeros: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:  # fmt: skip
    """a (M, K) @ W for int4 weights W (K, N): qweight (K / 8, N) int32 packs 8 codes along K (code k = 8 i + j in
    bits 4j .. 4j + 3 of qweight[i, n], GPTQ / AWQ layout), W[k, n] = (code - zeros[g, n]) * scales[g, n] with
    g = k // group_size (zeros = 8 when None); scales / zeros (K / group_size, N) in a's dtype. Returns (M, N) in
    a's dtype. backend: "triton", "tilelang" (Hopper, prefill sizes; float16 / bfloat16) or None for the device's
    default (Triton). Not differentiable."""
    core.check(a, qweight, scales, group_size, zeros)
    backend = resolve_backend(core.NAME, backend)
    if backend != "triton":
        core.check_backend(backend, dtype_name(a.dtype), qweight.shape[1], int(group_size), cuda_arch())
    arrays = (a, qweight, scales) + (() if zeros is None else (zeros,))
    return _call(int(group_size), zeros is not None, backend)(*arrays)[0]
