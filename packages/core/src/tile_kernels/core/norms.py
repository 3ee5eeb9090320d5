"""Kernels and plans of the normalization family (rms_norm, layer_norm), with an optional fused residual add.

    h = x + residual                     (rounded to x.dtype: it is returned, as in an unfused model)
    layer_norm: mean = mean(h), xhat = (h - mean) * rstd, rstd = 1 / sqrt(mean((h - mean)^2) + eps)
    rms_norm:   mean = 0,       xhat = h * rstd,          rstd = 1 / sqrt(mean(h^2) + eps)
    y = xhat * weight (+ bias)                                        over the last dim, in fp32

Backward, with g = dy * weight and dh the cotangent of the returned h:
    dx = dresidual = rstd * (g - xhat * mean(g * xhat) - mean(g)) + dh      (no mean(g) term for rms_norm)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy

Layout: `batch` independent problems of `rows` rows of `n` elements (batch > 1 is how a JAX vmap folds into one
launch; weight and bias are shared or one per problem). Rows of up to MAX_ROW_BLOCK elements live in registers (the
backward's, up to 8192, next to their dweight/dbias accumulators); wider rows are streamed in chunks: two passes
(rms_norm) or three (layer_norm: mean, then variance, then output). The backward runs a persistent grid of a few
programs per SM per problem; each keeps dweight/dbias partials in registers (or in zeroed fp32 buffers for wide
rows), reduced by `sum_partials`.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target
from .registry import BadInput, Cost, round_to
from .rows import WIDTH_BUCKETS, programs_per_problem, row_block, sum_partials

BACKWARD_MAX_ROW_BLOCK = 8192


@triton.jit
def _load_sum(x_ptr, r_ptr, h_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """h = x (+ residual, rounded to x's dtype and stored to h_ptr), returned in fp32."""
    h = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _mean(total, N):
    """total / N rounded correctly (IEEE division, not the approximate one): a row whose values are all equal must
    centre to exactly zero, since rstd = 1/sqrt(eps) then magnifies any residue (n = 1 rows, constant rows)."""
    return tl.math.div_rn(total, N * 1.0)


@triton.jit
def _row_stats(MEAN, RSTD, row, IS_RMS: tl.constexpr):
    """(mean, rstd) the forward saved for a row; rms_norm has no mean."""
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(MEAN + row)
    return mean, tl.load(RSTD + row)


@triton.jit
def _load_row(DY, H, DH, MEAN, RSTD, row, row_end, stride_dy, stride_h, stride_dh, cols, mask, IS_RMS: tl.constexpr,
              HAS_DH: tl.constexpr):  # fmt: skip
    """(h, dy, dh) of one row in their stored dtype and its saved (mean, rstd); zeros past the problem's rows."""
    mask = mask & (cols < tl.where(row < row_end, cols.shape[0], 0))  # (an & with a scalar fails in the interpreter)
    last = tl.minimum(row, row_end - 1)  # the stats of a row past the end: any valid address, unused
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0)
    dh = tl.zeros_like(dy)
    if HAS_DH:
        dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0)
    rstd = tl.load(RSTD + last)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(MEAN + last)
    return h, dy, dh, mean, rstd


