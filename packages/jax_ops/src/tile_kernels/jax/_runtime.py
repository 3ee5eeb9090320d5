"""Executes core Plans on JAX arrays.

On a GPU backend every launch is a `jax_triton.triton_call` (imported lazily: it needs a GPU jaxlib). On the CPU
backend with TRITON_INTERPRET=1 (interpret mode, like Pallas' interpret=True) the whole plan runs in one
`jax.pure_callback` through Triton's interpreter on NumPy buffers: the same kernels, no torch. Without either, a call
raises. Batching: `problem_batched` gives a kernel call a custom_vmap rule that folds the vmapped axis into the
plan's problem (or row) axis, so a vmap is still one launch per kernel.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from tile_kernels.core import Plan, Target, host
from tile_kernels.core.plan import Gemm, Launch, Rows, is_ref, ref_name, resolve


def jit_when_eager(*arrays: str):
    """Decorator of a public function whose array parameters are `arrays`: a call with concrete arrays (outside jit,
    grad, vmap, shard_map) runs through jax.jit with the other arguments static, so that repeated eager calls reuse
    one compiled trace instead of tracing the custom_vjp / custom_vmap / sharding wrappers anew each time; a call
    with tracers (inside a transformation) runs the function itself."""

    def wrap(fn):
        signature = inspect.signature(fn)
        static = tuple(name for name in signature.parameters if name not in arrays)
        jitted = jax.jit(fn, static_argnames=static)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            values = signature.bind(*args, **kwargs).arguments
            if any(isinstance(values.get(name), jax.core.Tracer) for name in arrays):
                return fn(*args, **kwargs)
            try:
                hash(tuple(values.get(name) for name in static))
            except TypeError:  # e.g. a list where a tuple is meant: as given (the checks name what is wrong)
                return fn(*args, **kwargs)
            return jitted(**values)

        return call

    return wrap


def mode(op: str) -> str:
    """'gpu' (jax-triton) or 'interpret' (Triton interpreter through a host callback)."""
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    if host.interpreting():
        return "interpret"
    raise ValueError(
        f"{op}: JAX's default backend is {backend!r}; the kernels run on a CUDA/ROCm GPU, or on the CPU in interpret "
        f"mode ({host.interpreter_hint()})"
    )


@functools.cache
def target(kind: str) -> Target:
    if kind == "interpret":
        return Target()
    device = jax.devices()[0]
    rocm = "rocm" in getattr(device.client, "platform_version", "").lower()
    cuda_arch = 0 if rocm else int("".join(str(getattr(device, "compute_capability", "9.0")).split(".")[:2]))
    return Target(warp_size=64 if rocm else 32, num_sms=getattr(device, "core_count", 132), cuda_arch=cuda_arch)


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
    given = dict(zip(plan.inputs, inputs, strict=True))
    specs = [_spec(plan, given, n) for n in plan.outputs]  # buffers, or inputs the plan updates in place
    if kind == "interpret":
        return tuple(jax.pure_callback(functools.partial(_run_host_plan, plan), specs, *inputs))
    jax_triton = _import_jax_triton()
    bufs = dict(zip(plan.inputs, inputs, strict=True))
    written = {ref_name(w) for step in plan.launches for w in step.writes if w is not None}
    for name, spec in plan.buffers.items():  # zeroed buffers no launch writes (empty problems) may still be read
        if name not in written:
            bufs[name] = jnp.zeros(spec.shape, _dtype(spec.dtype))
    for step in plan.launches:
        if isinstance(step, Gemm):
            _gemm(plan, bufs, step)
        else:
            _launch(jax_triton, plan, bufs, step)
    return tuple(bufs[name] for name in plan.outputs)


def _spec(plan: Plan, bufs: dict, ref) -> jax.ShapeDtypeStruct:
    """Shape and dtype of what a reference names (a buffer, an input, or rows of either)."""
    name = ref_name(ref)
    if name in plan.buffers:
        shape, dtype = plan.buffers[name].shape, _dtype(plan.buffers[name].dtype)
    else:
        shape, dtype = bufs[name].shape, bufs[name].dtype
    return jax.ShapeDtypeStruct((ref.stop - ref.start, *shape[1:]) if isinstance(ref, Rows) else shape, dtype)


def _store(plan: Plan, bufs: dict, ref, value: jax.Array) -> None:
    """Binds a step's result: a whole buffer is replaced; rows are updated into it (XLA does that in place)."""
    if not isinstance(ref, Rows):
        bufs[ref] = value
        return
    base = bufs.get(ref.name)
    if base is None:  # first write of a buffer that chunks fill row range by row range
        base = jnp.zeros(_spec(plan, bufs, ref.name).shape, value.dtype)
    bufs[ref.name] = jax.lax.dynamic_update_slice_in_dim(base, value, ref.start, axis=0)


def _launch(jax_triton, plan: Plan, bufs: dict, launch: Launch) -> None:
    """One jax_triton.triton_call. A written reference that the launch also reads is aliased to that input (the
    kernel updates it in place); others are fresh outputs (zeroed ones zeroed first)."""
    # jax-triton passes Python floats as fp64; Triton's launcher (torch, interpreter) as fp32
    args = [np.float32(a) if isinstance(a, float) else a for a in launch.arguments(bufs, with_writes=False)]
    arrays = [r for r in launch.reads if r is None or is_ref(r)]  # jax-triton's array operands, in order
    aliases = {arrays.index(w): i for i, w in enumerate(launch.writes) if w is not None and w in arrays}
    out_shape = [jax.ShapeDtypeStruct((1,), jnp.float32) if w is None else _spec(plan, bufs, w) for w in launch.writes]
    zeroed = tuple(
        i for i, w in enumerate(launch.writes)
        if isinstance(w, str) and w in plan.buffers and plan.buffers[w].zeroed and i not in aliases.values()
    )  # fmt: skip
    results = jax_triton.triton_call(
        *args, kernel=launch.kernel, out_shape=out_shape, grid=launch.grid, num_warps=launch.num_warps,
        num_stages=launch.num_stages, zeroed_outputs=zeroed, input_output_aliases=aliases, **launch.constexprs,
    )  # fmt: skip
    for w, r in zip(launch.writes, results):
        if w is not None:
            _store(plan, bufs, w, r)


def _gemm(plan: Plan, bufs: dict, step: Gemm) -> None:
    """XLA's dot (cuBLAS / hipBLAS): fp32 accumulation, the result in out's dtype; float32 operands at full precision
    (no TF32). An accumulating GEMM is an add that XLA can fold into the GEMM (beta = 1)."""
    a, b = resolve(bufs, step.a), resolve(bufs, step.b)
    dims = (((0 if step.trans_a else 1,), (1 if step.trans_b else 0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    out = jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_spec(plan, bufs, step.out).dtype)
    _store(plan, bufs, step.out, resolve(bufs, step.out) + out if step.accumulate else out)


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
