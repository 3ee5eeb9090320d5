"""torch adapter of the norm family (tile_kernels.core.norms): rms_norm and layer_norm, with autograd.

Ops: tile_kernels::rms_norm_fwd / rms_norm_bwd, tile_kernels::layer_norm_fwd / layer_norm_bwd, and the public
composites tile_kernels::rms_norm / layer_norm. rms_norm has three backends (tile_kernels.core.backends): the _fwd /
_bwd ops take the resolved backend's name and run the Triton plans, or call the custom ops
tile_kernels::rms_norm_fwd_compiled / rms_norm_bwd_compiled, which run the TileLang or CUDA C++ kernels (opaque to
torch.compile, with fake implementations)."""

from __future__ import annotations

import math

import torch

from tile_kernels.core import dtype_name, norms
from tile_kernels.core import layer_norm as layer_core
from tile_kernels.core import rms_norm as rms_core

from ._calls import cuda_arch, resolve_backend
from ._runtime import (
    as_rows,
    compact_key,
    compact_run,
    compiled_op,
    eager_op,
    executor,
    plain_eager,
    register_public_op,
    target,
    validated,
)

NO_TENSOR = 0  # size of the (0,)-shaped placeholder of an absent output (h without residual, dbias without bias);
# an int: new_empty parses it in half the time of a tuple


def _forward(x, weight, bias, residual, eps, is_rms):
    """(y, h or placeholder, mean or None, rstd)."""
    n, lead = x.shape[-1], x.shape[:-1]
    weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()  # the kernels read unit strides
    given = (weight,) + ((bias,) if bias is not None else ()) + ((residual,) if residual is not None else ())
    key = compact_key(_forward, x, *given)
    key = key and (*key, eps, is_rms, bias is not None, residual is not None)
    x2, r2, run = x, residual, compact_run(key)
    if run is None:
        x2, rows, stride_x = as_rows(x, n)
        r2, _, stride_r = as_rows(residual, n) if residual is not None else (None, None, None)
        run = executor(
            norms.forward, 1, rows, n, is_rms=is_rms, x_dtype=dtype_name(x.dtype),
            weight_dtype=dtype_name(weight.dtype), has_residual=residual is not None, has_bias=bias is not None,
            eps=eps, target=target(x.device), stride_x=stride_x, stride_residual=stride_r,
        )  # fmt: skip
        compact_run(key, run)
    inputs = (x2, weight) + ((bias,) if bias is not None else ()) + ((r2,) if residual is not None else ())
    outs = run(*inputs, device=x.device, shapes={"y": x, "h": x, "mean": lead, "rstd": lead})
    h = outs[1] if residual is not None else x.new_empty(NO_TENSOR)
    return outs[0], h, None if is_rms else outs[-2], outs[-1]


def _backward(dy, h, weight, mean, rstd, dh, has_bias, is_rms):
    """(dx, dweight, dbias or None); dx is also the residual's gradient."""
    n = h.shape[-1]
    weight = weight.contiguous()
    key = compact_key(_backward, dy, h, weight, *((dh,) if dh is not None else ()))
    key = key and (*key, has_bias, is_rms)
    dy2, h2, dh2, run = dy, h, dh, compact_run(key)
    if run is None:
        (dy2, _, stride_dy), (h2, rows, stride_h) = as_rows(dy, n), as_rows(h, n)
        dh2, _, stride_dh = as_rows(dh, n) if dh is not None else (None, None, None)
        run = executor(
            norms.backward, 1, rows, n, is_rms=is_rms, x_dtype=dtype_name(h.dtype),
            weight_dtype=dtype_name(weight.dtype), has_bias=has_bias, has_dh=dh is not None, target=target(h.device),
            stride_dy=stride_dy, stride_h=stride_h, stride_dh=stride_dh,
        )  # fmt: skip
        compact_run(key, run)
    stats = (rstd.contiguous(),) if is_rms else (mean.contiguous(), rstd.contiguous())  # the kernels' own, compact
    inputs = (dy2, h2, weight, *stats) + ((dh2,) if dh is not None else ())
    grads = run(*inputs, device=h.device, shapes={"dx": h, "dweight": (n,), "dbias": (n,)})
    return grads[0], grads[1], grads[2] if has_bias else None


# --------------------------------------------------------------------------------------------------------- rms_norm