@triton.jit
def norm_fwd_kernel(
    X, R, W, B, eps, rows, N, stride_x, stride_r, stride_w,
    Y, H, MEAN, RSTD,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows, batch): one program per row."""
    b = tl.program_id(1).to(tl.int64)
    row = b * rows + tl.program_id(0)
    x_ptr, r_ptr, w_ptr, b_ptr = X + row * stride_x, R + row * stride_r, W + b * stride_w, B + b * stride_w
    y_ptr, h_ptr = Y + row * N, H + row * N
    mean = 0.0
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        xc = _load_sum(x_ptr, r_ptr, h_ptr, cols, mask, HAS_RESIDUAL)
        if not IS_RMS:
            mean = _mean(tl.sum(xc, axis=0), N)
            xc = tl.where(mask, xc - mean, 0.0)
        rstd = tl.rsqrt(_mean(tl.sum(xc * xc, axis=0), N) + eps)
        y = xc * rstd * tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask).to(tl.float32)
        tl.store(y_ptr + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        src = h_ptr if HAS_RESIDUAL else x_ptr
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):  # pass 1: h, and sum(h) (layer) or sum(h^2) (rms)
            cols = start + tl.arange(0, BLOCK_N)
            h = _load_sum(x_ptr, r_ptr, h_ptr, cols, cols < N, HAS_RESIDUAL)
            acc += h if not IS_RMS else h * h
        if not IS_RMS:  # pass 2: the variance about the mean, not E[h^2] - mean^2 (no cancellation)
            mean = _mean(tl.sum(acc, axis=0), N)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                d = tl.where(mask, tl.load(src + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
                acc += d * d
        rstd = tl.rsqrt(_mean(tl.sum(acc, axis=0), N) + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            y = (tl.load(src + cols, mask=mask).to(tl.float32) - mean) * rstd
            y *= tl.load(w_ptr + cols, mask=mask).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=mask).to(tl.float32)
            tl.store(y_ptr + cols, y.to(Y.dtype.element_ty), mask=mask)
    if not IS_RMS:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def norm_bwd_kernel(
    DY, H, W, MEAN, RSTD, DH, rows, N, stride_dy, stride_h, stride_w, stride_dh,
    DX, DW_PARTIAL, DB_PARTIAL,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (G, batch): program g handles rows g, g + G, ... of its problem and writes DW/DB_PARTIAL[b, g, :]."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    w_ptr = W + b * stride_w
    partial = (b * G + g) * N
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        # software pipelining by hand: the next row's loads are in flight while this row reduces and stores
        row_end = (b + 1) * rows
        nxt = _load_row(DY, H, DH, MEAN, RSTD, b * rows + g, row_end, stride_dy, stride_h, stride_dh, cols, mask,
                        IS_RMS, HAS_DH)  # fmt: skip
        for m in range(g, rows, G):
            row = b * rows + m
            h, dy, dh, mean, rstd = nxt
            h, dy = h.to(tl.float32), dy.to(tl.float32)
            nxt = _load_row(DY, H, DH, MEAN, RSTD, row + G, row_end, stride_dy, stride_h, stride_dh, cols, mask,
                            IS_RMS, HAS_DH)  # fmt: skip
            xhat = tl.where(mask, (h - mean) * rstd, 0.0)
            wdy = w * dy
            dx = wdy - xhat * (_mean(tl.sum(xhat * wdy, axis=0), N))
            if not IS_RMS:
                dx -= _mean(tl.sum(wdy, axis=0), N)
            dx = dx * rstd + dh.to(tl.float32)
            tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        tl.store(DW_PARTIAL + partial + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + partial + cols, db, mask=mask)
    else:
        for m in range(g, rows, G):
            row = b * rows + m
            mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS)
            acc_xg = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):  # pass 1: mean(g * xhat) and mean(g)
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
                wdy = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
                    DY + row * stride_dy + cols, mask=mask, other=0.0
                ).to(tl.float32)
                acc_xg += tl.where(mask, (h - mean) * rstd, 0.0) * wdy
                acc_g += wdy
            c_xg = _mean(tl.sum(acc_xg, axis=0), N)
            c_g = 0.0 if IS_RMS else _mean(tl.sum(acc_g, axis=0), N)
            for start in range(0, N, BLOCK_N):  # pass 2: dx, and the partial sums
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (h - mean) * rstd, 0.0)
                dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                dx = (w * dy - xhat * c_xg - c_g) * rstd
                if HAS_DH:
                    dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
                dw = tl.load(DW_PARTIAL + partial + cols, mask=mask)
                tl.store(DW_PARTIAL + partial + cols, dw + dy * xhat, mask=mask)
                if HAS_BIAS:
                    db = tl.load(DB_PARTIAL + partial + cols, mask=mask)
                    tl.store(DB_PARTIAL + partial + cols, db + dy, mask=mask)


def forward(
    batch: int, rows: int, n: int, *, is_rms: bool, x_dtype: str, weight_dtype: str, has_residual: bool,
    has_bias: bool, eps: float, target: Target, stride_x: int | None = None, stride_residual: int | None = None,
    weight_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs x (batch*rows rows of n, row stride stride_x), weight ((batch,) n), [bias], [residual].
    Outputs y (batch, rows, n), [h (batch, rows, n)], [mean (batch, rows) fp32, layer_norm], rstd (batch, rows)."""
    empty = batch * rows * n == 0
    buffers = {"y": BufferSpec((batch, rows, n), x_dtype, zeroed=empty)}
    if has_residual:
        buffers["h"] = BufferSpec((batch, rows, n), x_dtype, zeroed=empty)
    if not is_rms:
        buffers["mean"] = BufferSpec((batch, rows), "float32", zeroed=empty)
    buffers["rstd"] = BufferSpec((batch, rows), "float32", zeroed=empty)
    launches = ()
    if not empty:
        block, one_block, warps = row_block(n, target)
        launches = (
            Launch(
                norm_fwd_kernel,
                grid=(rows, batch),
                reads=("x", "residual" if has_residual else None, "weight", "bias" if has_bias else None, eps,
                       rows, n, n if stride_x is None else stride_x,
                       n if stride_residual is None else stride_residual, n if weight_batched else 0),
                writes=("y", "h" if has_residual else None, None if is_rms else "mean", "rstd"),
                constexprs=dict(IS_RMS=is_rms, HAS_RESIDUAL=has_residual, HAS_BIAS=has_bias, BLOCK_N=block,
                                ONE_BLOCK=one_block),
                num_warps=warps,
            ),
        )  # fmt: skip
    inputs = {"x": x_dtype, "weight": weight_dtype}
    inputs |= ({"bias": weight_dtype} if has_bias else {}) | ({"residual": x_dtype} if has_residual else {})
    return Plan(inputs, buffers, launches, tuple(buffers))


