"""rms_norm_fp8_quantize and swiglu_fp8_quantize beyond the registry-driven suite: the fused cast gives what the
unfused ops give one after the other on the same device (the registry suite compares with the float64 reference,
within a step of e4m3), inputs read in place at padded row strides, the width limit, JAX jit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, needs_torch
from drivers import DRIVERS

from tile_kernels.core import fp8_quantize as q
from tile_kernels.core import rms_norm_fp8_quantize as rq
from tile_kernels.core import swiglu_fp8_quantize as sq

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
DEV = "cuda" if DEVICE == "gpu" else "cpu"


def _padded(t, width):
    """t (R, K) as the first K columns of an (R, width) tensor: a row stride of width, read in place."""
    import torch

    wide = torch.full((t.shape[0], width), float("nan"), dtype=t.dtype, device=t.device)
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


def _assert_within_a_step(codes, scales, want_codes, want_scales):
    """Codes equal, or one e4m3 step apart where the two rms_norm kernels' float32 sums round differently (their
    reduction orders may differ on a GPU); scales within 2^-6."""
    import torch

    steps, scale_slack = q.fused_cast_slack(want_codes.float().cpu().numpy(), want_scales.cpu().numpy())
    off = (codes.float() - want_codes.float()).abs().cpu().numpy()
    assert (off <= steps).all(), f"codes off by {(off / steps).max():.2f} steps"
    assert ((scales - want_scales).abs().cpu().numpy() <= scale_slack).all()
    if DEV == "cpu":  # one interpreter, one order of operations: the same bits
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scales, want_scales)


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("residual", [False, True])
def test_torch_rms_norm_cast_matches_the_unfused_ops(dtype, residual):
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.torch.bench import _tensor

    kwargs = rq.sample(np.random.default_rng(0), (37, 1152), dtype, residual=residual)
    x, weight = _padded(_tensor(kwargs["x"], DEV), 1280), _tensor(kwargs["weight"], DEV)
    res = _padded(_tensor(kwargs["residual"], DEV), 1408) if residual else None
    out = tk.rms_norm_fp8_quantize(x, weight, 1e-6, res)
    unfused = tk.rms_norm(x, weight, 1e-6, res)
    y = unfused[0] if residual else unfused
    want_codes, want_scales = tk.fp8_quantize(y)
    assert out[0].dtype == torch.float8_e4m3fn and out[1].shape == (37, 9)
    _assert_within_a_step(out[0], out[1], want_codes, want_scales)
    if residual:
        torch.testing.assert_close(out[2], unfused[1], rtol=0, atol=0)


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_swiglu_cast_equals_the_unfused_ops(dtype):
    """Elementwise math, the same in both kernels: the same bits on any device."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.torch.bench import _tensor

    kwargs = sq.sample(np.random.default_rng(1), (33, 1024), dtype)
    fused = _tensor(np.concatenate([kwargs["gate"], kwargs["up"]], axis=1), DEV)  # a gate-up projection's output
    gate, up = fused[:, :1024], fused[:, 1024:]
    codes, scales = tk.swiglu_fp8_quantize(gate, up)
    want_codes, want_scales = tk.fp8_quantize(tk.swiglu(gate, up))
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)


@needs_torch
def test_torch_width_limit_is_a_clear_error():
    import torch

    import tile_kernels.torch as tk

    x = torch.zeros(2, rq.MAX_K + 128, device=DEV)
    with pytest.raises(ValueError, match=r"rms_norm_fp8_quantize: x must be 2-D \(R, K\) with K a multiple of 128 up"):
        tk.rms_norm_fp8_quantize(x, torch.ones(rq.MAX_K + 128, device=DEV))


@needs_jax
def test_jax_jit_matches_the_unfused_ops():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    kwargs = rq.sample(np.random.default_rng(2), (16, 512), "float32", residual=True)
    x, weight, res = (jnp.asarray(kwargs[k]) for k in ("x", "weight", "residual"))
    codes, scales, h = jax.jit(tk.rms_norm_fp8_quantize, static_argnames="eps")(x, weight, eps=1e-6, residual=res)
    y, h_unfused = tk.rms_norm(x, weight, 1e-6, res)
    want_codes, want_scales = tk.fp8_quantize(y)
    steps, scale_slack = q.fused_cast_slack(np.asarray(want_codes, np.float32), np.asarray(want_scales))
    assert (np.abs(np.asarray(codes, np.float32) - np.asarray(want_codes, np.float32)) <= steps).all()
    assert (np.abs(np.asarray(scales) - np.asarray(want_scales)) <= scale_slack).all()
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_unfused))
    gate, up = jnp.asarray(kwargs["x"][:, :256]), jnp.asarray(kwargs["residual"][:, :256])
    codes, scales = jax.jit(tk.swiglu_fp8_quantize)(gate, up)
    want_codes, want_scales = tk.fp8_quantize(tk.swiglu(gate, up))
    np.testing.assert_array_equal(np.asarray(codes, np.float32), np.asarray(want_codes, np.float32))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