def _compact(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """(1, rows, n) compact view (a copy only when t's rows are strided): the compiled backends' layout."""
    return None if t is None else t.reshape(1, math.prod(t.shape[:-1]), n).contiguous()


@compiled_op("rms_norm_fwd_compiled")
def rms_norm_fwd_compiled(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm_fwd through the TileLang or CUDA C++ kernels."""
    n = x.shape[-1]
    x3, r3 = _compact(x, n), _compact(residual, n)
    run = executor(
        rms_core.compiled_forward,
        backend, 1, x3.shape[1], n, x_dtype=dtype_name(x.dtype), weight_dtype=dtype_name(weight.dtype),
        has_residual=residual is not None, eps=eps, arch=cuda_arch(x.device),
    )  # fmt: skip
    outs = run(*(t for t in (x3, weight.reshape(1, n).contiguous(), r3) if t is not None), device=x.device)
    h = outs[1].view(x.shape) if residual is not None else x.new_empty(NO_TENSOR)
    return outs[0].view(x.shape), h, outs[-1].view(x.shape[:-1])


@rms_norm_fwd_compiled.register_fake
def _(x, weight, residual, eps, backend):
    h = x.new_empty(x.shape if residual is not None else NO_TENSOR)
    return x.new_empty(x.shape), h, x.new_empty(x.shape[:-1], dtype=torch.float32)


@compiled_op("rms_norm_bwd_compiled")
def rms_norm_bwd_compiled(
    dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_bwd through the TileLang or CUDA C++ kernels."""
    n = h.shape[-1]
    h3 = _compact(h, n)
    run = executor(
        rms_core.compiled_backward,
        backend, 1, h3.shape[1], n, x_dtype=dtype_name(h.dtype), weight_dtype=dtype_name(weight.dtype),
        has_dh=dh is not None, target=target(h.device), arch=cuda_arch(h.device),
    )  # fmt: skip
    inputs = (_compact(dy, n), h3, weight.reshape(1, n).contiguous(), rstd.reshape(1, h3.shape[1]).contiguous())
    dx, dweight = run(*inputs, *(() if dh is None else (_compact(dh, n),)), device=h.device)
    return dx.view(h.shape), dweight.view(n)


@rms_norm_bwd_compiled.register_fake
def _(dy, h, weight, rstd, dh, backend):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _rms_fwd(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float, backend: str = "triton"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, h, rstd); h = x + residual, or an empty placeholder when residual is None. `backend` is a
    resolved name (tile_kernels.core.backends.resolve)."""
    if backend != "triton":
        return rms_norm_fwd_compiled(x, weight, residual, eps, backend)
    y, h, _, rstd = _forward(x, weight, None, residual, eps, is_rms=True)
    return y, h, rstd


def _rms_bwd(
    dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None,
    backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (dx, dweight). h is the normalized input (x, or x + residual)."""
    if backend != "triton":
        return rms_norm_bwd_compiled(dy, h, weight, rstd, dh, backend)
    dx, dweight, _ = _backward(dy, h, weight, None, rstd, dh, has_bias=False, is_rms=True)
    return dx, dweight


def _rms_setup_context(ctx, inputs, output):
    x, weight, residual, _, backend = inputs
    _, h, rstd = output
    ctx.has_residual, ctx.backend = residual is not None, backend
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)
    ctx.set_materialize_grads(False)  # an unused h gets None, not a zero tensor the size of x


def _rms_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dy = torch.zeros_like(h) if dy is None else dy  # only h was used
    dh = dh if ctx.has_residual and dh is not None else None
    dx, dweight = rms_norm_bwd(dy, h, weight, rstd, dh, ctx.backend)
    return dx, dweight, (dx if ctx.has_residual else None), None, None


rms_norm_bwd = eager_op("rms_norm_bwd", _rms_bwd)
rms_norm_fwd = eager_op("rms_norm_fwd", _rms_fwd, _rms_setup_context, _rms_backward)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
    backend: str | None = None,
):  # fmt: skip
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; with residual, h = x + residual and returns (y, h).
    y and h have x's dtype, whatever weight's float dtype (the math runs in float32).
    backend: "triton", "tilelang", "cuda", or None for the default of the device (tile_kernels.core.backends).
    Under torch.autocast a residual of another dtype than x is added in their promoted dtype, as `x + residual`."""
    x, residual = _promoted_under_autocast(x, residual)
    _, device = validated(rms_core.NAME, rms_core.check, ("x", "weight", "residual", None), x, weight, residual, eps)
    backend = resolve_backend(rms_core.NAME, backend, device)
    y, h, _ = rms_norm_fwd(x, weight, residual, float(eps), backend)
    return y if residual is None else (y, h)


class _RMSNormAndInput(torch.autograd.Function):
    """(rms_norm(x), x) with the second output x as this node's output: x's gradient through it comes back here and
    joins the norm's in the norm backward's kernel (its dh)."""

    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        y, _, rstd = _rms_fwd(x, weight, None, eps, backend)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend = backend
        ctx.set_materialize_grads(False)
        return y, x  # x returned as a view of itself whose gradient comes to this node

    @staticmethod
    def backward(ctx, dy, dx_direct):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:  # only x was used
            return dx_direct, None, None, None
        dx, dweight = rms_norm_bwd(dy, x, weight, rstd, dx_direct, ctx.backend)
        return dx, dweight, None, None


def rms_norm_and_input(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str | None = None):
    """(rms_norm(x, weight, eps), x) for a caller that also adds x to a residual stream, as a pre-norm decoder layer
    does with its input: in eager mode on plain tensors the second output is x as an output of the norm's autograd
    node, so x's two gradients (through the norm and through the residual stream) meet in the norm backward's kernel
    instead of in an add of autograd's; otherwise (torch.compile, tensor subclasses, no gradient) it is x itself."""
    _, device = validated(rms_core.NAME, rms_core.check, ("x", "weight", None, None), x, weight, None, eps)
    backend = resolve_backend(rms_core.NAME, backend, device)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if wants_grad and plain_eager(x, weight):
        return _RMSNormAndInput.apply(x, weight, float(eps), backend)
    return rms_norm_fwd(x, weight, None, float(eps), backend)[0], x


