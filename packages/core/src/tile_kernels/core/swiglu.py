"""SwiGLU gating: y = silu(gate) * up = gate * sigmoid(gate) * up, elementwise, in fp32.

Backward, with s = sigmoid(gate):
    dgate = dy * up * s * (1 + gate * (1 - s))
    dup   = dy * gate * s

The kernels see (rows, n) views with a row stride per input (a sliced activation costs no copy) and write contiguous
outputs; grid (rows, cdiv(n, BLOCK_N)) with 16-byte vectors per thread.
"""

from __future__ import annotations

import functools

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to
from .rows import row_op_plans

NAME = "swiglu"
MAX_BLOCK = 2048  # elements of a row per program
# The row width and strides are passed in units of 16 elements where they all divide (plan.in_units) and multiplied
# back by UNIT first: rows then start 16-byte aligned and the loads and stores vectorize under jax-triton too.


@triton.jit
def silu_times(g, u):
    """silu(g) u = g sigmoid(g) u, g and u float32: swiglu's output before its rounding (swiglu_fp8_quantize's too)."""
    return g * tl.sigmoid(g) * u


@triton.jit
def swiglu_fwd_kernel(GATE, UP, N, stride_gate, stride_up, Y, BLOCK_N: tl.constexpr, UNIT: tl.constexpr):
    N, stride_gate, stride_up = N * UNIT, stride_gate * UNIT, stride_up * UNIT
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, silu_times(g, u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    DY, GATE, UP, N, stride_dy, stride_gate, stride_up,
    DGATE, DUP,
    BLOCK_N: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    N, stride_dy, stride_gate, stride_up = N * UNIT, stride_dy * UNIT, stride_gate * UNIT, stride_up * UNIT
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DGATE + row * N + cols, (dy * u * s * (1.0 + g * (1.0 - s))).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + row * N + cols, (dy * g * s).to(DUP.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation and plans


def check(gate, up) -> None:
    dtype = checks.check_float(NAME, "gate", gate)
    checks.check_min_ndim(NAME, "gate", gate, 1)
    checks.check_same_dtype(NAME, "up", up, dtype, "the dtype of gate")
    checks.check_shape(NAME, "up", up, gate.shape, "the shape of gate")


def _launch_shape(n: int, target: Target) -> tuple[int, int]:
    block = min(MAX_BLOCK, next_power_of_2(n))
    return block, max(1, min(8, block // (target.warp_size * 8)))


def forward(
    rows: int, n: int, *, dtype: str, target: Target, stride_gate: int | None = None, stride_up: int | None = None
) -> Plan:
    """Inputs gate, up (rows of n); output y (rows, n)."""
    empty = rows * n == 0
    buffers = {"y": BufferSpec((rows, n), dtype, zeroed=empty)}
    launches = ()
    if not empty:
        block, warps = _launch_shape(n, target)
        reads = ("gate", "up", n, n if stride_gate is None else stride_gate, n if stride_up is None else stride_up)
        launch = Launch(swiglu_fwd_kernel, (rows, cdiv(n, block)), reads, ("y",), {"BLOCK_N": block}, warps)
        launches = (in_units(launch, "N", "stride_gate", "stride_up"),)
    return Plan({"gate": dtype, "up": dtype}, buffers, launches, ("y",))


def backward(
    rows: int, n: int, *, dtype: str, target: Target, stride_dy: int | None = None, stride_gate: int | None = None,
    stride_up: int | None = None, over_inputs: bool = False,
) -> Plan:  # fmt: skip
    """Inputs dy, gate, up; outputs dgate, dup (rows, n). over_inputs: written over gate and up (contiguous; each
    program loads its elements before it stores them), which the plan then returns."""
    empty = rows * n == 0
    if over_inputs:
        buffers, outputs = {}, ("gate", "up")
        stride_gate = stride_up = None  # contiguous: the kernel writes rows of n
    else:
        buffers = {name: BufferSpec((rows, n), dtype, zeroed=empty) for name in ("dgate", "dup")}
        outputs = ("dgate", "dup")
    launches = ()
    if not empty:
        block, warps = _launch_shape(n, target)
        strides = tuple(n if s is None else s for s in (stride_dy, stride_gate, stride_up))
        launch = Launch(swiglu_bwd_kernel, (rows, cdiv(n, block)), ("dy", "gate", "up", n) + strides, outputs,
                        {"BLOCK_N": block}, warps)  # fmt: skip
        launches = (in_units(launch, "N", "stride_dy", "stride_gate", "stride_up"),)
    return Plan({"dy": dtype, "gate": dtype, "up": dtype}, buffers, launches, outputs)


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(gate, up):
    g, u = gate.astype(np.float64), up.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * u,)


def reference_vjp(kwargs, cotangents):
    g, u, dy = (a.astype(np.float64) for a in (kwargs["gate"], kwargs["up"], cotangents[0]))
    s = 1.0 / (1.0 + np.exp(-g))
    return {"gate": dy * u * s * (1.0 + g * (1.0 - s)), "up": dy * g * s}


def cost(kwargs) -> tuple[Cost, Cost]:
    gate = kwargs["gate"]
    numel, item = int(np.prod(gate.shape)), ITEMSIZE[str(gate.dtype)]
    return Cost(3 * numel * item, 5 * numel), Cost(5 * numel * item, 12 * numel)


def sample(rng: np.random.Generator, shape, dtype: str) -> dict:
    return {
        "gate": round_to(rng.standard_normal(shape) * 3.0, dtype),
        "up": round_to(rng.standard_normal(shape), dtype),
    }


def bad_inputs(kwargs) -> list[BadInput]:
    gate = kwargs["gate"]
    return [
        BadInput({"gate": gate.astype(np.int32)}, TypeError, "swiglu: gate must have dtype"),
        BadInput({"up": np.zeros(gate.shape + (2,), gate.dtype)}, ValueError, "swiglu: up must have shape"),
        BadInput({"up": gate.astype(np.float16 if gate.dtype != np.float16 else np.float32)}, TypeError,
                 "swiglu: up must have dtype"),
        *not_arrays(NAME, "gate", "up"),
    ]  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("gate", "up"),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=functools.partial(row_op_plans, forward, backward),
    )
)
