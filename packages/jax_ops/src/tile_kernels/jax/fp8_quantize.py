"""JAX adapter of tile_kernels.core.fp8_quantize (no VJP). block_rows is static; a vmap runs its problems one after
another."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import fp8_quantize as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


@functools.cache
def _call(block_rows: int):
    def call(x):
        plan = core.forward(*x.shape, dtype=dtype_name(x.dtype), target=target(mode(core.NAME)), block_rows=block_rows)
        return list(run_plan(plan, mode(core.NAME), x))

    kernel = sharding.KERNELS["fp8_quantize_fwd"](block_rows)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel))


@jit_when_eager("x")
def fp8_quantize(x: jax.Array, block_rows: int = 1) -> tuple[jax.Array, jax.Array]:
    """FP8 block quantization, fp8_matmul's input: x (R, K) float32 / float16 / bfloat16, K a multiple of 128, R of
    block_rows. Returns codes (R, K) float8_e4m3fn and scales (R / block_rows, K / 128) float32 with
    x ~= codes * scale per block (block_rows 1: 1 x 128 blocks, an activation's; 128: 128 x 128, a weight's); scale
    = amax / 448. Not differentiable."""
    core.check(x, block_rows)
    codes, scales = _call(block_rows)(x)
    return codes, scales
