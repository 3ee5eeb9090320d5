"""flash_attention beyond the registry-driven suite: the masking conventions (bottom-right causal, windows) checked
against independent formulations, rows that see no key, multi-block bands, the adapters' guarantees (JAX jit / vmap
as one launch / grad of vmap, torch opcheck and torch.compile) and the benchmark peers on every option."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import flash_attention as fa
from tile_kernels.core.registry import round_to

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")


def _qkv(rng, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype="float32"):
    def draw(s, h):
        return round_to(rng.standard_normal((batch, s, h, head_dim)), dtype)

    return draw(seqlen_q, heads_q), draw(seqlen_k, heads_k), draw(seqlen_k, heads_k)


def test_visibility_follows_flash_attn_conventions():
    """Bottom-right causal when Sq != Sk; window (left, right) around the shifted diagonal; -1 = unbounded."""
    assert fa.visible(2, 4, causal=True).astype(int).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert fa.visible(4, 2, causal=True).astype(int).tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]
    assert fa.visible(3, 3, window=(1, 0)).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    assert fa.visible(3, 3, window=(0, 1)).astype(int).tolist() == [[1, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert fa.visible(3, 3, causal=True, window=(-1, 2)).astype(int).tolist() == fa.visible(3, 3, True).tolist()


@needs_torch
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 9), (9, 9), (6, 3)])
def test_reference_matches_torch_sdpa_with_an_explicit_mask(seqlen_q, seqlen_k):
    """The float64 reference against torch's SDPA given the bottom-right causal mask as a tril with an offset, GQA
    expanded (an independent formulation of the convention); rows that see no key are 0 in the reference."""
    import torch
    import torch.nn.functional as F

    q, k, v = _qkv(np.random.default_rng(0), 2, seqlen_q, seqlen_k, 4, 2, 8, "float32")
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(diagonal=seqlen_k - seqlen_q)
    qt, kt, vt = (torch.from_numpy(a).double().transpose(1, 2) for a in (q, k, v))
    want = F.scaled_dot_product_attention(qt, kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1), attn_mask=mask)
    want = want.transpose(1, 2).nan_to_num(0.0).numpy()
    want[:, ~mask.any(1).numpy()] = 0.0
    np.testing.assert_allclose(fa.reference(q, k, v, causal=True)[0], want, rtol=1e-12, atol=1e-12)


CASES = [  # (Sq, Sk, Hq, Hk, D, causal, window, softcap): bands that cross several 64/128-row key blocks
    (150, 150, 2, 1, 16, False, (70, 5), 0.0),
    (130, 200, 3, 1, 16, True, (-1, -1), 0.0),
    (200, 70, 2, 2, 24, True, (40, -1), 1.5),
    (129, 129, 2, 1, 16, False, (-1, 0), 0.0),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES])
def test_multi_block_bands(driver, case):
    seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window, softcap = case
    rng = np.random.default_rng(seqlen_q)
    q, k, v = _qkv(rng, 1, seqlen_q, seqlen_k, heads_q, heads_k, head_dim)
    kwargs = dict(q=q, k=k, v=v, causal=causal, window=window, softmax_scale=None, softcap=softcap)
    dout = round_to(rng.standard_normal(q.shape), "float32")
    (out,), grads = driver.vjp(fa.NAME, kwargs, ("q", "k", "v"), (dout,))
    assert_close("out", out, fa.reference(**kwargs)[0], "float32")
    for name, ref in fa.reference_vjp(kwargs, (dout,)).items():
        assert_close(f"d{name}", grads[name], ref, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_that_see_no_key_give_zeros_not_nan(driver, dtype):
    """Sq > Sk with causal: the first Sq - Sk rows see no key (flash-attn: output 0); their gradients are 0 too.
    Also a window that leaves rows empty, and Sk = 0."""
    rng = np.random.default_rng(1)
    for seqlen_q, seqlen_k, causal, window in [(9, 3, True, (-1, -1)), (6, 4, False, (0, 0)), (5, 0, False, (-1, -1))]:
        q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 2, 1, 16, dtype)
        kwargs = dict(q=q, k=k, v=v, causal=causal, window=window, softmax_scale=None, softcap=0.0)
        empty_rows = ~fa.visible(seqlen_q, seqlen_k, causal, window).any(axis=1)
        assert empty_rows.any()
        dout = round_to(rng.standard_normal(q.shape), dtype)
        (out,), grads = driver.vjp(fa.NAME, kwargs, ("q", "k", "v"), (dout,))
        assert not np.isnan(out).any() and np.all(out[:, empty_rows] == 0)
        assert np.all(grads["q"][:, empty_rows] == 0)
        assert_close("out", out, fa.reference(**kwargs)[0], dtype)
        for name, ref in fa.reference_vjp(kwargs, (dout,)).items():
            assert_close(f"d{name}", grads[name], ref, dtype)


@pytest.mark.parametrize("chunk_bytes, chunk", [(1, 1), (30000, 2)])
def test_backward_programs_in_chunks_of_groups_give_the_reference(driver, monkeypatch, chunk_bytes, chunk):
    """The dK / dV grid's chunks of groups (key_chunk, L2_CHUNK_BYTES lowered): one group a chunk (each group's key
    blocks in turn) or two chunks of two; B 2, Hk 2: 4 (key/value head, batch entry) groups."""
    monkeypatch.setattr(fa, "L2_CHUNK_BYTES", chunk_bytes)
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim = 2, 70, 90, 6, 2, 16
    assert fa.key_chunk(batch, seqlen_q, heads_q, heads_k, head_dim, 1, True) == chunk
    rng = np.random.default_rng(chunk_bytes)
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim)
    kwargs = dict(q=q, k=k, v=v, causal=True, window=(-1, -1), softmax_scale=None, softcap=0.0)
    dout = round_to(rng.standard_normal(q.shape), "float32")
    (out,), grads = driver.vjp(fa.NAME, kwargs, ("q", "k", "v"), (dout,))
    assert_close("out", out, fa.reference(**kwargs)[0], "float32")
    for name, ref in fa.reference_vjp(kwargs, (dout,)).items():
        assert_close(f"d{name}", grads[name], ref, "float32")


def test_explicit_scale_and_non_power_of_two_head_dim(driver):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 33, 47, 6, 2, 40, "float16")
    kwargs = dict(q=q, k=k, v=v, causal=True, window=(-1, -1), softmax_scale=0.3, softcap=0.0)
    dout = round_to(rng.standard_normal(q.shape), "float16")
    (out,), grads = driver.vjp(fa.NAME, kwargs, ("q", "k", "v"), (dout,))
    assert_close("out", out, fa.reference(**kwargs)[0], "float16")
    for name, ref in fa.reference_vjp(kwargs, (dout,)).items():
        assert_close(f"d{name}", grads[name], ref, "float16")


# ---------------------------------------------------------------------------------------------------------------- JAX


@needs_jax
def test_jax_jit_vmap_and_grad_of_vmap():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (3, 2, 20, 4, 16), jnp.float32)  # vmapped axis, then (B, S, Hq, D)
    k = jax.random.normal(keys[1], (3, 2, 28, 2, 16), jnp.float32)
    v = jax.random.normal(keys[2], (3, 2, 28, 2, 16), jnp.float32)

    def f(q, k, v):
        return tk.flash_attention(q, k, v, causal=True, window=(9, -1), softcap=3.0)

    np.testing.assert_array_equal(jax.jit(f)(q[0], k[0], v[0]), f(q[0], k[0], v[0]))
    text = str(jax.make_jaxpr(jax.vmap(f))(q, k, v))
    assert text.count("triton_kernel_call[") + text.count("pure_callback[") == 1
    batched = jax.vmap(f)(q, k, v)
    for i in range(3):
        np.testing.assert_allclose(batched[i], f(q[i], k[i], v[i]), rtol=1e-6, atol=1e-6)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v) * jnp.arange(16.0))

    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(3):
        for got, want in zip(per_example, jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])):
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------------------- torch


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    utils = OPCHECK_UTILS
    q = torch.randn(2, 17, 4, 32, device=dev, requires_grad=True)
    k = torch.randn(2, 23, 2, 32, device=dev, requires_grad=True)
    v = torch.randn(2, 23, 2, 32, device=dev, requires_grad=True)
    ops = torch.ops.tile_kernels
    options = (True, 8, -1, 32**-0.5, 0.0)
    out, lse = ops.flash_attention_fwd(q.detach(), k.detach(), v.detach(), *options)
    for op, args in [
        (ops.flash_attention_fwd.default, (q, k, v, *options)),
        (ops.flash_attention_fwd.default, (q, k, v, False, -1, -1, 0.2, 2.0)),
        (ops.flash_attention_bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                           *options)),
        (ops.flash_attention.default, (q, k, v, True, [4, 0], None, 0.0)),
    ]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
@pytest.mark.skipif(DEVICE != "gpu", reason="torch.compile cannot compile Triton kernels in the interpreter")
def test_torch_compile_fullgraph_matches_eager():
    import torch

    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_torch_compile_matches_eager(q, k, v, causal=True, window=(100, -1))


def assert_torch_compile_matches_eager(q, k, v, **options) -> None:
    """torch.compile(fullgraph=True) of a loss through flash_attention(q, k, v, **options) gives eager's loss and
    gradients."""
    import torch

    import tile_kernels.torch as tk

    def attend(q, k, v):
        return tk.flash_attention(q, k, v, **options).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    got, grads = compiled(q, k, v), torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want, want_grads = attend(q, k, v), torch.autograd.grad(attend(q, k, v), (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------------- peers


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("options", [dict(causal=True, cross=True), dict(window=True, gqa=3),
                                     dict(softcap=True, causal=True, gqa=2), dict(cross=True)])  # fmt: skip
def test_bench_peers_on_every_option(framework, options):
    """The benchmark's torch eager and jax.jit peers compute the same op for masks, GQA and softcap too."""
    from test_bench import _peer

    peer = _peer(framework, fa.NAME)
    for seed in range(3):
        kwargs = fa.sample(np.random.default_rng(seed), (2, 3, 32), "float32", **options)
        np.testing.assert_allclose(peer(kwargs)[0], fa.reference(**kwargs)[0], rtol=2e-5, atol=2e-6)
