"""Runs a Plan on NumPy arrays through Triton's interpreter (TRITON_INTERPRET=1): the same kernels, on the CPU.

This is the JAX adapter's interpret mode (jax.pure_callback lands here) and needs neither torch nor a GPU. The
interpreter reads buffers through raw pointers; `HostBuffer` gives a NumPy array the few tensor methods it asks for.
"""

from __future__ import annotations

import os

import numpy as np

from .plan import TRITON_TYPE, Gemm, Plan, resolve, written_inputs


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INTERPRETING = _interpret_env()  # Triton decides when each kernel is defined (on import) whether it is interpreted


def interpreting() -> bool:
    """Triton's own switch as it was when tile_kernels was imported: it cannot take effect later."""
    return _INTERPRETING


def ieee_dots(dtype: str) -> bool:
    """Whether a kernel's tl.dot runs at IEEE precision (operands upcast to float32): for float32 (no TF32), and for
    bfloat16 in Triton's interpreter, whose tl.dot multiplies bfloat16 tiles as their raw 16-bit patterns (triton
    3.9): upcast there (exact products, fp32 sums as on the GPU)."""
    return dtype == "float32" or (dtype == "bfloat16" and interpreting())


def interpreter_hint() -> str:
    """How to run the kernels on the CPU, for an error message; says so when the switch was set too late."""
    if _interpret_env() and not _INTERPRETING:
        return "TRITON_INTERPRET=1 was set after tile_kernels was imported: set it before importing tile_kernels"
    return "set TRITON_INTERPRET=1 before importing tile_kernels"


def poisoning() -> bool:
    """TILE_KERNELS_POISON=1 fills every buffer with NaN before a plan runs (tests catch unwritten outputs)."""
    return os.environ.get("TILE_KERNELS_POISON", "0") not in ("", "0")


class HostBuffer:
    """A NumPy array presented to the Triton interpreter as a host tensor (no copies: it is already on the host)."""

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("HostBuffer needs a C-contiguous array")
        self.array = array
        self.dtype = TRITON_TYPE[array.dtype.name]

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    # the interpreter's host-copy protocol, all identities here
    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args, **kwargs):
        return self

    def copy_(self, other):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)


def _numpy_dtype(name: str):
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return getattr(ml_dtypes, name)
    return np.dtype(name)


def run_plan(plan: Plan, *inputs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Executes `plan` with `inputs` bound to plan.inputs; returns plan.outputs as new arrays."""
    if not interpreting():
        raise RuntimeError("tile_kernels: running kernels on the host needs TRITON_INTERPRET=1 set before import")
    updated = written_inputs(plan)  # copied: the caller's arrays (JAX's, in a callback) are never written
    bufs = {name: np.array(a, order="C") if name in updated else np.ascontiguousarray(a)
            for name, a in zip(plan.inputs, inputs, strict=True)}  # fmt: skip
    for name, spec in plan.buffers.items():
        fill = 0 if spec.zeroed else (np.nan if poisoning() and "float" in spec.dtype else None)
        dtype = _numpy_dtype(spec.dtype)
        bufs[name] = np.empty(spec.shape, dtype) if fill is None else np.full(spec.shape, fill, dtype)
    for step in plan.launches:
        if isinstance(step, Gemm):
            _gemm(bufs, step)
            continue
        args = [HostBuffer(a) if isinstance(a, np.ndarray) else a for a in step.arguments(bufs)]
        step.kernel[step.grid](*args, **step.constexprs, num_warps=step.num_warps)
    return tuple(bufs[name] for name in plan.outputs)


def _gemm(bufs: dict, step: Gemm) -> None:
    """NumPy's matmul in fp32 (as the GPU GEMMs accumulate), rounded once to the output's dtype."""
    a, b, out = (resolve(bufs, ref) for ref in (step.a, step.b, step.out))
    a, b = (a.T if step.trans_a else a).astype(np.float32), (b.T if step.trans_b else b).astype(np.float32)
    acc = a @ b
    if step.accumulate:
        acc += out.astype(np.float32)
    out[...] = acc.astype(out.dtype)