def backward(
    batch: int, rows: int, n: int, *, is_rms: bool, x_dtype: str, weight_dtype: str, has_bias: bool, has_dh: bool,
    target: Target, stride_dy: int | None = None, stride_h: int | None = None, stride_dh: int | None = None,
    weight_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs dy, h (the normalized input: x, or x + residual), weight, [mean], rstd, [dh].
    Outputs dx (batch, rows, n) in x's dtype, dweight and [dbias] (batch, n) in weight's dtype."""
    block, one_block, warps = row_block(n, target, max_block=BACKWARD_MAX_ROW_BLOCK)
    # enough programs to fill every SM with 2048 threads (narrow rows: many one-warp programs), at most 32 per SM
    programs = programs_per_problem(rows, target, waves=max(1, min(32, 2048 // (warps * target.warp_size))))
    empty = batch * rows * n == 0
    grads = ("dweight", "dbias") if has_bias else ("dweight",)
    buffers = {"dx": BufferSpec((batch, rows, n), x_dtype, zeroed=empty)}
    buffers |= {name: BufferSpec((batch, n), weight_dtype, zeroed=empty) for name in grads}
    launches = ()
    if not empty:
        partials = tuple(f"{name}_partial" for name in grads)
        buffers |= {p: BufferSpec((batch, programs, n), "float32", zeroed=not one_block) for p in partials}
        launches = (
            Launch(
                norm_bwd_kernel,
                grid=(programs, batch),
                reads=("dy", "h", "weight", None if is_rms else "mean", "rstd", "dh" if has_dh else None, rows,
                       n, n if stride_dy is None else stride_dy, n if stride_h is None else stride_h,
                       n if weight_batched else 0, n if stride_dh is None else stride_dh),
                writes=("dx", partials[0], partials[1] if has_bias else None),
                constexprs=dict(IS_RMS=is_rms, HAS_DH=has_dh, HAS_BIAS=has_bias, BLOCK_N=block,
                                ONE_BLOCK=one_block),
                num_warps=warps,
            ),
        ) + tuple(sum_partials(p, name, batch, programs, n) for p, name in zip(partials, grads))  # fmt: skip
    inputs = {"dy": x_dtype, "h": x_dtype, "weight": weight_dtype} | ({} if is_rms else {"mean": "float32"})
    inputs |= {"rstd": "float32"} | ({"dh": x_dtype} if has_dh else {})
    return Plan(inputs, buffers, launches, ("dx",) + grads)


def plans(target: Target, is_rms: bool):
    """Every configuration the heuristics can choose (the AOT matrix)."""
    for dtype in FLOAT_DTYPES:
        for n in WIDTH_BUCKETS:
            for fused in (False, True):  # residual in the forward, dh in the backward; bias with them (layer_norm)
                kw = dict(
                    is_rms=is_rms, x_dtype=dtype, weight_dtype=dtype, has_bias=fused and not is_rms, target=target
                )
                yield forward(1, 4, n, has_residual=fused, eps=1e-6, **kw)
                yield backward(1, 4, n, has_dh=fused, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# validation, reference, cost, samples shared by the family


def check(op: str, x, weight, bias, residual, eps) -> None:
    checks.check_min_ndim(op, "x", x, 1)
    dtype = checks.check_float(op, "x", x)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            checks.check_float(op, name, param)
            checks.check_shape(op, name, param, x.shape[-1:], "the last dim of x")
    if residual is not None:
        checks.check_same_dtype(op, "residual", residual, dtype, "the dtype of x")
        checks.check_shape(op, "residual", residual, x.shape, "the shape of x")
    checks.check_positive(op, "eps", eps)


def _mean_last(a):
    return np.sum(a, axis=-1, keepdims=True) / max(a.shape[-1], 1)


def _normalized(x, eps, residual, is_rms):
    """(h, xhat, rstd) in float64; h rounded to x's dtype as the op returns it."""
    h = x if residual is None else round_to(x.astype(np.float64) + residual.astype(np.float64), str(x.dtype))
    h = h.astype(np.float64)
    centered = h if is_rms else h - _mean_last(h)
    rstd = 1.0 / np.sqrt(_mean_last(centered * centered) + eps)
    return h, centered * rstd, rstd


def reference(x, weight, bias, eps, residual, is_rms):
    """Outputs (y,) or (y, h) in float64."""
    h, xhat, _ = _normalized(x, eps, residual, is_rms)
    y = xhat * weight.astype(np.float64) + (0.0 if bias is None else bias.astype(np.float64))
    return (y,) if residual is None else (y, h)


def reference_vjp(kwargs, cotangents, is_rms):
    x, weight, bias, residual = kwargs["x"], kwargs["weight"], kwargs.get("bias"), kwargs.get("residual")
    _, xhat, rstd = _normalized(x, kwargs["eps"], residual, is_rms)
    dy = cotangents[0].astype(np.float64)
    g = dy * weight.astype(np.float64)
    dx = rstd * (g - xhat * _mean_last(g * xhat) - (0.0 if is_rms else _mean_last(g)))
    if residual is not None:
        dx = dx + cotangents[1].astype(np.float64)
    n = x.shape[-1]
    grads = {"x": dx, "weight": (dy * xhat).reshape(-1, n).sum(axis=0)}
    if bias is not None:
        grads["bias"] = dy.reshape(-1, n).sum(axis=0)
    if residual is not None:
        grads["residual"] = dx
    return grads


def cost(kwargs) -> tuple[Cost, Cost]:
    x, weight, residual = kwargs["x"], kwargs["weight"], kwargs.get("residual")
    numel, n = int(np.prod(x.shape)), x.shape[-1]
    rows = numel // max(n, 1)
    params = 1 if kwargs.get("bias") is None else 2
    item, witem = ITEMSIZE[str(x.dtype)], ITEMSIZE[str(weight.dtype)]
    streams_fwd = 2 if residual is None else 4  # x, y (+ residual, h)
    streams_bwd = 3 if residual is None else 4  # dy, h, dx (+ dh)
    fwd = Cost(numel * item * streams_fwd + params * n * witem + rows * 8, 6 * numel)
    bwd = Cost(numel * item * streams_bwd + 2 * params * n * witem + rows * 8, 10 * numel)
    return fwd, bwd


def sample(rng: np.random.Generator, shape, dtype: str, residual=False, eps=1e-6, bias=False) -> dict:
    """Inputs with a non-zero mean (x ~ N(0.5, 2)) so that centering matters."""
    n = shape[-1:]
    kwargs = {"x": round_to(rng.standard_normal(shape) * 2.0 + 0.5, dtype),
              "weight": round_to(rng.uniform(-2, 2, n), dtype), "eps": eps}  # fmt: skip
    if bias:
        kwargs["bias"] = round_to(rng.standard_normal(n), dtype)
    if residual:
        kwargs["residual"] = round_to(rng.standard_normal(shape), dtype)
    return kwargs


def bad_inputs(op: str, kwargs) -> list[BadInput]:
    x, weight = kwargs["x"], kwargs["weight"]
    other = np.float16 if x.dtype != np.float16 else np.float32
    return [
        BadInput({"x": x.astype(np.int32)}, TypeError, f"{op}: x must have dtype"),
        BadInput({"weight": np.zeros(weight.shape[0] + 1, weight.dtype)}, ValueError, f"{op}: weight must have shape"),
        BadInput({"residual": np.zeros(x.shape + (1,), x.dtype)}, ValueError, f"{op}: residual must have shape"),
        BadInput({"residual": x.astype(other)}, TypeError, f"{op}: residual must have dtype"),
        BadInput({"eps": 0.0}, ValueError, f"{op}: eps must be > 0"),
    ]
