"""RMSNorm with an optional fused residual add.

    h = x + residual                      (rounded to x.dtype: it is returned, as in an unfused model)
    y = h * rstd * weight,  rstd = 1 / sqrt(mean(h^2) + eps)        over the last dim, in fp32

Kernels, plans, reference and validation are shared with layer_norm in norms.py (is_rms=True).
"""

from __future__ import annotations

import functools

from . import norms
from .registry import OpInfo, register

NAME = "rms_norm"


def check(x, weight, residual=None, eps=1e-6) -> None:
    norms.check(NAME, x, weight, None, residual, eps)


def reference(x, weight, eps=1e-6, residual=None):
    return norms.reference(x, weight, None, eps, residual, is_rms=True)


INFO = register(
    OpInfo(
        name=NAME,
        sample=functools.partial(norms.sample, bias=False),
        options={"residual": (False, True), "eps": (1e-6, 1e-2)},
        reference=reference,
        reference_vjp=functools.partial(norms.reference_vjp, is_rms=True),
        grad_args=("x", "weight", "residual"),
        cost=norms.cost,
        bad_inputs=functools.partial(norms.bad_inputs, NAME),
        plans=functools.partial(norms.plans, is_rms=True),
    )
)
