"""JAX adapter of tile_kernels.core.rotary: custom_vjp for grad, custom_vmap (one launch; shared or per-example
cos/sin) for vmap."""

from __future__ import annotations

import functools

import jax

from tile_kernels.core import dtype_name, sharding
from tile_kernels.core import rotary as core

from ._runtime import jit_when_eager, mode, run_plan, target
from ._sharding import batched_row_local


@functools.cache
def _rotate_call(interleaved: bool, conjugate: bool):
    def call(x5, cos3, sin3):  # x5 (problems, B, S, H, D); cos3/sin3 (1 or problems, S, D/2)
        kind = mode(core.NAME)
        problems, batch, seqlen, heads, head_dim = x5.shape
        plan = core.rotate(
            problems, batch * seqlen * heads, seqlen, heads, head_dim, dtype=dtype_name(x5.dtype),
            table_dtype=dtype_name(cos3.dtype), interleaved=interleaved, conjugate=conjugate, target=target(kind),
            table_batched=cos3.shape[0] > 1,
        )  # fmt: skip
        x3 = x5.reshape(problems, batch * seqlen * heads, head_dim)
        return [run_plan(plan, kind, x3, cos3, sin3)[0].reshape(x5.shape)]

    kernel = sharding.KERNELS["apply_rotary_bwd" if conjugate else "apply_rotary_fwd"]()
    return batched_row_local(core.NAME, call, kernel, shared=("cos", "sin"))


def _rotate(x, cos, sin, interleaved, conjugate):
    return _rotate_call(interleaved, conjugate)(x[None], cos[None], sin[None])[0][0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _apply_rotary(x, cos, sin, interleaved):
    return _rotate(x, cos, sin, interleaved, conjugate=False)


def _fwd(x, cos, sin, interleaved):
    return _rotate(x, cos, sin, interleaved, conjugate=False), (cos, sin)


def _bwd(interleaved, saved, dy):
    cos, sin = saved
    return _rotate(dy, cos, sin, interleaved, conjugate=True), None, None


_apply_rotary.defvjp(_fwd, _bwd)


@jit_when_eager("x", "cos", "sin")
def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotary embedding of x (B, S, H, D) by cos/sin (S, D/2); GPT-NeoX halves, GPT-J pairs when interleaved."""
    core.check(x, cos, sin, interleaved)
    return _apply_rotary(x, cos, sin, bool(interleaved))
