"""mla_decode beyond the registry-driven suite: DeepSeek-V3's dims (latent 512, rope 64), paged and contiguous caches
agree on the same data (pages out of order), split counts 1 and many agree with the log-sum-exp (the plans run
directly, poisoned), and the adapters' guarantees (JAX jit / vmap as one launch, torch opcheck and torch.compile)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import Target, host
from tile_kernels.core import mla_decode as mla
from tile_kernels.core.registry import round_to

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
needs_torch = pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
needs_interpreter = pytest.mark.skipif(DEVICE != "cpu", reason="runs the plans on NumPy arrays in the interpreter")


def _contiguous(rng, lengths, capacity, heads, latent_dim, rope_dim, dtype="float32") -> dict:
    def draw(*shape):
        return round_to(rng.standard_normal(shape), dtype)

    batch = len(lengths)
    return dict(q_nope=draw(batch, heads, latent_dim), q_pe=draw(batch, heads, rope_dim),
                kv_c=draw(batch, capacity, latent_dim), k_pe=draw(batch, capacity, rope_dim),
                cache_seqlens=np.array(lengths, np.int32), block_table=None, softmax_scale=None,
                return_lse=True)  # fmt: skip


def _paged(rng, kwargs: dict, page_size: int) -> dict:
    """The same caches in a pool of pages (two spare ones), the block table shuffled."""
    batch, capacity = kwargs["kv_c"].shape[:2]
    pages = capacity // page_size
    table = rng.permutation(np.arange(batch * pages) + 2).reshape(batch, pages).astype(np.int32)
    pools = {}
    for name in ("kv_c", "k_pe"):
        cache = kwargs[name]
        pool = round_to(rng.standard_normal((batch * pages + 2, page_size, cache.shape[2])), str(cache.dtype))
        pool[table] = cache.reshape(batch, pages, page_size, cache.shape[2])
        pools[name] = pool
    return {**kwargs, **pools, "block_table": table}


def _run_plan(kwargs: dict, num_splits: int | None):
    """The op's plan run directly (poisoned buffers, TILE_KERNELS_POISON=1), with a forced split count."""
    q_nope, kv, table = kwargs["q_nope"], kwargs["kv_c"], kwargs["block_table"]
    batch, heads, latent_dim = q_nope.shape
    capacity = kv.shape[1] * (table.shape[1] if table is not None else 1)
    plan = mla.forward(batch, heads, latent_dim, kwargs["q_pe"].shape[2], capacity, dtype=str(q_nope.dtype),
                       scale=None, target=Target(), page_size=kv.shape[1] if table is not None else None,
                       num_splits=num_splits)  # fmt: skip
    names = ["q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens"] + (["block_table"] if table is not None else [])
    return [o.astype(np.float64) for o in host.run_plan(plan, *(kwargs[n] for n in names))]


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_counts_agree_paged_and_contiguous(num_splits, monkeypatch):
    monkeypatch.setenv("TILE_KERNELS_POISON", "1")
    rng = np.random.default_rng(num_splits)
    kwargs = _contiguous(rng, [0, 1, 63, 64, 97], 128, 5, 40, 8)
    want = mla.reference(**kwargs)
    for case in (kwargs, _paged(rng, kwargs, 16)):
        out, lse = _run_plan(case, num_splits)
        assert_close("out", out, want[0], "float32")
        assert_close("lse", lse, want[1], "float32")
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)  # a sequence of length 0


@pytest.mark.parametrize("framework", sorted(DRIVERS))
def test_deepseek_dims(framework):
    """Latent 512, rope 64, 16 heads, bf16 on a GPU (fp32 in the interpreter), page 64 as FlashMLA's."""
    dtype = "bfloat16" if DEVICE == "gpu" else "float32"
    rng = np.random.default_rng(7)
    kwargs = _paged(rng, _contiguous(rng, [130, 0, 64], 192, 16, 512, 64, dtype), 64)
    want = mla.reference(**kwargs)
    got = DRIVERS[framework](DEVICE).call("mla_decode", kwargs)
    assert_close("out", got[0], want[0], dtype)
    assert_close("lse", got[1], want[1], "float32")


@needs_jax
def test_jax_jit_and_vmap_as_one_launch():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    rng = np.random.default_rng(5)
    examples = [_paged(rng, _contiguous(rng, [i * 20, 31 - i], 32, 3, 24, 8), 8) for i in range(3)]
    names = ["q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table"]
    stacked = {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in names}

    def f(arrays):
        return tk.mla_decode(**arrays, return_lse=True)

    first = {k: v[0] for k, v in stacked.items()}
    for a, b in zip(jax.jit(f)(first), f(first)):
        np.testing.assert_array_equal(a, b)
    text = str(jax.make_jaxpr(jax.vmap(f))(stacked))
    assert text.count("triton_kernel_call[") + text.count("pure_callback[") == 1
    batched = jax.vmap(f)(stacked)
    for i, e in enumerate(examples):
        want = mla.reference(**e)
        assert_close(f"vmap {i}", np.asarray(batched[0][i], np.float64), want[0], "float32")
        assert_close(f"vmap lse {i}", np.asarray(batched[1][i], np.float64), want[1], "float32")


@needs_torch
def test_torch_opcheck_and_compile():
    import torch

    import tile_kernels.torch as tk

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    rng = np.random.default_rng(6)
    kwargs = _paged(rng, _contiguous(rng, [40, 0, 17], 48, 4, 32, 16), 16)
    names = ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table")
    q_nope, q_pe, kv, kp, lengths, table = (torch.from_numpy(kwargs[n]).to(dev) for n in names)
    ops = torch.ops.tile_kernels
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in [
        (ops.mla_decode_fwd.default, (q_nope, q_pe, kv, kp, lengths, table, 0.2)),
        (ops.mla_decode_fwd.default, (q_nope, q_pe, kv[:3], kp[:3], lengths, None, 0.2)),
        (ops.mla_decode.default, (q_nope, q_pe, kv, kp, lengths, table, None, True)),
    ]:
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(r == "SUCCESS" for r in result.values()), (op, result)

    def step(q_nope, q_pe, kv, kp, lengths, table):
        out, lse = tk.mla_decode(q_nope, q_pe, kv, kp, lengths, table, return_lse=True)
        return out.square().sum(-1) + lse.clamp_min(-1e4)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if DEVICE == "gpu" else "aot_eager")
    torch.testing.assert_close(
        compiled(q_nope, q_pe, kv, kp, lengths, table), step(q_nope, q_pe, kv, kp, lengths, table)
    )
