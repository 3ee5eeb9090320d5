"""Property tests of every registered op, through every framework driver, against the float64 references.

Tolerance (flash-attention's rule, with output rounding as the same-dtype baseline): the max error of the kernel's
output must be within 2x the error of rounding the float64 reference to the output dtype, plus one output-scale ulp
(the interpreter rounds bfloat16 by truncation)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from conftest import DEVICE
from hypothesis import HealthCheck, currently_in_test_context, given, reject, settings
from hypothesis import strategies as st

from tile_kernels.core import REGISTRY, backends
from tile_kernels.core.registry import round_to

DTYPES = ("float32", "float16", "bfloat16")
ULP = {"float32": 1e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}
OPS = sorted(REGISTRY)
PLATFORM = "cpu" if DEVICE == "cpu" else os.environ.get("TILE_KERNELS_GPU_VENDOR", "cuda")
# (op, backend) for every backend that can run on this platform; backend None for an op with only one (no argument)
OP_BACKENDS = [
    pytest.param(op, b if len(backends.backends_of(op)) > 1 else None, id=f"{op}-{b}" if b != "triton" else op)
    for op in OPS
    for b in backends.backends_of(op)
    if b == "triton" or PLATFORM == "cuda"
]


def _with_gradient(params: list) -> list:
    """`params` (ops, or pytest.params of (op, backend)), those of an op without a gradient skipped, saying why."""
    out = []
    for p in params:
        values, name = getattr(p, "values", (p,)), getattr(p, "id", p)
        why = None if REGISTRY[values[0]].grad_args else f"{values[0]} is not differentiable (grad_args is empty)"
        out.append(pytest.param(*values, id=name, marks=[pytest.mark.skip(reason=why)] if why else []))
    return out


# widths: small odd ones, and buckets around the in-register limit (16384) and the streamed path
WIDTHS = st.one_of(st.integers(1, 300), st.sampled_from([512, 1000, 4096, 8193, 16384, 16385, 40000]))


def assert_close(what: str, out: np.ndarray, ref: np.ndarray, dtype: str, slack=None) -> None:
    """slack: the op's elementwise hardware error allowance (OpInfo.slack), added to the bound."""
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    if dtype.startswith("int"):  # integer outputs (moe_route's) are exact
        np.testing.assert_array_equal(out, ref, err_msg=what)
        return
    nan = np.isnan(ref)  # e.g. a mean over no rows: the output must be NaN exactly there
    assert np.array_equal(np.isnan(out), nan), f"{what}: NaN at {np.argwhere(np.isnan(out) != nan)[:4].tolist()}"
    inf = np.isinf(ref)  # e.g. the log-sum-exp of no position (-inf): the output must be the same infinity there
    assert np.array_equal(out[inf], ref[inf]), f"{what}: not {ref[inf][:4]} at {np.argwhere(inf)[:4].tolist()}"
    finite = ~nan & ~inf
    out, ref = out[finite], ref[finite]
    if ref.size == 0:
        return
    baseline = np.abs(round_to(ref, dtype).astype(np.float64) - ref).max()
    bound = 2 * baseline + ULP[dtype] * max(1.0, np.abs(ref).max())
    if slack is not None:  # checked elementwise: the error beyond bound must be within each element's slack
        excess = np.abs(out - ref) - bound - np.broadcast_to(slack, finite.shape)[finite]
        assert excess.max() <= 0, f"{what} ({dtype}): error {excess.max():.3g} over bound {bound:.3g} + slack"
        return
    err = np.abs(out - ref).max()
    assert err <= bound, f"{what} ({dtype}): max error {err:.3g} > bound {bound:.3g} (rounding baseline {baseline:.3g})"


