"""JAX adapter of the norm family (tile_kernels.core.norms): rms_norm and layer_norm, with custom_vjp for grad and
custom_vmap (one launch; per-problem weights and weight gradients) for vmap. rms_norm's TileLang and CUDA C++ backends
(tile_kernels.core.backends) run their Plans of Calls through `_calls.run_calls` in place of the Triton plans; the
wiring around them is the same."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from tile_kernels.core import dtype_name, norms, sharding
from tile_kernels.core import layer_norm as layer_core
from tile_kernels.core import rms_norm as rms_core

from ._calls import cuda_arch, resolve_backend, run_calls
from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local, vary_alike


def _rows3(a: jax.Array) -> jax.Array:
    """(problems, rows, n) view of (problems, ..., n): the compiled backends' layout."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:-1]), a.shape[-1])


@functools.cache
def _forward_call(eps: float, is_rms: bool, has_bias: bool, has_residual: bool, backend: str):
    def call(x, w2, *rest):  # x (problems, ..., n), w2 (1 or problems, n); rest: [bias2], [residual like x]
        kind = mode("layer_norm" if not is_rms else "rms_norm")
        batch, rows, n = x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1]
        if has_bias and rest[0].shape[0] != w2.shape[0]:  # one stride serves both: per-problem for both or neither
            w2, bias2 = (jnp.broadcast_to(p, (batch, n)) for p in (w2, rest[0]))
            rest = (bias2,) + rest[1:]
        if backend != "triton":  # rms_norm's TileLang / CUDA C++ kernels
            plan = rms_core.compiled_forward(
                backend, batch, rows, n, x_dtype=dtype_name(x.dtype), weight_dtype=dtype_name(w2.dtype),
                has_residual=has_residual, eps=eps, arch=cuda_arch(),
            )  # fmt: skip
            outs = run_calls(plan, _rows3(x), w2, *map(_rows3, rest))  # y, [h], rstd
            return [o.reshape(x.shape if i < 1 + has_residual else x.shape[:-1]) for i, o in enumerate(outs)]
        plan = norms.forward(
            batch, rows, n, is_rms=is_rms, x_dtype=dtype_name(x.dtype), weight_dtype=dtype_name(w2.dtype),
            has_residual=has_residual, has_bias=has_bias, eps=eps, target=target(kind),
            weight_batched=w2.shape[0] > 1,
        )  # fmt: skip
        outs = run_plan(plan, kind, x, w2, *rest)  # y, [h], [mean], rstd
        return [o.reshape(x.shape if i < 1 + has_residual else x.shape[:-1]) for i, o in enumerate(outs)]

    if is_rms:
        kernel = sharding.KERNELS["rms_norm_fwd"](residual=has_residual)
    else:
        kernel = sharding.KERNELS["layer_norm_fwd"](bias=has_bias, residual=has_residual)
    return batched_row_local("rms_norm" if is_rms else "layer_norm", call, kernel, shared=("weight", "bias"))


@functools.cache
def _backward_call(is_rms: bool, has_bias: bool, has_dh: bool, backend: str):
    def call(dy, h, w2, *stats_and_dh):  # [mean], rstd, [dh]
        kind = mode("layer_norm" if not is_rms else "rms_norm")
        batch, rows, n = h.shape[0], math.prod(h.shape[1:-1]), h.shape[-1]
        if backend != "triton":  # rms_norm's TileLang / CUDA C++ kernels; stats_and_dh: rstd, [dh]
            plan = rms_core.compiled_backward(
                backend, batch, rows, n, x_dtype=dtype_name(h.dtype), weight_dtype=dtype_name(w2.dtype),
                has_dh=has_dh, target=target(kind), arch=cuda_arch(),
            )  # fmt: skip
            rstd, *dh = stats_and_dh
            dx, dweight = run_calls(plan, _rows3(dy), _rows3(h), w2, rstd.reshape(batch, rows), *map(_rows3, dh))
            return [dx.reshape(h.shape), dweight]
        plan = norms.backward(
            batch, rows, n, is_rms=is_rms, x_dtype=dtype_name(h.dtype), weight_dtype=dtype_name(w2.dtype),
            has_bias=has_bias, has_dh=has_dh, target=target(kind), weight_batched=w2.shape[0] > 1,
        )  # fmt: skip
        dx, *dparams = run_plan(plan, kind, dy, h, w2, *stats_and_dh)  # dx, dweight, [dbias]
        return [dx.reshape(h.shape), *dparams]

    if is_rms:
        kernel = sharding.KERNELS["rms_norm_bwd"](dh=has_dh)
    else:
        kernel = sharding.KERNELS["layer_norm_bwd"](bias=has_bias, dh=has_dh)
    return batched_row_local("rms_norm" if is_rms else "layer_norm", call, kernel, shared=("weight",))


def _forward(x, weight, bias, residual, eps, is_rms, backend):
    n = x.shape[-1]
    args = [x[None], weight.reshape(1, n)]
    args += ([] if bias is None else [bias.reshape(1, n)]) + ([] if residual is None else [residual[None]])
    outs = _forward_call(eps, is_rms, bias is not None, residual is not None, backend)(*args)
    y = outs[0][0]
    h = None if residual is None else outs[1][0]
    stats = tuple(outs[-1:] if is_rms else outs[-2:])  # (rstd,) or (mean, rstd), each (1, ...)
    return (y, h), (x if h is None else h, weight, bias, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _norm(x, weight, bias, residual, eps, is_rms, backend):
    return _forward(x, weight, bias, residual, eps, is_rms, backend)[0]


def _norm_bwd(eps, is_rms, backend, saved, cotangents):
    h, weight, bias, stats = saved
    dy, dh = cotangents
    n = h.shape[-1]
    extra = [] if dh is None else [dh[None]]
    call = _backward_call(is_rms, bias is not None, dh is not None, backend)
    grads = call(dy[None], h[None], weight.reshape(1, n), *stats, *extra)
    dx = grads[0][0]
    dbias = None if bias is None else grads[2].reshape(bias.shape)
    return dx, grads[1].reshape(weight.shape), dbias, (None if dh is None else dx)


_norm.defvjp(_forward, _norm_bwd)


@jit_when_eager("x", "weight", "residual")
def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float = 1e-6, residual: jax.Array | None = None, backend: str | None = None
):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; with residual, h = x + residual and returns (y, h).
    y and h have x's dtype, whatever weight's float dtype (the math runs in float32).
    backend: "triton", "tilelang", "cuda", or None for the default of the device (tile_kernels.core.backends)."""
    rms_core.check(x, weight, residual, eps)
    backend = resolve_backend(rms_core.NAME, backend)
    x, weight, residual = vary_alike(x, weight, residual)  # in a shard_map: dweight summed over the devices
    y, h = _norm(x, weight, None, residual, float(eps), True, backend)
    return y if residual is None else (y, h)


@jit_when_eager("x", "weight", "bias", "residual")
def layer_norm(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, eps: float = 1e-5,
    residual: jax.Array | None = None,
):  # fmt: skip
    """Layer norm over the last dim (as F.layer_norm); with residual, h = x + residual and returns (y, h).
    y and h have x's dtype, whatever the float dtype of weight and bias (the math runs in float32)."""
    layer_core.check(x, weight, bias, eps, residual)
    x, weight, bias, residual = vary_alike(x, weight, bias, residual)  # in a shard_map: dweight summed
    y, h = _norm(x, weight, bias, residual, float(eps), False, "triton")
    return y if residual is None else (y, h)
