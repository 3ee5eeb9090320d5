"""JAX adapter of tile_kernels.core.dequant_matmul (inference: no VJP). qweight, scales and zeros are traced
operands, group_size is static; a vmap runs its problems one after another (each has its own weights)."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dequant_matmul as core
from tile_kernels.core import dtype_name, sharding

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(group_size: int, has_zeros: bool):
    def call(a, qweight, scales, *zeros):
        (m, k), n = a.shape, qweight.shape[1]
        plan = core.forward(m, n, k, dtype=dtype_name(a.dtype), group_size=group_size, has_zeros=has_zeros,
                            target=target(mode(core.NAME)))  # fmt: skip
        return list(run_plan(plan, mode(core.NAME), a, qweight, scales, *zeros))

    kernel = sharding.KERNELS["dequant_matmul_fwd"](has_zeros)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel))


@jit_when_eager("a", "qweight", "scales", "zeros")
def dequant_matmul(
    a: jax.Array, qweight: jax.Array, scales: jax.Array, group_size: int = 128, zeros: jax.Array | None = None
) -> jax.Array:
    """a (M, K) @ W for int4 weights W (K, N): qweight (K / 8, N) int32 packs 8 codes along K (code k = 8 i + j in
    bits 4j .. 4j + 3 of qweight[i, n], GPTQ / AWQ layout), W[k, n] = (code - zeros[g, n]) * scales[g, n] with
    g = k // group_size (zeros = 8 when None); scales / zeros (K / group_size, N) in a's dtype. Returns (M, N) in
    a's dtype. Not differentiable."""
    core.check(a, qweight, scales, group_size, zeros)
    arrays = (a, qweight, scales) + (() if zeros is None else (zeros,))
    return _call(int(group_size), zeros is not None)(*arrays)[0]
