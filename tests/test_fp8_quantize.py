"""fp8_quantize beyond the registry-driven suite: the quantization keeps e4m3's precision, the kernel's codes and
scales equal the NumPy reference's bit for bit (divisions and the e4m3 rounding to nearest), its output feeds
fp8_matmul, and the torch / JAX adapters (padded rows read in place, jit, opcheck)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import fp8_matmul as f8
from tile_kernels.core import fp8_quantize as q

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
DEV = "cuda" if DEVICE == "gpu" else "cpu"


@pytest.mark.parametrize("block_rows", q.BLOCK_ROWS)
def test_quantize_stays_within_e4m3_rounding(block_rows):
    """Each block's largest magnitude becomes 448 (e4m3's largest); codes times scales give the values back to
    e4m3's relative rounding (3 mantissa bits: 2^-4) or its scaled subnormal step."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 384)) * 2.0 ** rng.integers(-8, 8, (256, 1))
    codes, scales = q.quantize(x, block_rows)
    assert scales.shape == (256 // block_rows, 3) and scales.dtype == np.float32
    blocks = np.abs(codes.astype(np.float64)).reshape(256 // block_rows, block_rows, 3, 128).max(axis=(1, 3))
    np.testing.assert_allclose(blocks, q.E4M3_MAX, rtol=1e-6)
    back = q.dequantize(codes, scales, block_rows)
    step = np.repeat(np.repeat(scales, block_rows, 0), 128, 1) * 2.0**-9
    assert np.all(np.abs(back - x) <= 2.0**-4 * np.abs(x) + step)


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_rows", q.BLOCK_ROWS)
def test_torch_bits_equal_the_reference_and_feed_fp8_matmul(dtype, block_rows):
    """x with padded rows (read in place): the codes' bytes and the scales equal the reference's exactly; quantized
    a and b then multiply through fp8_matmul as the reference of their dequantized values."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.torch.bench import _tensor

    kwargs = q.sample(np.random.default_rng(1), (256, 384), dtype, block_rows=block_rows)
    x = _tensor(kwargs["x"], DEV)
    padded = torch.zeros(256, 512, dtype=x.dtype, device=DEV)
    padded[:, :384] = x
    codes, scales = tk.fp8_quantize(padded[:, :384], block_rows)
    ref_codes, ref_scales = q.quantize(kwargs["x"], block_rows)
    np.testing.assert_array_equal(codes.view(torch.uint8).cpu().numpy(), ref_codes.view(np.uint8))
    np.testing.assert_array_equal(scales.cpu().numpy(), ref_scales)
    (a, a_scales), (b, b_scales) = tk.fp8_quantize(x[:40], 1), tk.fp8_quantize(x, 128)
    out = tk.fp8_matmul(a, a_scales, b, b_scales, out_dtype=torch.float32)  # x[:40] @ x.T, as e4m3 blocks
    host = [t.cpu().numpy() if t.dtype != torch.float8_e4m3fn else _numpy_e4m3(t) for t in (a, a_scales, b, b_scales)]
    args = dict(zip(("a", "a_scales", "b", "b_scales"), host))
    assert_close("fp8_matmul", out.cpu().double().numpy(), f8.reference(**args)[0], "float32", f8.slack(args)[0])


def _numpy_e4m3(t):
    import ml_dtypes

    return t.view(__import__("torch").uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn)


@needs_jax
def test_jax_jit_matches_the_reference():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    kwargs = q.sample(np.random.default_rng(2), (128, 256), "float16", block_rows=128)
    codes, scales = jax.jit(tk.fp8_quantize, static_argnames="block_rows")(jnp.asarray(kwargs["x"]), block_rows=128)
    ref_codes, ref_scales = q.quantize(kwargs["x"], 128)
    assert codes.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), ref_codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales), ref_scales)


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    x = torch.randn(64, 256, device=DEV, dtype=torch.bfloat16)
    ops = torch.ops.tile_kernels
    for op, args in [(ops.fp8_quantize_fwd.default, (x, 1)), (ops.fp8_quantize.default, (x[:, :128].t().t(), 1))]:
        # test_schema compares outputs by arithmetic torch lacks for float8 tensors
        result = torch.library.opcheck(op, args, test_utils=tuple(u for u in OPCHECK_UTILS if u != "test_schema"))
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_targets():
    from tile_kernels.core.plan import Target

    with pytest.raises(RuntimeError, match="compute capability 8.9 or newer, got 8.6"):
        q.forward(128, 128, dtype="bfloat16", target=Target(cuda_arch=86))
    assert list(q.plans(Target(cuda_arch=80))) == [] and len(list(q.plans(Target(cuda_arch=90)))) == 6
