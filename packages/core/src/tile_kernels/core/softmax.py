"""Softmax over one dim (the kernels work on the last; the adapters move any other dim there).

    y = exp(x - max(x)) / sum(exp(x - max(x)))                  in fp32
    dx = y * (dy - sum(dy * y))

Rows of up to MAX_ROW_BLOCK elements live in registers (one read, one write). Wider rows are streamed: an online pass
keeps a running max and rescaled sum per lane, a second pass writes the output. A row that is all -inf gives NaN, as in
torch.
"""

from __future__ import annotations

import functools

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, in_units
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to
from .rows import ELEMENTS_PER_THREAD, exp_minus, online_max_sum_step, online_max_sum_total, row_block, row_op_plans

NAME = "softmax"
# The row width and strides are passed in units of 16 elements where they all divide (plan.in_units) and multiplied
# back by UNIT first: rows then start 16-byte aligned and the loads and stores vectorize under jax-triton too.


@triton.jit
def softmax_fwd_kernel(X, N, stride_x, Y, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, UNIT: tl.constexpr):
    """Grid (rows,): one program per row."""
    N, stride_x = N * UNIT, stride_x * UNIT
    row = tl.program_id(0).to(tl.int64)
    x_ptr, y_ptr = X + row * stride_x, Y + row * N
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
        e = exp_minus(x, tl.max(x, axis=0))
        tl.store(y_ptr + cols, (e * (1.0 / tl.sum(e, axis=0))).to(Y.dtype.element_ty), mask=mask)
    else:
        m_lane = tl.full([BLOCK_N], -float("inf"), dtype=tl.float32)
        s_lane = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_ptr + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
            m_lane, s_lane = online_max_sum_step(m_lane, s_lane, x)
        m, s = online_max_sum_total(m_lane, s_lane)
        inv_s = 1.0 / s  # a multiply an element: a division is an IEEE sequence of several
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(x_ptr + cols, mask=mask).to(tl.float32)
            tl.store(y_ptr + cols, (exp_minus(x, m) * inv_s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def softmax_bwd_kernel(
    Y, DY, N, stride_y, stride_dy, DX, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, UNIT: tl.constexpr
):
    """Grid (rows,): one program per row."""
    N, stride_y, stride_dy = N * UNIT, stride_y * UNIT, stride_dy * UNIT
    row = tl.program_id(0).to(tl.int64)
    y_ptr, dy_ptr, dx_ptr = Y + row * stride_y, DY + row * stride_dy, DX + row * N
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        y = tl.load(y_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + cols, (y * (dy - tl.sum(y * dy, axis=0))).to(DX.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            acc += tl.load(y_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
                dy_ptr + cols, mask=mask, other=0.0
            ).to(tl.float32)
        dot = tl.sum(acc, axis=0)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            y = tl.load(y_ptr + cols, mask=mask).to(tl.float32)
            dy = tl.load(dy_ptr + cols, mask=mask).to(tl.float32)
            tl.store(dx_ptr + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation and plans


def check(x, dim=-1) -> int:
    """Validates and returns the normalized dim."""
    checks.check_float(NAME, "x", x)
    return checks.normalize_dim(NAME, dim, len(x.shape))


def _row_plan(
    kernel, rows: int, n: int, dtype: str, reads: tuple, units: tuple, out: str, target: Target,
    per_thread: int = ELEMENTS_PER_THREAD,
) -> Plan:  # fmt: skip
    """`units`: the kernel's int arguments passed in units (its row width and strides)."""
    empty = rows * n == 0
    buffers = {out: BufferSpec((rows, n), dtype, zeroed=empty)}
    launches = ()
    if not empty:
        block, one_block, warps = row_block(n, target, per_thread=per_thread)
        constexprs = dict(BLOCK_N=block, ONE_BLOCK=one_block)
        launches = (in_units(Launch(kernel, (rows,), reads, (out,), constexprs, num_warps=warps), *units),)
    return Plan({r: dtype for r in reads if isinstance(r, str)}, buffers, launches, (out,))


# Elements a thread of the forward: half the warps of the default (two block-wide reductions, max and sum, each a
# round trip through shared memory across the warps). benchmarks/sweep_row_warps.py on an H200, 2^26 bf16 elements,
# % of copy at 16 / 8 elements a thread: width 1024 96 / 89, 2048 95 / 84, 4096 94 / 77, 8192 and 16384 equal (94,
# 87: 16 warps either way); the backward (one reduction) is at 95-100% with the default.
FORWARD_PER_THREAD = 16


def forward(rows: int, n: int, *, dtype: str, target: Target, stride_x: int | None = None) -> Plan:
    """Input x (rows of n, row stride stride_x); output y (rows, n)."""
    reads = ("x", n, n if stride_x is None else stride_x)
    return _row_plan(softmax_fwd_kernel, rows, n, dtype, reads, ("N", "stride_x"), "y", target, FORWARD_PER_THREAD)


def backward(
    rows: int, n: int, *, dtype: str, target: Target, stride_y: int | None = None, stride_dy: int | None = None
) -> Plan:
    """Inputs y (the forward's output), dy; output dx (rows, n)."""
    reads = ("y", "dy", n, n if stride_y is None else stride_y, n if stride_dy is None else stride_dy)
    return _row_plan(softmax_bwd_kernel, rows, n, dtype, reads, ("N", "stride_y", "stride_dy"), "dx", target)


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(x, dim=-1):
    xc = x.astype(np.float64)
    e = np.exp(xc - np.max(xc, axis=dim, keepdims=True, initial=-np.inf))
    return (e / np.sum(e, axis=dim, keepdims=True),)


def reference_vjp(kwargs, cotangents):
    dim = kwargs.get("dim", -1)
    y = reference(kwargs["x"], dim)[0]
    dy = cotangents[0].astype(np.float64)
    return {"x": y * (dy - np.sum(dy * y, axis=dim, keepdims=True))}


def cost(kwargs) -> tuple[Cost, Cost]:
    x = kwargs["x"]
    numel, item = int(np.prod(x.shape)), ITEMSIZE[str(x.dtype)]
    return Cost(2 * numel * item, 5 * numel), Cost(3 * numel * item, 4 * numel)


def sample(rng: np.random.Generator, shape, dtype: str, last_dim: bool = True) -> dict:
    dim = -1
    if not last_dim and len(shape) >= 2:
        dim = int(rng.integers(-len(shape), -1))
        if np.prod(shape) // max(shape[dim], 1) > 4096:  # keep the rows (programs) few for the interpreter
            dim = -1
    return {"x": round_to(rng.standard_normal(shape) * 3.0, dtype), "dim": dim}


def bad_inputs(kwargs) -> list[BadInput]:
    x = kwargs["x"]
    return [
        BadInput({"x": x.astype(np.int32)}, TypeError, "softmax: x must have dtype"),
        BadInput({"dim": len(x.shape) + 1}, ValueError, "softmax: dim must be an int"),
        *not_arrays(NAME, "x"),
    ]


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"last_dim": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("x",),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=functools.partial(row_op_plans, forward, backward),
    )
)