@st.composite
def problems(draw, op: str, backend: str | None = None):
    """(kwargs, layout seed) for one call of `op`: random leading dims (0-3 of them, zeros allowed), width, dtype,
    options, and the layout the torch driver gives its tensors. A backend module's DTYPES and SUPPORTED_OPTIONS (the
    options it runs, e.g. no epilogue) narrow the draws to what it can run."""
    info = REGISTRY[op]
    n = draw(WIDTHS)
    max_rows = max(1, min(64, (1 << 19) // n))
    lead = draw(st.lists(st.integers(0, 6), max_size=3).filter(lambda s: math.prod(s) <= max_rows))
    module = backends.module(op, backend) if backend not in (None, "triton") else None
    dtype = draw(st.sampled_from([d for d in DTYPES if d in getattr(module, "DTYPES", DTYPES)]))
    options = {
        k: draw(st.sampled_from(v)) for k, v in {**info.options, **getattr(module, "SUPPORTED_OPTIONS", {})}.items()
    }
    seed = draw(st.integers(0, 2**32 - 1))
    layout = draw(st.sampled_from(("contiguous", "row_padded", "permuted")))
    return info.sample(np.random.default_rng(seed), tuple(lead) + (n,), dtype, **options), layout, seed


def _dtype(kwargs) -> str:
    """The op's output dtype: its out_dtype where it has one (fp8_matmul), else that of its first array argument."""
    return kwargs.get("out_dtype") or next(str(v.dtype) for v in kwargs.values() if isinstance(v, np.ndarray))


def _layout(driver, layout):
    return layout if layout in driver.layouts else "contiguous"


def _with_backend(kwargs: dict, op: str, backend: str | None) -> dict:
    """The call's arguments plus backend= (for an op with several backends); skips one that cannot run here (its
    toolchain missing: the reason shows in the report)."""
    if backend is None:
        return kwargs
    why = backends.unavailable(backend, PLATFORM)
    if why:
        pytest.skip(f"{op}: backend {backend!r} {why}")
    why = backends.unsupported_inputs(op, backend, kwargs)  # e.g. float32 for flash_attention's TileLang forward
    if why:
        reject() if currently_in_test_context() else pytest.skip(f"{op}: backend {backend!r} {why}")
    return {**kwargs, "backend": backend}


@pytest.mark.parametrize("op, backend", OP_BACKENDS)
@given(data=st.data())
# a backend that covers a small part of the drawn inputs (mla_decode's TileLang kernel: Dc 512, half precision, pages
# of 64) rejects most draws: what it accepts still runs
@settings(suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow, HealthCheck.data_too_large])
def test_forward_matches_reference(driver, op, backend, data):
    kwargs, layout, _ = data.draw(problems(op, backend))
    outs = driver.call(op, _with_backend(kwargs, op, backend), _layout(driver, layout))
    info = REGISTRY[op]
    refs = info.reference(**kwargs)
    assert len(outs) == len(refs)
    slack = info.slack(kwargs) if info.slack else (None,) * len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_close(f"{op} output {i}", out, ref, _dtype(kwargs), slack[i])


@pytest.mark.parametrize("op, backend", _with_gradient(OP_BACKENDS))
@given(data=st.data())
@settings(suppress_health_check=[HealthCheck.filter_too_much])  # as test_forward_matches_reference
def test_gradients_match_reference(driver, op, backend, data):
    info = REGISTRY[op]
    kwargs, layout, seed = data.draw(problems(op, backend))
    dtype = _dtype(kwargs)
    refs = info.reference(**kwargs)
    rng = np.random.default_rng(seed + 1)
    cotangents = tuple(round_to(rng.standard_normal(r.shape), dtype) for r in refs)
    args = _with_backend(kwargs, op, backend)
    outs, grads = driver.vjp(op, args, info.grad_args, cotangents, _layout(driver, layout))
    ref_grads = info.reference_vjp(kwargs, cotangents)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert_close(f"{op} d{name}", grad, ref_grads[name], str(kwargs[name].dtype))


@pytest.mark.parametrize("op, backend", OP_BACKENDS)
@pytest.mark.parametrize("shape", [(2, 262144), (3, 65536 + 7)], ids=["256K", "64K+7"])
def test_wide_rows_forward_and_backward(driver, op, backend, shape):
    """The streamed path at the widths named in the issue (bfloat16, the common training dtype)."""
    info = REGISTRY[op]
    kwargs = info.sample(np.random.default_rng(0), shape, "bfloat16", **{k: v[-1] for k, v in info.options.items()})
    refs = info.reference(**kwargs)
    cotangents = tuple(round_to(np.random.default_rng(1).standard_normal(r.shape), "bfloat16") for r in refs)
    outs, grads = driver.vjp(op, _with_backend(kwargs, op, backend), info.grad_args, cotangents)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_close(f"{op} output {i}", out, ref, "bfloat16")
    for name, ref in info.reference_vjp(kwargs, cotangents).items():
        assert_close(f"{op} d{name}", grads[name], ref, "bfloat16")


@pytest.mark.parametrize("op, backend", OP_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 8), (4, 0)], ids=["no-rows", "no-rows-3d", "no-cols"])
def test_empty_inputs_give_empty_outputs_and_zero_weight_grads(driver, op, backend, shape):
    info = REGISTRY[op]
    kwargs = info.sample(np.random.default_rng(0), shape, "float32")
    refs = info.reference(**kwargs)
    cotangents = tuple(np.zeros(r.shape, np.float32) for r in refs)
    outs, grads = driver.vjp(op, _with_backend(kwargs, op, backend), info.grad_args, cotangents)
    assert [o.shape for o in outs] == [r.shape for r in refs]
    for name, grad in grads.items():
        assert grad.shape == kwargs[name].shape
        assert np.all(grad == 0), f"d{name} of an empty input must be zeros"


@pytest.mark.parametrize("op, backend", OP_BACKENDS)
def test_bad_inputs_raise_clear_errors(driver, op, backend):
    info = REGISTRY[op]
    kwargs = info.sample(np.random.default_rng(0), (3, 17), "float32", **{k: v[-1] for k, v in info.options.items()})
    for bad in info.bad_inputs(kwargs):
        with pytest.raises(bad.error, match=bad.match):
            driver.call(op, {**_with_backend(kwargs, op, backend), **bad.changes})


@pytest.mark.parametrize("op", _with_gradient(OPS))
def test_references_agree_with_finite_differences(op):
    """The float64 reference VJPs that everything is checked against are themselves checked numerically."""
    info = REGISTRY[op]
    rng = np.random.default_rng(0)
    kwargs = info.sample(rng, (3, 5), "float32", **{k: v[-1] for k, v in info.options.items()})
    kwargs = {k: v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
              for k, v in kwargs.items()}  # fmt: skip
    cotangents = tuple(rng.standard_normal(r.shape) for r in info.reference(**kwargs))
    grads = info.reference_vjp(kwargs, cotangents)

    def objective(**kw):
        return sum(np.sum(o * c) for o, c in zip(info.reference(**kw), cotangents))

    eps = 1e-6
    for name, grad in grads.items():
        numeric = np.zeros_like(kwargs[name])
        for idx in np.ndindex(numeric.shape):
            plus, minus = kwargs[name].copy(), kwargs[name].copy()
            plus[idx] += eps
            minus[idx] -= eps
            numeric[idx] = (objective(**{**kwargs, name: plus}) - objective(**{**kwargs, name: minus})) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-6, err_msg=f"{op} d{name}")
