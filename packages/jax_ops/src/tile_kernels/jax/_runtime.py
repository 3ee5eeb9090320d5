"""Executes core Plans on JAX arrays.

On a GPU backend every launch is a `jax_triton.triton_call` (imported lazily: it needs a GPU jaxlib). On the CPU
backend with TRITON_INTERPRET=1 (interpret mode, like Pallas' interpret=True) the whole plan runs in one
`jax.pure_callback` through Triton's interpreter on NumPy buffers: the same kernels, no torch. Without either, a call
raises. Batching: `problem_batched` gives a kernel call a custom_vmap rule that folds the vmapped axis into the
plan's problem (or row) axis, so a vmap is still one launch per kernel.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from tile_kernels.core import Plan, Target, host


def mode(op: str) -> str:
    """'gpu' (jax-triton) or 'interpret' (Triton interpreter through a host callback)."""
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    if host.interpreting():
        return "interpret"
    raise ValueError(
        f"{op}: JAX's default backend is {backend!r}; the kernels run on a CUDA/ROCm GPU, or on the CPU in interpret "
        "mode (set TRITON_INTERPRET=1 before importing tile_kernels)"
    )


@functools.cache
def target(kind: str) -> Target:
    if kind == "interpret":
        return Target()
    device = jax.devices()[0]
    rocm = "rocm" in getattr(device.client, "platform_version", "").lower()
    return Target(warp_size=64 if rocm else 32, num_sms=getattr(device, "core_count", 132))


def _dtype(name: str):
    return jnp.dtype(name)


@functools.cache
def _import_jax_triton():
    """jax-triton (0.3.1) sets TRITON_CACHE_DIR="" at import, which breaks every later Triton launch in the process
    that inits Triton's driver (torch ops beside JAX ones). Import it with the caller's setting put back."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


_HOST_LOCK = threading.Lock()


def _run_host_plan(plan: Plan, *inputs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Triton's interpreter patches global state while it runs a kernel, and XLA runs the callbacks of a sharded
    program (one per device) on concurrent threads: one interpreted plan at a time."""
    with _HOST_LOCK:
        return host.run_plan(plan, *inputs)


def run_plan(plan: Plan, kind: str, *inputs: jax.Array) -> tuple[jax.Array, ...]:
    specs = [jax.ShapeDtypeStruct(plan.buffers[n].shape, _dtype(plan.buffers[n].dtype)) for n in plan.outputs]
    if kind == "interpret":
        return tuple(jax.pure_callback(functools.partial(_run_host_plan, plan), specs, *inputs))
    jax_triton = _import_jax_triton()
    bufs = dict(zip(plan.inputs, inputs, strict=True))
    written = {w for launch in plan.launches for w in launch.writes}
    for name, spec in plan.buffers.items():  # zeroed buffers no launch writes (empty problems) may still be read
        if name not in written:
            bufs[name] = jnp.zeros(spec.shape, _dtype(spec.dtype))
    for launch in plan.launches:
        # jax-triton passes Python floats as fp64; Triton's launcher (torch, interpreter) as fp32
        args = [np.float32(a) if isinstance(a, float) else a for a in launch.arguments(bufs, with_writes=False)]
        out_shape = [
            jax.ShapeDtypeStruct((1,), jnp.float32) if w is None
            else jax.ShapeDtypeStruct(plan.buffers[w].shape, _dtype(plan.buffers[w].dtype))
            for w in launch.writes
        ]  # fmt: skip
        zeroed = tuple(i for i, w in enumerate(launch.writes) if w is not None and plan.buffers[w].zeroed)
        results = jax_triton.triton_call(
            *args, kernel=launch.kernel, out_shape=out_shape, grid=launch.grid, num_warps=launch.num_warps,
            num_stages=launch.num_stages, zeroed_outputs=zeroed, **launch.constexprs,
        )  # fmt: skip
        bufs.update((w, r) for w, r in zip(launch.writes, results) if w is not None)
    return tuple(bufs[name] for name in plan.outputs)


def as_problem(a: jax.Array) -> jax.Array:
    """(1, rows, n) view of a (..., n): one problem of rows x n."""
    return a.reshape(1, math.prod(a.shape[:-1]), a.shape[-1])


def problem_batched(call, shareable: tuple[bool, ...]):
    """Wraps `call(*arrays)`, whose arrays all carry a leading problem axis, in a custom_vmap that folds the vmapped
    axis into that problem axis. A `shareable` argument of leading size 1 that is not vmapped stays shared by all
    problems (a weight); every other argument is broadcast. Outputs carry the problem axis too."""
    batched_call = jax.custom_batching.custom_vmap(call)

    @batched_call.def_vmap
    def _rule(axis_size, in_batched, *args):
        problems = max(a.shape[1] if b else a.shape[0] for a, b in zip(args, in_batched))
        folded = []
        for a, b, share in zip(args, in_batched, shareable):
            if not b and share and a.shape[0] == 1:
                folded.append(a)
                continue
            if not b:
                a = a[None]
            a = jnp.broadcast_to(a, (axis_size, problems) + a.shape[2:])
            folded.append(a.reshape((axis_size * problems,) + a.shape[2:]))
        outs = batched_call(*folded)
        return [o.reshape((axis_size, problems) + o.shape[1:]) for o in outs], [True] * len(outs)

    return batched_call
