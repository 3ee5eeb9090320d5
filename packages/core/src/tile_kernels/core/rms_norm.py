"""RMSNorm with an optional fused residual add.

    h = x + residual                      (rounded to x.dtype: it is returned, as in an unfused model)
    y = h * rstd * weight,  rstd = 1 / sqrt(mean(h^2) + eps)        over the last dim, in fp32

Backward, with xhat = h * rstd, g = dy * weight and dh the cotangent of the returned h:
    dx = dresidual = rstd * (g - xhat * mean(g * xhat)) + dh
    dweight = sum over rows of dy * xhat

Layout: `batch` independent problems of `rows` rows of `n` elements (batch > 1 is how a JAX vmap folds into one
launch; the weight is shared or one per problem). Rows of up to MAX_ROW_BLOCK elements live in registers; wider rows
are streamed in chunks (two passes). The backward runs a persistent grid of a few programs per SM per problem, each
accumulating its dweight partial in registers (or in a zeroed fp32 buffer for wide rows); `sum_partials` reduces them.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target
from .registry import BadInput, Cost, OpInfo, register, round_to
from .rows import WIDTH_BUCKETS, programs_per_problem, row_block, sum_partials

NAME = "rms_norm"


@triton.jit
def _load_sum(x_ptr, r_ptr, h_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """h = x (+ residual, rounded to x's dtype and stored to h_ptr), returned in fp32."""
    h = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def rms_norm_fwd_kernel(
    X, R, W, eps, rows, N, stride_x, stride_r, stride_w,
    Y, H, RSTD,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows, batch): one program per row."""
    b = tl.program_id(1).to(tl.int64)
    row = b * rows + tl.program_id(0)
    x_ptr, r_ptr, w_ptr = X + row * stride_x, R + row * stride_r, W + b * stride_w
    y_ptr, h_ptr = Y + row * N, H + row * N
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        h = _load_sum(x_ptr, r_ptr, h_ptr, cols, mask, HAS_RESIDUAL)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        tl.store(y_ptr + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            h = _load_sum(x_ptr, r_ptr, h_ptr, cols, cols < N, HAS_RESIDUAL)
            acc += h * h
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        src = h_ptr if HAS_RESIDUAL else x_ptr
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = tl.load(src + cols, mask=mask).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
            tl.store(y_ptr + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def rms_norm_bwd_kernel(
    DY, H, W, RSTD, DH, rows, N, stride_dy, stride_h, stride_w, stride_dh,
    DX, DW_PARTIAL,
    HAS_DH: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (G, batch): program g handles rows g, g + G, ... of its problem and writes DW_PARTIAL[b, g, :]."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    w_ptr = W + b * stride_w
    partial_ptr = DW_PARTIAL + (b * G + g) * N
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for m in range(g, rows, G):
            row = b * rows + m
            rstd = tl.load(RSTD + row)
            xhat = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32) * rstd
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            wdy = w * dy
            dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)) * rstd
            if HAS_DH:
                dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(partial_ptr + cols, dw, mask=mask)
    else:
        for m in range(g, rows, G):
            row = b * rows + m
            rstd = tl.load(RSTD + row)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                acc += h * w * dy
            c = tl.sum(acc, axis=0) * rstd / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                xhat = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32) * rstd
                dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                dx = (w * dy - xhat * c) * rstd
                if HAS_DH:
                    dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
                dw = tl.load(partial_ptr + cols, mask=mask)
                tl.store(partial_ptr + cols, dw + dy * xhat, mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation and plans


def check(x, weight, residual=None, eps=1e-6) -> None:
    checks.check_min_ndim(NAME, "x", x, 1)
    dtype = checks.check_float(NAME, "x", x)
    checks.check_float(NAME, "weight", weight)
    checks.check_shape(NAME, "weight", weight, x.shape[-1:], "the last dim of x")
    if residual is not None:
        checks.check_same_dtype(NAME, "residual", residual, dtype, "the dtype of x")
        checks.check_shape(NAME, "residual", residual, x.shape, "the shape of x")
    checks.check_positive(NAME, "eps", eps)


def forward(
    batch: int, rows: int, n: int, *, x_dtype: str, weight_dtype: str, has_residual: bool, eps: float,
    target: Target, stride_x: int | None = None, stride_residual: int | None = None, weight_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs x (batch*rows rows of n, row stride stride_x), weight ((batch,) n), [residual].
    Outputs y (batch, rows, n), [h (batch, rows, n)], rstd (batch, rows) fp32."""
    empty = batch * rows * n == 0
    buffers = {"y": BufferSpec((batch, rows, n), x_dtype, zeroed=empty)}
    if has_residual:
        buffers["h"] = BufferSpec((batch, rows, n), x_dtype, zeroed=empty)
    buffers["rstd"] = BufferSpec((batch, rows), "float32", zeroed=empty)
    launches = ()
    if not empty:
        block, one_block, warps = row_block(n, target)
        launches = (
            Launch(
                rms_norm_fwd_kernel,
                grid=(rows, batch),
                reads=("x", "residual" if has_residual else None, "weight", eps, rows, n,
                       n if stride_x is None else stride_x, n if stride_residual is None else stride_residual,
                       n if weight_batched else 0),
                writes=("y", "h" if has_residual else None, "rstd"),
                constexprs=dict(HAS_RESIDUAL=has_residual, BLOCK_N=block, ONE_BLOCK=one_block),
                num_warps=warps,
            ),
        )  # fmt: skip
    inputs = {"x": x_dtype, "weight": weight_dtype} | ({"residual": x_dtype} if has_residual else {})
    return Plan(inputs, buffers, launches, tuple(buffers))


def backward(
    batch: int, rows: int, n: int, *, x_dtype: str, weight_dtype: str, has_dh: bool, target: Target,
    stride_dy: int | None = None, stride_h: int | None = None, stride_dh: int | None = None,
    weight_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs dy, h (the normalized input: x, or x + residual), weight, rstd, [dh].
    Outputs dx (batch, rows, n) in x's dtype and dweight (batch, n) in weight's dtype."""
    programs = programs_per_problem(rows, target)
    block, one_block, warps = row_block(n, target, max_block=8192)  # dweight accumulator also lives in registers
    empty = batch * rows * n == 0
    buffers = {
        "dx": BufferSpec((batch, rows, n), x_dtype, zeroed=empty),
        "dweight": BufferSpec((batch, n), weight_dtype, zeroed=empty),
    }
    launches = ()
    if not empty:
        buffers["dw_partial"] = BufferSpec((batch, programs, n), "float32", zeroed=not one_block)
        launches = (
            Launch(
                rms_norm_bwd_kernel,
                grid=(programs, batch),
                reads=("dy", "h", "weight", "rstd", "dh" if has_dh else None, rows, n,
                       n if stride_dy is None else stride_dy, n if stride_h is None else stride_h,
                       n if weight_batched else 0, n if stride_dh is None else stride_dh),
                writes=("dx", "dw_partial"),
                constexprs=dict(HAS_DH=has_dh, BLOCK_N=block, ONE_BLOCK=one_block),
                num_warps=warps,
            ),
            sum_partials("dw_partial", "dweight", batch, programs, n),
        )  # fmt: skip
    inputs = {"dy": x_dtype, "h": x_dtype, "weight": weight_dtype, "rstd": "float32"} | (
        {"dh": x_dtype} if has_dh else {}
    )
    return Plan(inputs, buffers, launches, ("dx", "dweight"))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def _mean_last(a):
    return np.sum(a, axis=-1, keepdims=True) / max(a.shape[-1], 1)


def reference(x, weight, eps=1e-6, residual=None, *, compute=np.float64):
    """Outputs (y,) or (y, h) in `compute` precision; h is rounded to x's dtype as the op returns it."""
    h = x if residual is None else round_to(x.astype(compute) + residual.astype(compute), str(x.dtype))
    hc = h.astype(compute)
    rstd = 1.0 / np.sqrt(_mean_last(hc * hc) + compute(eps))
    y = hc * rstd * weight.astype(compute)
    return (y,) if residual is None else (y, hc)


def reference_vjp(kwargs, cotangents):
    x, weight, residual = kwargs["x"], kwargs["weight"], kwargs.get("residual")
    h = reference(x, weight, kwargs.get("eps", 1e-6), residual)[-1] if residual is not None else x.astype(np.float64)
    dy = cotangents[0].astype(np.float64)
    rstd = 1.0 / np.sqrt(_mean_last(h * h) + kwargs.get("eps", 1e-6))
    xhat = h * rstd
    g = dy * weight.astype(np.float64)
    dx = rstd * (g - xhat * _mean_last(g * xhat))
    if residual is not None:
        dx = dx + cotangents[1].astype(np.float64)
    grads = {"x": dx, "weight": (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)}
    if residual is not None:
        grads["residual"] = dx
    return grads


def cost(kwargs) -> tuple[Cost, Cost]:
    x, weight, residual = kwargs["x"], kwargs["weight"], kwargs.get("residual")
    numel, n = int(np.prod(x.shape)), x.shape[-1]
    rows = numel // max(n, 1)
    item, witem = ITEMSIZE[str(x.dtype)], ITEMSIZE[str(weight.dtype)]
    streams_fwd = 2 if residual is None else 4  # x, y (+ residual, h)
    streams_bwd = 3 if residual is None else 4  # dy, h, dx (+ dh)
    fwd = Cost(numel * item * streams_fwd + n * witem + rows * 4, 4 * numel)
    bwd = Cost(numel * item * streams_bwd + 2 * n * witem + rows * 4, 8 * numel)
    return fwd, bwd


def sample(rng: np.random.Generator, shape, dtype: str, residual: bool = False, eps: float = 1e-6) -> dict:
    x = rng.standard_normal(shape) * 2.0
    kwargs = {"x": round_to(x, dtype), "weight": round_to(rng.uniform(-2, 2, shape[-1:]), dtype), "eps": eps}
    if residual:
        kwargs["residual"] = round_to(rng.standard_normal(shape), dtype)
    return kwargs


def bad_inputs(kwargs) -> list[BadInput]:
    x, weight = kwargs["x"], kwargs["weight"]
    return [
        BadInput({"x": x.astype(np.int32)}, TypeError, "rms_norm: x must have dtype"),
        BadInput(
            {"weight": np.zeros(weight.shape[0] + 1, weight.dtype)}, ValueError, "rms_norm: weight must have shape"
        ),
        BadInput({"residual": np.zeros(x.shape + (1,), x.dtype)}, ValueError, "rms_norm: residual must have shape"),
        BadInput(
            {"residual": x.astype(np.float16 if x.dtype != np.float16 else np.float32)},
            TypeError,
            "rms_norm: residual must have dtype",
        ),
        BadInput({"eps": 0.0}, ValueError, "rms_norm: eps must be > 0"),
    ]


def plans(target: Target):
    for dtype in FLOAT_DTYPES:
        for n in WIDTH_BUCKETS:
            for residual in (False, True):
                kw = dict(x_dtype=dtype, weight_dtype=dtype, target=target)
                yield forward(1, 4, n, has_residual=residual, eps=1e-6, **kw)
                yield backward(1, 4, n, has_dh=residual, **kw)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"residual": (False, True), "eps": (1e-6, 1e-2)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("x", "weight", "residual"),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
