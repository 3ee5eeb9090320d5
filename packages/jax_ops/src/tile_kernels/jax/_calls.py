"""Executes core Plans of TVM-FFI Calls (the TileLang and CUDA C++ backends, tile_kernels.core.backends) on JAX arrays.

Each compiled function is registered once as an XLA FFI target through jax-tvm-ffi (imported lazily: GPU only) and
called with `jax.ffi.ffi_call` inside the traced computation: its inputs, then its outputs, then its scalars as FFI
attributes; it runs on XLA's stream. jit, grad (custom_vjp) and the adapters' custom_vmap rules work as for the
jax-triton calls of `_runtime.run_plan`. Buffers no call writes (an empty problem) are zeros. A buffer that a call both
reads and writes is updated in place: its input is aliased to its output (the function sees one buffer twice, as
torch's run_calls passes it), starting from zeros when no earlier call wrote it (its BufferSpec is zeroed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tile_kernels.core import Plan, backends
from tile_kernels.core.backends import Call

from ._runtime import _import_jax_triton, _launch, mode


def platform(op: str) -> str:
    """'cpu' (interpret mode), 'cuda' or 'rocm': what tile_kernels.core.backends.resolve needs to know."""
    if mode(op) == "interpret":
        return "cpu"
    rocm = "rocm" in getattr(jax.devices()[0].client, "platform_version", "").lower()
    return "rocm" if rocm else "cuda"


@functools.cache
def cuda_arch() -> int:
    """Compute capability of JAX's first GPU as an int (90 for 9.0)."""
    major, minor = str(jax.devices()[0].compute_capability).split(".")
    return 10 * int(major) + int(minor)


def resolve_backend(op: str, backend: str | None, preferred_backend=None, *dims) -> str:
    """backends.resolve for a JAX call (the compiled backends need jax_tvm_ffi). backend=None on CUDA takes
    preferred_backend(compute capability, *dims): the op's core function that names its fastest measured backend for
    the call's inputs."""
    where = platform(op)
    preferred = None
    if backend is None and preferred_backend is not None and where == "cuda":
        preferred = preferred_backend(cuda_arch(), *dims)
    return backends.resolve(op, backend, where, needs=("jax_tvm_ffi",), preferred=preferred)


_REGISTERED: set[str] = set()


def _ffi_target(call) -> str:
    """The call's XLA FFI target, registered on first use (compiling the function)."""
    if call.key not in _REGISTERED:
        import jax_tvm_ffi

        spec = ["args", "rets"] + [f"attrs.{name}" for name in call.attrs]
        jax_tvm_ffi.register_ffi_target(call.key, call.load(), arg_spec=spec, platform="gpu")
        _REGISTERED.add(call.key)
    return call.key


def _attr(value):
    return np.float32(value) if isinstance(value, float) else np.int64(value)


def run_calls(plan: Plan, *inputs: jax.Array) -> tuple[jax.Array, ...]:
    bufs = dict(zip(plan.inputs, inputs, strict=True))
    written = {w for call in plan.launches for w in call.writes if w not in call.reads}
    specs = {name: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for name, s in plan.buffers.items()}
    bufs |= {name: jnp.zeros(s.shape, s.dtype) for name, s in specs.items() if name not in written}
    for call in plan.launches:
        if not isinstance(call, Call):  # a Triton Launch among the Calls (mla_decode's combine): through jax-triton
            _launch(_import_jax_triton(), plan, bufs, call)
            continue
        aliases = {call.reads.index(w): i for i, w in enumerate(call.writes) if w in call.reads}
        outs = jax.ffi.ffi_call(_ffi_target(call), [specs[w] for w in call.writes], input_output_aliases=aliases)(
            *(bufs[name] for name in call.reads), **{k: _attr(v) for k, v in call.attrs.items()}
        )
        bufs.update(zip(call.writes, outs))
    return tuple(bufs[name] for name in plan.outputs)
