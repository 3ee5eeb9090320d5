"""flash_attention_varlen beyond the registry-driven suite: packed sequences of one length against flash_attention's
batched kernels, ragged sequences (empty ones, sequences without keys, bands over several key blocks), and the
adapters' guarantees (JAX jit / vmap as one launch / grad of vmap, torch opcheck and torch.compile)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import flash_attention as fa
from tile_kernels.core import flash_attention_varlen as fv
from tile_kernels.core.registry import round_to

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")


def _packed(rng, lengths_q, lengths_k, heads_q, heads_k, head_dim, dtype="float32", **options):
    def draw(total, heads):
        return round_to(rng.standard_normal((total, heads, head_dim)), dtype)

    def offsets(lengths):
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    arrays = dict(q=draw(sum(lengths_q), heads_q), k=draw(sum(lengths_k), heads_k), v=draw(sum(lengths_k), heads_k),
                  cu_seqlens_q=offsets(lengths_q), cu_seqlens_k=offsets(lengths_k))  # fmt: skip
    defaults = dict(causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0)
    return arrays | dict(max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k)) | defaults | options


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(5, 3), softcap=2.0)], ids=["causal", "window"])
def test_sequences_of_one_length_match_the_batched_kernels(driver, options):
    """Three packed sequences of 37 tokens give exactly what flash_attention gives the (3, 37, H, D) batch, forward
    and backward (the same kernels, compiled with and without VARLEN)."""
    rng = np.random.default_rng(0)
    kwargs = _packed(rng, [37] * 3, [37] * 3, 4, 2, 32, "bfloat16", **options)
    dout = round_to(rng.standard_normal(kwargs["q"].shape), "bfloat16")
    (out,), grads = driver.vjp(fv.NAME, kwargs, ("q", "k", "v"), (dout,))  # fmt: skip
    batched = {n: kwargs[n].reshape(3, 37, *kwargs[n].shape[1:]) for n in ("q", "k", "v")}
    fixed = batched | {n: kwargs[n] for n in ("causal", "window", "softmax_scale", "softcap")}
    (want,), want_grads = driver.vjp(fa.NAME, fixed, ("q", "k", "v"), (dout.reshape(batched["q"].shape),))
    np.testing.assert_array_equal(out, want.reshape(out.shape))
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(grads[name], want_grads[name].reshape(grads[name].shape))


def test_ragged_sequences_empty_ones_and_multi_block_bands(driver):
    """Sequences of 150 / 0 / 70 / 1 queries over 150 / 5 / 0 / 130 keys, causal with a window: bands over several
    key blocks, a sequence without queries, one without keys (its rows and their gradients 0, no NaN)."""
    rng = np.random.default_rng(1)
    kwargs = _packed(rng, [150, 0, 70, 1], [150, 5, 0, 130], 4, 2, 16, causal=True, window=(90, -1))
    dout = round_to(rng.standard_normal(kwargs["q"].shape), "float32")
    (out,), grads = driver.vjp(fv.NAME, kwargs, ("q", "k", "v"), (dout,))
    no_keys = slice(150, 220)
    assert not np.isnan(out).any() and np.all(out[no_keys] == 0) and np.all(grads["q"][no_keys] == 0)
    assert_close("out", out, fv.reference(**kwargs)[0], "float32")
    for name, ref in fv.reference_vjp(kwargs, (dout,)).items():
        assert_close(f"d{name}", grads[name], ref, "float32")


def test_max_seqlen_above_the_longest_sequence(driver):
    """max_seqlen is an upper bound: a larger one launches more blocks, which return at once, same result."""
    rng = np.random.default_rng(2)
    kwargs = _packed(rng, [9, 30], [12, 30], 2, 2, 16, causal=True)
    (want,) = driver.call(fv.NAME, kwargs)
    (got,) = driver.call(fv.NAME, kwargs | dict(max_seqlen_q=200, max_seqlen_k=300))
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------------------------- JAX


@needs_jax
def test_jax_jit_vmap_and_grad_of_vmap():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    rng = np.random.default_rng(3)
    lengths = [[7, 0, 13], [1, 12, 7], [20, 0, 0]]  # each problem's sequences fill its 20 rows
    cu = jnp.asarray(np.stack([np.concatenate([[0], np.cumsum(n)]) for n in lengths]).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((3, 20, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 20, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 20, 2, 16)), jnp.float32)

    def f(q, k, v, cu):
        return tk.flash_attention_varlen(q, k, v, cu, cu, 20, 20, causal=True, window=(5, -1), softcap=3.0)

    np.testing.assert_array_equal(jax.jit(f)(q[0], k[0], v[0], cu[0]), f(q[0], k[0], v[0], cu[0]))
    text = str(jax.make_jaxpr(jax.vmap(f))(q, k, v, cu))
    assert text.count("triton_kernel_call[") + text.count("pure_callback[") == 1
    batched = jax.vmap(f)(q, k, v, cu)
    for i in range(3):
        np.testing.assert_allclose(batched[i], f(q[i], k[i], v[i], cu[i]), rtol=1e-6, atol=1e-6)

    def loss(q, k, v, cu):
        return jnp.sum(f(q, k, v, cu) * jnp.arange(16.0))

    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cu)
    for i in range(3):
        for got, want in zip(per_example, jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i], cu[i])):
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------------------- torch


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    utils = OPCHECK_UTILS
    q = torch.randn(40, 4, 32, device=dev, requires_grad=True)
    k = torch.randn(45, 2, 32, device=dev, requires_grad=True)
    v = torch.randn(45, 2, 32, device=dev, requires_grad=True)
    cu_q = torch.tensor([0, 17, 17, 40], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 23, 30, 45], dtype=torch.int32, device=dev)
    ops = torch.ops.tile_kernels
    options = (23, 23, True, 8, -1, 32**-0.5, 0.0)
    out, lse = ops.flash_attention_varlen_fwd(q.detach(), k.detach(), v.detach(), cu_q, cu_k, *options)
    for op, args in [
        (ops.flash_attention_varlen_fwd.default, (q, k, v, cu_q, cu_k, *options)),
        (ops.flash_attention_varlen_bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out,
                                                  lse, cu_q, cu_k, *options)),
        (ops.flash_attention_varlen.default, (q, k, v, cu_q, cu_k, 23, 23, True, [4, 0], None, 1.5)),
    ]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch.compile cannot compile Triton kernels in the interpreter")
def test_torch_compile_fullgraph_matches_eager():
    import torch

    import tile_kernels.torch as tk

    cu = torch.tensor([0, 300, 301, 557], dtype=torch.int32, device="cuda")
    q = torch.randn(557, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(557, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(557, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def attend(q, k, v):
        return tk.flash_attention_varlen(q, k, v, cu, cu, 300, 300, causal=True).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    got, grads = compiled(q, k, v), torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want, want_grads = attend(q, k, v), torch.autograd.grad(attend(q, k, v), (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("options", [dict(causal=True, cross=True), dict(window=True, gqa=3),
                                     dict(softcap=True, causal=True, gqa=2)])  # fmt: skip
def test_bench_peers_on_every_option(framework, options):
    """The benchmark's torch eager and jax.jit peers compute the same op for ragged sequences, masks, GQA, softcap."""
    from test_bench import _peer

    peer = _peer(framework, fv.NAME)
    for seed in range(3):
        kwargs = fv.sample(np.random.default_rng(seed), (3, 3, 32), "float32", **options)
        np.testing.assert_allclose(peer(kwargs)[0], fv.reference(**kwargs)[0], rtol=2e-5, atol=2e-6)
