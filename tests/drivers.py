"""Framework drivers: the same test drives tile_kernels.torch and tile_kernels.jax through these.

Arrays enter as NumPy (in their real dtype, bfloat16 via ml_dtypes) and leave as float64 NumPy."""

from __future__ import annotations

import importlib.util

import numpy as np


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class TorchDriver:
    name = "torch"
    layouts = ("contiguous", "row_padded", "permuted")

    def __init__(self, device: str):
        import torch

        import tile_kernels.torch as ops

        self.torch, self.ops = torch, ops
        self.device = "cuda" if device == "gpu" else "cpu"

    def array(self, a, layout: str = "contiguous"):
        """A tensor holding a's values; row_padded / permuted give non-contiguous tensors of the same values."""
        torch = self.torch
        if not isinstance(a, (np.ndarray, np.generic)):
            return a
        host = np.asarray(a.astype(np.float32) if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a)
        t = torch.from_numpy(host.copy())  # a copy keeps 0-d arrays 0-d (ascontiguousarray would not)
        t = t.to(self.device, getattr(torch, a.dtype.name))
        if layout == "row_padded" and t.dim() >= 1:
            pad = float("nan") if t.is_floating_point() else -1  # the padding must never be read
            wide = torch.full(t.shape[:-1] + (t.shape[-1] + 3,), pad, dtype=t.dtype, device=t.device)
            wide[..., : t.shape[-1]] = t
            return wide[..., : t.shape[-1]]
        if layout == "permuted" and t.dim() >= 3:
            return t.transpose(0, 1).contiguous().transpose(0, 1)
        return t

    def numpy(self, t):
        return t.detach().to("cpu", self.torch.float64).numpy()

    def call(self, op: str, kwargs: dict, layout: str = "contiguous"):
        args = {k: self.array(v, layout) for k, v in kwargs.items()}
        return tuple(self.numpy(o) for o in _as_tuple(getattr(self.ops, op)(**args)))

    def vjp(self, op: str, kwargs: dict, grad_args: tuple, cotangents: tuple, layout: str = "contiguous"):
        args = {k: self.array(v, layout) for k, v in kwargs.items()}
        leaves = {k: args[k].requires_grad_() for k in grad_args if args.get(k) is not None}
        outs = _as_tuple(getattr(self.ops, op)(**args))
        if not leaves:  # an op without a gradient (grad_args empty): the forward only
            return tuple(self.numpy(o) for o in outs), {}
        cts = [self.array(c, layout) for c in cotangents]
        grads = self.torch.autograd.grad(outs, list(leaves.values()), cts)
        return tuple(self.numpy(o) for o in outs), {k: self.numpy(g) for k, g in zip(leaves, grads)}


class JaxDriver:
    name = "jax"
    layouts = ("contiguous",)  # JAX arrays have no strides

    def __init__(self, device: str):
        import jax
        import jax.numpy as jnp

        import tile_kernels.jax as ops

        self.jax, self.jnp, self.ops = jax, jnp, ops

    def array(self, a, layout: str = "contiguous"):
        return self.jnp.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a

    def numpy(self, a):
        return np.asarray(a).astype(np.float64)

    def call(self, op: str, kwargs: dict, layout: str = "contiguous"):
        args = {k: self.array(v) for k, v in kwargs.items()}
        return tuple(self.numpy(o) for o in _as_tuple(getattr(self.ops, op)(**args)))

    def vjp(self, op: str, kwargs: dict, grad_args: tuple, cotangents: tuple, layout: str = "contiguous"):
        args = {k: self.array(v) for k, v in kwargs.items()}
        names = [k for k in grad_args if args.get(k) is not None]
        if not names:  # an op without a gradient (grad_args empty): the forward only
            return self.call(op, kwargs, layout), {}

        def f(*diff):
            return _as_tuple(getattr(self.ops, op)(**{**args, **dict(zip(names, diff))}))

        outs, vjp_fn = self.jax.vjp(f, *[args[k] for k in names])
        grads = vjp_fn(tuple(self.jnp.asarray(c, o.dtype) for c, o in zip(cotangents, outs)))  # JAX: the output's dtype
        return tuple(self.numpy(o) for o in outs), {k: self.numpy(g) for k, g in zip(names, grads)}


DRIVERS = {
    name: cls
    for name, cls, module in (("torch", TorchDriver, "torch"), ("jax", JaxDriver, "jax"))
    if importlib.util.find_spec(module) is not None
}
