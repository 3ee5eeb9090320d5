"""RMSNorm with an optional fused residual add.

    h = x + residual                      (rounded to x.dtype: it is returned, as in an unfused model)
    y = h * rstd * weight,  rstd = 1 / sqrt(mean(h^2) + eps)        over the last dim, in fp32

Kernels, plans, reference and validation are shared with layer_norm in norms.py (is_rms=True). Three backends
(backends.py): the Triton kernels of norms.py, TileLang kernels (rms_norm_tilelang.py) and CUDA C++ kernels
(rms_norm_cuda.py); the latter two run as Plans of TVM-FFI Calls with the same inputs and outputs as the Triton plans:
    forward   inputs x, weight, [residual];        outputs y (batch, rows, n), [h], rstd (batch, rows) fp32
    backward  inputs dy, h, weight, rstd, [dh];    outputs dx (batch, rows, n), dweight (batch, n)
with x (batch, rows, n) and weight (1 or batch, n), all compact. A backend module provides
`function(kernel, x_dtype, weight_dtype, arch)` (its TVM-FFI function, compiled on first use) and COLUMN_SUM_KERNEL
(the backward's separate dweight reduction, or None when the backward function does it).
"""

from __future__ import annotations

import functools

from . import backends, norms
from .backends import Call
from .plan import BufferSpec, Plan, Target
from .registry import BadInput, OpInfo, register
from .rows import programs_per_problem

NAME = "rms_norm"
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.rms_norm_tilelang",
                         "cuda": f"{__package__}.rms_norm_cuda"})  # fmt: skip


def check(x, weight, residual=None, eps=1e-6) -> None:
    norms.check(NAME, x, weight, None, residual, eps)


def reference(x, weight, eps=1e-6, residual=None):
    return norms.reference(x, weight, None, eps, residual, is_rms=True)


def _call(backend: str, kernel: str, x_dtype: str, w_dtype: str, arch: int, reads, writes, **attrs) -> Call:
    """A call of one kernel of the backend's module (its `function(kernel, x_dtype, w_dtype, arch)` compiles it)."""
    load = functools.partial(backends.module(NAME, backend).function, kernel, x_dtype, w_dtype, arch)
    return Call(f"tile_kernels_{backend}_{kernel}_{x_dtype}_{w_dtype}_sm{arch}", load, reads, writes, attrs)


def compiled_forward(
    backend: str, batch: int, rows: int, n: int, *, x_dtype: str, weight_dtype: str, has_residual: bool, eps: float,
    arch: int,
) -> Plan:  # fmt: skip
    """The forward of the TileLang or CUDA C++ backend for compute capability `arch` (e.g. 90)."""
    empty = batch * rows * n == 0
    buffers = {"y": BufferSpec((batch, rows, n), x_dtype, zeroed=empty)}
    if has_residual:
        buffers["h"] = BufferSpec((batch, rows, n), x_dtype, zeroed=empty)
    buffers["rstd"] = BufferSpec((batch, rows), "float32", zeroed=empty)
    calls = ()
    if not empty:
        kernel, reads, writes = "rms_norm_fwd", ("x", "weight"), ("y", "rstd")
        if has_residual:
            kernel, reads, writes = "rms_norm_fwd_residual", ("x", "residual", "weight"), ("y", "h", "rstd")
        calls = (_call(backend, kernel, x_dtype, weight_dtype, arch, reads, writes, eps=eps),)
    inputs = {"x": x_dtype, "weight": weight_dtype} | ({"residual": x_dtype} if has_residual else {})
    return Plan(inputs, buffers, calls, tuple(buffers))


def compiled_backward(
    backend: str, batch: int, rows: int, n: int, *, x_dtype: str, weight_dtype: str, has_dh: bool, target: Target,
    arch: int,
) -> Plan:  # fmt: skip
    """The backward of the TileLang or CUDA C++ backend: a persistent grid of programs_per_problem programs per
    problem, each with its own fp32 row of dweight partial sums (written before read: not zeroed)."""
    empty = batch * rows * n == 0
    buffers = {"dx": BufferSpec((batch, rows, n), x_dtype, zeroed=empty),
               "dweight": BufferSpec((batch, n), weight_dtype, zeroed=empty)}  # fmt: skip
    calls = ()
    if not empty:
        buffers["dweight_partial"] = BufferSpec((batch, programs_per_problem(rows, target), n), "float32")
        kernel = "rms_norm_bwd_dh" if has_dh else "rms_norm_bwd"
        reads = ("dy", "h", "weight", "rstd") + (("dh",) if has_dh else ())
        column_sum = backends.module(NAME, backend).COLUMN_SUM_KERNEL
        if column_sum:  # a second launch reduces the partial rows
            calls = (
                _call(backend, kernel, x_dtype, weight_dtype, arch, reads, ("dx", "dweight_partial")),
                _call(backend, column_sum, weight_dtype, weight_dtype, arch, ("dweight_partial",), ("dweight",)),
            )
        else:
            calls = (_call(backend, kernel, x_dtype, weight_dtype, arch, reads, ("dx", "dweight", "dweight_partial")),)
    inputs = {"dy": x_dtype, "h": x_dtype, "weight": weight_dtype, "rstd": "float32"}
    inputs |= {"dh": x_dtype} if has_dh else {}
    return Plan(inputs, buffers, calls, ("dx", "dweight"))


def bad_inputs(kwargs) -> list[BadInput]:
    unknown = BadInput({"backend": "nope"}, ValueError, f"{NAME}: backend must be one of")
    return norms.bad_inputs(NAME, kwargs) + [unknown]


INFO = register(
    OpInfo(
        name=NAME,
        sample=functools.partial(norms.sample, bias=False),
        options={"residual": (False, True), "eps": (1e-6, 1e-2)},
        reference=reference,
        reference_vjp=functools.partial(norms.reference_vjp, is_rms=True),
        grad_args=("x", "weight", "residual"),
        cost=norms.cost,
        bad_inputs=bad_inputs,
        plans=functools.partial(norms.plans, is_rms=True),
    )
)
