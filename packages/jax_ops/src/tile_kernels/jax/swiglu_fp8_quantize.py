"""JAX adapter of tile_kernels.core.swiglu_fp8_quantize (no VJP); a vmap runs its problems one after another."""

from __future__ import annotations

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import swiglu_fp8_quantize as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local


def _call(gate, up):
    kind = mode(core.NAME)
    plan = core.forward(*gate.shape, dtype=dtype_name(gate.dtype), target=target(kind))
    return list(run_plan(plan, kind, gate, up))


_batched = jax.custom_batching.sequential_vmap(
    row_local(core.NAME, _call, sharding.KERNELS["swiglu_fp8_quantize_fwd"]())
)


@jit_when_eager("gate", "up")
def swiglu_fp8_quantize(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """swiglu's output cast to FP8 in the same pass, fp8_matmul's a: gate and up (R, K) float32 / float16 /
    bfloat16, K a multiple of 128. Returns codes (R, K) float8_e4m3fn and scales (R, K / 128) float32 (1 x 128
    blocks, scale = amax / 448) of silu(gate) * up as swiglu would return it. Not differentiable."""
    core.check(gate, up)
    codes, scales = _batched(gate, up)
    return codes, scales
