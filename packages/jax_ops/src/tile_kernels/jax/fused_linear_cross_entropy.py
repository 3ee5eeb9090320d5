"""JAX adapter of tile_kernels.core.fused_linear_cross_entropy: custom_vjp for grad. For sum/mean the forward rule
runs the fused forward (gradients included) and the backward rule only scales them; for 'none' the backward rule
recomputes the chunks. Under vmap the problems run one after the other (each is GEMM-bound already)."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name
from tile_kernels.core import fused_linear_cross_entropy as core

from ._runtime import mode, run_plan, target


def _settings(kind, hidden, labels, ignore_index, chunk_size):
    return dict(dtype=dtype_name(hidden.dtype), target_dtype=dtype_name(labels.dtype), ignore_index=ignore_index,
                chunk_size=chunk_size, target=target(kind))  # fmt: skip


@functools.cache
def _forward_call(ignore_index: int, reduction: str, chunk_size: int | None, grads: bool):
    """(loss, lse, count, dhidden, dweight) as the core forward plan returns them."""

    @jax.custom_batching.sequential_vmap
    def call(hidden, weight, labels):
        kind = mode(core.NAME)
        (rows, dim), classes = hidden.shape, weight.shape[0]
        plan = core.forward(rows, classes, dim, reduction=reduction, grad_hidden=grads, grad_weight=grads,
                            **_settings(kind, hidden, labels, ignore_index, chunk_size))  # fmt: skip
        return list(run_plan(plan, kind, hidden, weight, labels))

    return call


@functools.cache
def _backward_call(ignore_index: int, chunk_size: int | None):
    """Reduction 'none': (dhidden, dweight) from dloss (N,)."""

    @jax.custom_batching.sequential_vmap
    def call(dloss, hidden, weight, labels, lse):
        kind = mode(core.NAME)
        (rows, dim), classes = hidden.shape, weight.shape[0]
        plan = core.backward(rows, classes, dim, grad_hidden=True, grad_weight=True,
                             **_settings(kind, hidden, labels, ignore_index, chunk_size))  # fmt: skip
        return list(run_plan(plan, kind, dloss, hidden, weight, labels, lse))

    return call


@functools.cache
def _scale_call(reduction: str):
    """Reduction sum/mean: the forward's gradients times dloss (or dloss / count)."""

    @jax.custom_batching.sequential_vmap
    def call(dloss, count, dhidden, dweight):
        kind = mode(core.NAME)
        plan = core.scale_gradients(dhidden.size, dweight.size, dtype=dtype_name(dhidden.dtype), reduction=reduction,
                                    target=target(kind))  # fmt: skip
        return list(run_plan(plan, kind, dloss.reshape(1), count, dhidden, dweight))

    return call


def _loss(loss, reduction):
    return loss.reshape(()) if reduction != "none" else loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(hidden, weight, labels, ignore_index, reduction, chunk_size):
    return _loss(_forward_call(ignore_index, reduction, chunk_size, False)(hidden, weight, labels)[0], reduction)


def _fused_fwd(hidden, weight, labels, ignore_index, reduction, chunk_size):
    loss, lse, count, dhidden, dweight = _forward_call(ignore_index, reduction, chunk_size, reduction != "none")(
        hidden, weight, labels
    )
    saved = (hidden, weight, labels, lse) if reduction == "none" else (count, dhidden, dweight)
    return _loss(loss, reduction), saved


def _fused_bwd(ignore_index, reduction, chunk_size, saved, dloss):
    if reduction == "none":
        dhidden, dweight = _backward_call(ignore_index, chunk_size)(dloss, *saved)
    else:
        dhidden, dweight = _scale_call(reduction)(dloss, *saved)
    return dhidden, dweight, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_linear_cross_entropy(
    hidden: jax.Array, weight: jax.Array, target: jax.Array, ignore_index: int = -100, reduction: str = "mean",
    chunk_size: int | None = None,
) -> jax.Array:  # fmt: skip
    """torch.nn.functional.cross_entropy(hidden @ weight.T, target) for hidden (N, D), weight (V, D) and integer
    targets (N,), chunk_size rows at a time (None: chosen for the shapes) so that the (N, V) logits never exist."""
    core.check(hidden, weight, target, ignore_index, reduction, chunk_size)
    chunk = None if chunk_size is None else int(chunk_size)
    return _fused(hidden, weight, target, int(ignore_index), reduction, chunk)
