"""JAX adapter of tile_kernels.core.fused_linear_cross_entropy: custom_vjp for grad. For sum/mean the forward rule
runs the fused forward (gradients included) and the backward rule only scales them; for 'none' the backward rule
recomputes the chunks. Under vmap the problems run one after the other (each is GEMM-bound already)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import fused_linear_cross_entropy as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import psum, row_local, vary_alike


def _settings(kind, hidden, labels, ignore_index, chunk_size):
    return dict(dtype=dtype_name(hidden.dtype), target_dtype=dtype_name(labels.dtype), ignore_index=ignore_index,
                chunk_size=chunk_size, target=target(kind))  # fmt: skip


@functools.cache
def _forward_call(ignore_index: int, reduction: str, chunk_size: int | None, grads: bool):
    """(loss, lse, count[, dhidden, dweight]) of the core forward plan, as core.sharding's facts name them: a reduced
    loss 0-d (as torch's op returns it), the gradients only when computed."""

    def call(hidden, weight, labels, reduction=reduction):
        kind = mode(core.NAME)
        (rows, dim), classes = hidden.shape, weight.shape[0]
        plan = core.forward(rows, classes, dim, reduction=reduction, grad_hidden=grads, grad_weight=grads,
                            **_settings(kind, hidden, labels, ignore_index, chunk_size))  # fmt: skip
        loss, lse, count, *gradients = run_plan(plan, kind, hidden, weight, labels)
        return [loss.reshape(()) if reduction != "none" else loss, lse, count, *(gradients if grads else [])]

    def sharded_mean(call, split):
        """Rows split: the mean is the summed loss over the summed count (the count goes on to the backward's
        scaling); the unscaled gradients are those of a sum, dweight's summed over the pieces."""
        axes = split.get("r")
        if not axes:
            return None

        def body(hidden, weight, labels):
            loss, lse, count, *gradients = call(hidden, weight, labels, reduction="sum")
            count = psum(count, axes)
            loss = (psum(loss.astype(jnp.float32), axes) / count[0]).astype(loss.dtype)
            if gradients:  # dweight lacks the rows: the pieces' partial sums add up
                gradients[1] = psum(gradients[1], axes)
            return [loss, lse, count, *gradients]

        return body

    kernel = sharding.KERNELS["fused_linear_cross_entropy_fwd"](reduction, grad_hidden=grads, grad_weight=grads)
    rule = row_local(core.NAME, call, kernel, sharded_body=sharded_mean if reduction == "mean" else None)
    return jax.custom_batching.sequential_vmap(rule)


@functools.cache
def _backward_call(ignore_index: int, chunk_size: int | None):
    """Reduction 'none': (dhidden, dweight) from dloss (N,)."""

    def call(dloss, hidden, weight, labels, lse):
        kind = mode(core.NAME)
        (rows, dim), classes = hidden.shape, weight.shape[0]
        plan = core.backward(rows, classes, dim, grad_hidden=True, grad_weight=True,
                             **_settings(kind, hidden, labels, ignore_index, chunk_size))  # fmt: skip
        return list(run_plan(plan, kind, dloss, hidden, weight, labels, lse))

    kernel = sharding.KERNELS["fused_linear_cross_entropy_bwd"](grad_hidden=True, grad_weight=True)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel))


@functools.cache
def _scale_call(reduction: str):
    """Reduction sum/mean: the forward's gradients times dloss (or dloss / count)."""

    def call(dloss, count, dhidden, dweight):
        kind = mode(core.NAME)
        plan = core.scale_gradients(dhidden.size, dweight.size, dtype=dtype_name(dhidden.dtype), reduction=reduction,
                                    target=target(kind))  # fmt: skip
        return list(run_plan(plan, kind, dloss.reshape(1), count, dhidden, dweight))

    def sharded(call, split):
        """Rows split: dhidden scales by rows; dweight, whole (the forward summed it), in a call of its own, so that
        it stays the same on every device (one call would make it vary with dhidden)."""

        def body(dloss, count, dhidden, dweight):
            empty = jnp.zeros((0, dhidden.shape[1]), dhidden.dtype)
            return [call(dloss, count, dhidden, empty)[0], call(dloss, count, empty, dweight)[1]]

        return body

    kernel = sharding.KERNELS["fused_linear_cross_entropy_scale_"](reduction=reduction)
    return jax.custom_batching.sequential_vmap(row_local(core.NAME, call, kernel, sharded_body=sharded))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(hidden, weight, labels, ignore_index, reduction, chunk_size):
    return _forward_call(ignore_index, reduction, chunk_size, False)(hidden, weight, labels)[0]


def _fused_fwd(hidden, weight, labels, ignore_index, reduction, chunk_size):
    loss, lse, count, *gradients = _forward_call(ignore_index, reduction, chunk_size, reduction != "none")(
        hidden, weight, labels
    )
    saved = (hidden, weight, labels, lse) if reduction == "none" else (count, *gradients)
    return loss, saved


def _fused_bwd(ignore_index, reduction, chunk_size, saved, dloss):
    if reduction == "none":
        dhidden, dweight = _backward_call(ignore_index, chunk_size)(dloss, *saved)
    else:
        dhidden, dweight = _scale_call(reduction)(dloss, *saved)
    return dhidden, dweight, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@jit_when_eager("hidden", "weight", "target")
def fused_linear_cross_entropy(
    hidden: jax.Array, weight: jax.Array, target: jax.Array, ignore_index: int = -100, reduction: str = "mean",
    chunk_size: int | None = None,
) -> jax.Array:  # fmt: skip
    """torch.nn.functional.cross_entropy(hidden @ weight.T, target) for hidden (N, D), weight (V, D) and integer
    targets (N,), chunk_size rows at a time (None: chosen for the shapes) so that the (N, V) logits never exist."""
    core.check(hidden, weight, target, ignore_index, reduction, chunk_size)
    chunk = None if chunk_size is None else int(chunk_size)
    hidden, weight = vary_alike(hidden, weight)  # in a shard_map: dweight summed over the devices
    return _fused(hidden, weight, target, int(ignore_index), reduction, chunk)
