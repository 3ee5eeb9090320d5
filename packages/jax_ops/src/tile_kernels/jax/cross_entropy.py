"""JAX adapter of tile_kernels.core.cross_entropy: custom_vjp for grad, custom_vmap (one launch, a reduction per
vmapped problem) for vmap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import cross_entropy as core
from tile_kernels.core import dtype_name, sharding

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local, psum


def _settings(kind, logits3, labels2, ignore_index, reduction, label_smoothing):
    return dict(dtype=dtype_name(logits3.dtype), target_dtype=dtype_name(labels2.dtype), reduction=reduction,
                ignore_index=ignore_index, label_smoothing=label_smoothing, target=target(kind))  # fmt: skip


@functools.cache
def _forward_call(ignore_index: int, reduction: str, label_smoothing: float):
    def call(logits3, labels2, reduction=reduction):
        kind = mode(core.NAME)
        batch, rows, classes = logits3.shape
        settings = _settings(kind, logits3, labels2, ignore_index, reduction, label_smoothing)
        return list(run_plan(core.forward(batch, rows, classes, **settings), kind, logits3, labels2))

    def sharded_mean(call, split):
        """Rows split: the mean is the sum of the pieces' sums over the summed count of counted rows (the count goes
        on to the backward, which then needs no communication). Problems split alone need nothing special."""
        axes = split.get("r")
        if not axes:
            return None

        def body(logits3, labels2):
            loss, lse, count = call(logits3, labels2, reduction="sum")
            count = psum(count, axes)
            return [(psum(loss.astype(jnp.float32), axes) / count).astype(loss.dtype), lse, count]

        return body

    kernel = sharding.KERNELS["cross_entropy_fwd"](reduction=reduction)
    return batched_row_local(core.NAME, call, kernel, sharded_body=sharded_mean if reduction == "mean" else None)


@functools.cache
def _backward_call(ignore_index: int, reduction: str, label_smoothing: float):
    def call(dloss, logits3, labels2, lse2, count):
        kind = mode(core.NAME)
        batch, rows, classes = logits3.shape
        settings = _settings(kind, logits3, labels2, ignore_index, reduction, label_smoothing)
        plan = core.backward(batch, rows, classes, **settings)
        return [run_plan(plan, kind, logits3, labels2, lse2, dloss, count)[0]]

    return batched_row_local(core.NAME, call, sharding.KERNELS["cross_entropy_bwd"](reduction=reduction))


def _forward(logits, labels, ignore_index, reduction, label_smoothing):
    loss, lse, count = _forward_call(ignore_index, reduction, label_smoothing)(logits[None], labels[None])
    return loss[0], (logits, labels, lse, count)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _cross_entropy(logits, labels, ignore_index, reduction, label_smoothing):
    return _forward(logits, labels, ignore_index, reduction, label_smoothing)[0]


def _cross_entropy_bwd(ignore_index, reduction, label_smoothing, saved, dloss):
    logits, labels, lse, count = saved
    call = _backward_call(ignore_index, reduction, label_smoothing)
    (dlogits,) = call(dloss.reshape((1,) + dloss.shape), logits[None], labels[None], lse, count)
    return dlogits[0], None


_cross_entropy.defvjp(_forward, _cross_entropy_bwd)


@jit_when_eager("logits", "target")
def cross_entropy(
    logits: jax.Array, target: jax.Array, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> jax.Array:  # fmt: skip
    """As torch.nn.functional.cross_entropy for 2-D logits (N, V) and integer class targets."""
    core.check(logits, target, ignore_index, reduction, label_smoothing)
    return _cross_entropy(logits, target, int(ignore_index), reduction, float(label_smoothing))
