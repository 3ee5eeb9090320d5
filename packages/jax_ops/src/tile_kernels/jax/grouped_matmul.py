"""JAX adapter of tile_kernels.core.grouped_matmul: custom_vjp for grad; a vmap runs its problems one after another
(each has its own experts)."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import grouped_matmul as core

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import row_local, vary_alike


@functools.cache
def _call(builder, name: str, backend: str = "triton"):
    def call(*arrays):  # forward: x, weights, group_sizes; backward: dy first
        (t, k), (e, _, n) = arrays[-3].shape, arrays[-2].shape
        settings = dict(dtype=dtype_name(arrays[-3].dtype), target=target(mode(core.NAME)))
        if backend != "triton":  # the TileLang forward
            return list(run_calls(core.compiled_forward(backend, t, k, n, e, **settings, arch=cuda_arch()), *arrays))
        return list(run_plan(builder(t, k, n, e, **settings), mode(core.NAME), *arrays))

    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, sharding.KERNELS[name]()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x, weights, group_sizes, backend):
    return _call(core.forward, "grouped_matmul_fwd", backend)(x, weights, group_sizes)[0]


def _fwd(x, weights, group_sizes, backend):
    return _grouped_matmul(x, weights, group_sizes, backend), (x, weights, group_sizes)


def _bwd(backend, saved, dy):
    dx, dweights = _call(core.backward, "grouped_matmul_bwd")(dy, *saved)
    return dx, dweights, None


_grouped_matmul.defvjp(_fwd, _bwd)


@jit_when_eager("x", "weights", "group_sizes")
def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, backend: str | None = None) -> jax.Array:
    """MoE expert GEMM: x (T, K) holds the tokens sorted by expert, group e the next group_sizes[e] rows (int32 (E,));
    out[rows of e] = x[rows of e] @ weights[e], weights (E, K, N) in x's dtype. Returns (T, N); rows past the sizes'
    sum are 0 (as jax.lax.ragged_dot). Differentiable in x and weights. backend: "triton", "tilelang" (Hopper
    forward, float16 / bfloat16; Triton backward) or None for the fastest measured for these inputs on the device
    (core.preferred_backend: TileLang on Hopper from 4096 tokens where N > K)."""
    core.check(x, weights, group_sizes)
    backend = resolve_backend(
        core.NAME, backend, core.preferred_backend, dtype_name(x.dtype), x.shape[0], *weights.shape[1:]
    )
    if backend != "triton":
        core.check_backend(backend, dtype_name(x.dtype), weights.shape[1], weights.shape[2], cuda_arch())
    return _grouped_matmul(*vary_alike(x, weights, group_sizes), backend)  # in a shard_map: dx summed over devices