def _promoted_under_autocast(x, residual):
    """(x, residual) in their promoted dtype when they differ under torch.autocast (activations in bfloat16 beside a
    float32 residual stream), as torch's `x + residual` would add them; unchanged otherwise."""
    if not isinstance(residual, torch.Tensor) or not isinstance(x, torch.Tensor) or residual.dtype == x.dtype:
        return x, residual  # (what is not a tensor, the checks name)
    if not torch.is_autocast_enabled(x.device.type):
        return x, residual
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.to(dtype), residual.to(dtype)


# ------------------------------------------------------------------------------------------------------- layer_norm


def _layer_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, h, mean, rstd); h = x + residual, or an empty placeholder when residual is None."""
    return _forward(x, weight, bias, residual, eps, is_rms=False)


def _layer_bwd(
    dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    dh: torch.Tensor | None, has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (dx, dweight, dbias); dbias is an empty placeholder when has_bias is False."""
    dx, dweight, dbias = _backward(dy, h, weight, mean, rstd, dh, has_bias=has_bias, is_rms=False)
    return dx, dweight, weight.new_empty(NO_TENSOR) if dbias is None else dbias


def _layer_setup_context(ctx, inputs, output):
    x, weight, bias, residual, _ = inputs
    _, h, mean, rstd = output
    ctx.has_residual, ctx.has_bias = residual is not None, bias is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, mean, rstd)
    ctx.set_materialize_grads(False)  # an unused h gets None, not a zero tensor the size of x


def _layer_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    dy = torch.zeros_like(h) if dy is None else dy  # only h was used
    dh = dh if ctx.has_residual and dh is not None else None
    dx, dweight, dbias = layer_norm_bwd(dy, h, weight, mean, rstd, dh, ctx.has_bias)
    return dx, dweight, (dbias if ctx.has_bias else None), (dx if ctx.has_residual else None), None


layer_norm_bwd = eager_op("layer_norm_bwd", _layer_bwd)
layer_norm_fwd = eager_op("layer_norm_fwd", _layer_fwd, _layer_setup_context, _layer_backward)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5,
    residual: torch.Tensor | None = None,
):  # fmt: skip
    """As F.layer_norm(x, x.shape[-1:], weight, bias, eps); with residual, h = x + residual and returns (y, h).
    y and h have x's dtype, whatever the float dtype of weight and bias (the math runs in float32).
    Under torch.autocast a residual of another dtype than x is added in their promoted dtype, as `x + residual`."""
    x, residual = _promoted_under_autocast(x, residual)
    validated(layer_core.NAME, layer_core.check, ("x", "weight", "bias", None, "residual"), x, weight, bias, eps,
              residual)  # fmt: skip
    y, h, _, _ = layer_norm_fwd(x, weight, bias, residual, float(eps))
    return y if residual is None else (y, h)


register_public_op(
    "rms_norm(Tensor x, Tensor weight, float eps=1e-06, Tensor? residual=None, str? backend=None) -> Tensor[]",
    lambda x, weight, eps=1e-6, residual=None, backend=None: list(
        _as_tuple(rms_norm(x, weight, eps, residual, backend))
    ),
)
register_public_op(
    "layer_norm(Tensor x, Tensor weight, Tensor? bias=None, float eps=1e-05, Tensor? residual=None) -> Tensor[]",
    lambda x, weight, bias=None, eps=1e-5, residual=None: list(_as_tuple(layer_norm(x, weight, bias, eps, residual))),
)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)
