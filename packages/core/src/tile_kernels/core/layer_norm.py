"""LayerNorm (as torch.nn.functional.layer_norm over the last dim) with an optional bias and fused residual add.

    h = x + residual                      (rounded to x.dtype: it is returned, as in an unfused model)
    y = (h - mean(h)) * rstd * weight + bias,  rstd = 1 / sqrt(var(h) + eps)        in fp32

Kernels, plans, reference and validation are shared with rms_norm in norms.py (is_rms=False).
"""

from __future__ import annotations

import functools

from . import norms
from .registry import OpInfo, register

NAME = "layer_norm"


def check(x, weight, bias=None, eps=1e-5, residual=None) -> None:
    norms.check(NAME, x, weight, bias, residual, eps)


def reference(x, weight, bias=None, eps=1e-5, residual=None):
    return norms.reference(x, weight, bias, eps, residual, is_rms=False)


INFO = register(
    OpInfo(
        name=NAME,
        sample=norms.sample,
        options={"residual": (False, True), "bias": (False, True), "eps": (1e-5, 1e-2)},
        reference=reference,
        reference_vjp=functools.partial(norms.reference_vjp, is_rms=False),
        grad_args=("x", "weight", "bias", "residual"),
        cost=norms.cost,
        bad_inputs=functools.partial(norms.bad_inputs, NAME),
        plans=functools.partial(norms.plans, is_rms=False),
    )
)
