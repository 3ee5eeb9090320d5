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

# kernel-level op -> (its Triton plan, its plan with the TileLang kernel)
_PLANS = {"grouped_matmul_fwd": (core.forward, core.compiled_forward),
          "grouped_matmul_bwd": (core.backward, core.compiled_backward)}  # fmt: skip


@functools.cache
def _call(name: str, backend: str = "triton"):
    triton_plan, compiled_plan = _PLANS[name]

    def call(*arrays):  # forward: x, weights, group_sizes; backward: dy first
        (t, k), (e, _, n) = arrays[-3].shape, arrays[-2].shape
        settings = dict(dtype=dtype_name(arrays[-3].dtype), target=target(mode(core.NAME)))
        if backend != "triton":  # the TileLang forward, or the backward with its dx
            return list(run_calls(compiled_plan(backend, t, k, n, e, **settings, arch=cuda_arch()), *arrays))
        return list(run_plan(triton_plan(t, k, n, e, **settings), mode(core.NAME), *arrays))

    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, sharding.KERNELS[name]()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(x, weights, group_sizes, backend, backward_backend):
    return _call("grouped_matmul_fwd", backend)(x, weights, group_sizes)[0]


def _fwd(x, weights, group_sizes, backend, backward_backend):
    return _grouped_matmul(x, weights, group_sizes, backend, backward_backend), (x, weights, group_sizes)


def _bwd(backend, backward_backend, saved, dy):
    dx, dweights = _call("grouped_matmul_bwd", backward_backend)(dy, *saved)
    return dx, dweights, None


_grouped_matmul.defvjp(_fwd, _bwd)


@jit_when_eager("x", "weights", "group_sizes")
def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, backend: str | None = None) -> jax.Array:
    """MoE expert GEMM: x (T, K) holds the tokens sorted by expert, group e the next group_sizes[e] rows (int32 (E,));
    out[rows of e] = x[rows of e] @ weights[e], weights (E, K, N) in x's dtype. Returns (T, N); rows past the sizes'
    sum are 0 (as jax.lax.ragged_dot). Differentiable in x and weights. backend: "triton", "tilelang" (Hopper,
    float16 / bfloat16: the forward and dx; dW on Triton) or None for the fastest measured for these inputs on the
    device, per pass (core.preferred_backend: TileLang on Hopper from 4096 tokens)."""
    core.check(x, weights, group_sizes)
    dims = (dtype_name(x.dtype), x.shape[0], *weights.shape[1:])
    forward, backward = (
        resolve_backend(core.NAME, backend, core.preferred_backend, *dims, bwd) for bwd in (False, True)
    )
    if forward != "triton":
        core.check_backend(forward, dims[0], *dims[2:], cuda_arch())
    return _grouped_matmul(*vary_alike(x, weights, group_sizes), forward, backward)  # in a shard_map: dx summed
