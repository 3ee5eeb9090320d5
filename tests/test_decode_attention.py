"""decode_attention beyond the registry-driven suite: paged and contiguous caches agree on the same data, out-of-order
block tables, sequences of length 0 (exactly 0), split counts 1 and many agree (the plans run directly, poisoned),
GQA ratios past one tile, page sizes up to 256, the split heuristic, the adapters' guarantees (JAX jit / vmap as one
launch, torch opcheck and torch.compile) and the benchmark peers."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import Target, aot, host
from tile_kernels.core import decode_attention as da
from tile_kernels.core.registry import round_to

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
needs_interpreter = pytest.mark.skipif(DEVICE != "cpu", reason="runs the plans on NumPy arrays in the interpreter")


def _contiguous(rng, lengths, capacity, heads_q, heads_k, head_dim, dtype="float32") -> dict:
    def draw(*shape):
        return round_to(rng.standard_normal(shape), dtype)

    batch = len(lengths)
    return dict(q=draw(batch, heads_q, head_dim), k_cache=draw(batch, capacity, heads_k, head_dim),
                v_cache=draw(batch, capacity, heads_k, head_dim), cache_seqlens=np.array(lengths, np.int32),
                block_table=None, softmax_scale=None)  # fmt: skip


def _paged(rng, kwargs: dict, page_size: int, order: str = "shuffled") -> dict:
    """The same caches in a pool of pages (two spare ones), the block table in the given order."""
    batch, capacity = kwargs["k_cache"].shape[:2]
    pages = capacity // page_size
    slots = np.arange(batch * pages) + 2
    slots = rng.permutation(slots) if order == "shuffled" else slots[::-1]
    table = slots.reshape(batch, pages).astype(np.int32)
    pools = []
    for cache in (kwargs["k_cache"], kwargs["v_cache"]):
        pool = round_to(rng.standard_normal((batch * pages + 2, page_size) + cache.shape[2:]), str(cache.dtype))
        pool[table] = cache.reshape(batch, pages, page_size, *cache.shape[2:])
        pools.append(pool)
    return {**kwargs, "k_cache": pools[0], "v_cache": pools[1], "block_table": table}


def _run_plan(kwargs: dict, num_splits: int | None) -> np.ndarray:
    """The op's plan run directly (poisoned buffers, TILE_KERNELS_POISON=1), with a forced split count."""
    q, k, table = kwargs["q"], kwargs["k_cache"], kwargs["block_table"]
    batch, heads_q, head_dim = q.shape
    capacity = k.shape[1] * (table.shape[1] if table is not None else 1)
    page_size = k.shape[1] if table is not None else None
    plan = da.forward(batch, heads_q, k.shape[2], head_dim, capacity, dtype=str(q.dtype),
                      scale=kwargs["softmax_scale"], target=Target(), page_size=page_size,
                      num_splits=num_splits)  # fmt: skip
    arrays = [q, k, kwargs["v_cache"], kwargs["cache_seqlens"]] + ([table] if table is not None else [])
    return host.run_plan(plan, *arrays)[0].reshape(q.shape).astype(np.float64)


@pytest.mark.parametrize("page_size, order", [(16, "shuffled"), (32, "reversed"), (7, "shuffled"), (64, "shuffled")])
def test_paged_and_contiguous_caches_agree(driver, page_size, order):
    """The same data contiguous and paged (block table shuffled or reversed, pages of 7: a lookup a position; 16 and
    32: a block of 64 positions spans 4 / 2 pages, a lookup each; 64: a block a page, looked up once) gives the same
    output, and the reference's; lengths of 0, 1, a page +- 1 and the whole capacity."""
    assert da.pages_a_block(page_size, 64) == {7: 0, 16: 4, 32: 2, 64: 1}[page_size]
    rng = np.random.default_rng(page_size)
    capacity = 4 * page_size
    lengths = [0, 1, page_size - 1, page_size + 1, capacity]
    contiguous = _contiguous(rng, lengths, capacity, 4, 2, 32, "float16")
    paged = _paged(rng, contiguous, page_size, order)
    (got_contiguous,), (got_paged,) = driver.call(da.NAME, contiguous), driver.call(da.NAME, paged)
    ref = da.reference(**contiguous)[0]
    np.testing.assert_allclose(da.reference(**paged)[0], ref, rtol=1e-12, atol=1e-12)
    assert_close("contiguous", got_contiguous, ref, "float16")
    assert_close("paged", got_paged, ref, "float16")
    np.testing.assert_array_equal(got_paged, got_contiguous)  # the same arithmetic on the same rows
    assert np.all(got_paged[0] == 0)


def test_new_tokens_see_the_cache_causally(driver):
    """T new tokens a sequence (speculative decoding), q (B, T, Hq, D): token t is a one-token call over the first
    L - (T - 1 - t) positions; a token that sees no position gives exactly 0."""
    rng = np.random.default_rng(5)
    tokens, lengths = 3, [0, 1, 2, 5, 40]
    kwargs = _contiguous(rng, lengths, 40, 6, 2, 32)
    kwargs["q"] = round_to(rng.standard_normal((len(lengths), tokens, 6, 32)), "float32")
    (got,) = driver.call(da.NAME, kwargs)
    assert got.shape == kwargs["q"].shape
    assert_close("tokens", got, da.reference(**kwargs)[0], "float32")
    for t in range(tokens):
        seen = np.maximum(np.array(lengths) - (tokens - 1 - t), 0).astype(np.int32)
        (one,) = driver.call(da.NAME, {**kwargs, "q": kwargs["q"][:, t], "cache_seqlens": seen})
        np.testing.assert_allclose(got[:, t], one, rtol=1e-5, atol=1e-6)
    assert np.all(got[0] == 0) and np.all(got[1, :2] == 0) and np.all(got[1, 2] != 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_empty_sequences_give_exactly_zero(driver, dtype):
    """Length 0 gives 0 (no NaN) beside sequences that are not empty, also with poisoned buffers; so does a cache of
    capacity 0 (no launch)."""
    rng = np.random.default_rng(1)
    kwargs = _contiguous(rng, [0, 150, 0, 3], 150, 6, 2, 16, dtype)
    (out,) = driver.call(da.NAME, kwargs)
    assert not np.isnan(out).any() and np.all(out[[0, 2]] == 0) and np.all(out[[1, 3]] != 0)
    assert_close("out", out, da.reference(**kwargs)[0], dtype)
    (out,) = driver.call(da.NAME, _contiguous(rng, [0, 0], 0, 2, 1, 16, dtype))
    assert out.shape == (2, 2, 16) and np.all(out == 0)


@needs_interpreter
@pytest.mark.parametrize("paged", [False, True])
def test_split_counts_agree(paged):
    """1, 2, 5 and 16 splits (many of them empty for the short sequences; all of them for length 0) give the
    reference's output; a forced split count beyond what the heuristic would pick here."""
    rng = np.random.default_rng(2)
    kwargs = _contiguous(rng, [200, 0, 37, 64, 1], 200, 3, 1, 40, "float16")
    kwargs = _paged(rng, kwargs, 8) if paged else kwargs
    ref = da.reference(**kwargs)[0]
    outs = {splits: _run_plan(kwargs, splits) for splits in (1, 2, 5, 16)}
    for splits, out in outs.items():
        assert_close(f"{splits} splits", out, ref, "float16")
        assert np.all(out[1] == 0)
    np.testing.assert_allclose(outs[16], outs[1], rtol=0, atol=4 * 2.0**-10)


@needs_interpreter
def test_lengths_past_the_capacity_are_clamped():
    """Lengths are values the host never reads: the kernel clamps them to [0, capacity] rather than read past the
    cache (a negative one gives 0)."""
    rng = np.random.default_rng(3)
    kwargs = _contiguous(rng, [70, 0], 70, 2, 2, 16)
    out = _run_plan({**kwargs, "cache_seqlens": np.array([1000, -5], np.int32)}, None)
    assert_close("clamped", out, da.reference(**kwargs)[0], "float32")


@pytest.mark.parametrize("heads_q, heads_k", [(3, 3), (8, 2), (6, 2), (40, 1), (80, 1)])
def test_gqa_ratios(driver, heads_q, heads_k):
    """Groups of 1 to 80 query heads a key/value head: a tile of 16, 32 or 64 rows, and several tiles past 64 (32 in
    float32)."""
    rng = np.random.default_rng(heads_q)
    for dtype in ("float32", "bfloat16"):
        kwargs = _contiguous(rng, [33, 70], 70, heads_q, heads_k, 16, dtype)
        assert_close(f"{heads_q}/{heads_k} {dtype}", driver.call(da.NAME, kwargs)[0], da.reference(**kwargs)[0], dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_cache_reads_every_e4m3_code_as_its_value(driver, dtype):
    """One cached position: the output is that position's V, so each finite e4m3 code (both signs, the denormals,
    +-448; not the NaN codes 0x7f / 0xff) comes back exactly as its value in q's dtype, as the GPU's integer widening
    of the codes must give."""
    import ml_dtypes

    rng = np.random.default_rng(12)
    codes = rng.permutation(np.setdiff1d(np.arange(256), [0x7F, 0xFF])).astype(np.uint8)  # 254 codes
    v = np.concatenate([codes, codes[:2]]).view(ml_dtypes.float8_e4m3fn).reshape(2, 1, 1, 128)
    kwargs = _contiguous(rng, [1, 1], 1, 3, 1, 128, dtype)
    kwargs["k_cache"], kwargs["v_cache"] = round_to(kwargs["k_cache"], "float8_e4m3fn"), v
    (got,) = driver.call(da.NAME, kwargs)
    np.testing.assert_array_equal(got.astype(np.float64), np.broadcast_to(v.astype(np.float64)[:, 0], got.shape))


def test_pages_of_256_and_an_explicit_scale(driver):
    """Pages of 256 positions (lengths around the page boundary), head dim 40 (padded to 64, 8-element units), an
    explicit softmax_scale."""
    rng = np.random.default_rng(4)
    kwargs = _contiguous(rng, [255, 257], 512, 2, 1, 40, "float16")
    kwargs = {**_paged(rng, kwargs, 256), "softmax_scale": 0.3}
    assert_close("out", driver.call(da.NAME, kwargs)[0], da.reference(**kwargs)[0], "float16")


@pytest.mark.parametrize("dtype, page_size", [("bfloat16", None), ("float16", 16), ("bfloat16", 7)])
def test_fp8_caches_with_per_tensor_scales(driver, dtype, page_size):
    """float8_e4m3fn caches holding K / k_scale and V / v_scale under 16-bit queries, contiguous and paged, GQA 8/2,
    two new tokens a sequence: the reference over the dequantized caches; k_scale alone and v_scale alone scale the
    scores and the output as the math says (v_scale 2 doubles the output exactly: a power of two)."""
    rng = np.random.default_rng(11)
    lengths, capacity = [0, 1, 17, 70], 70
    kwargs = _contiguous(rng, lengths, capacity, 8, 2, 64, dtype)
    kwargs["k_cache"], kwargs["v_cache"] = (round_to(4 * rng.standard_normal(c.shape), "float8_e4m3fn")
                                            for c in (kwargs["k_cache"], kwargs["v_cache"]))  # fmt: skip
    kwargs["q"] = round_to(rng.standard_normal((len(lengths), 2, 8, 64)), dtype)
    if page_size:  # the capacity cut to whole pages (70 for pages of 7, 64 for 16)
        cut = capacity // page_size * page_size
        kwargs = _paged(rng, {**kwargs, "k_cache": kwargs["k_cache"][:, :cut], "v_cache": kwargs["v_cache"][:, :cut]},
                        page_size)  # fmt: skip
        kwargs["cache_seqlens"] = np.minimum(kwargs["cache_seqlens"], cut)
    assert kwargs["k_cache"].dtype.name == "float8_e4m3fn"
    scaled = {**kwargs, "k_scale": 0.04, "v_scale": 0.3}
    (got,) = driver.call(da.NAME, scaled)
    ref = da.reference(**scaled)[0]
    assert_close("fp8 caches", got, ref, dtype)
    assert np.all(got[0] == 0) and np.abs(ref).max() > 0.05
    (unscaled,) = driver.call(da.NAME, {**kwargs, "k_scale": 0.04})
    (doubled,) = driver.call(da.NAME, {**kwargs, "k_scale": 0.04, "v_scale": 2.0})
    np.testing.assert_array_equal(doubled, 2 * unscaled)
    assert_close("k_scale only", unscaled, da.reference(**{**kwargs, "k_scale": 0.04})[0], dtype)


def test_split_heuristic_fills_whole_waves():
    """The split count's programs fill the SMs' slots (PROGRAMS_PER_SM, 3 for paged 16-bit caches) in whole waves:
    no second wave less than half full (8 x 16K contiguous takes 8 splits, 512 programs of 528 slots, not 9)."""
    h200 = Target(warp_size=32, num_sms=132, cuda_arch=90)
    assert da.split_count(8, 8, 4, 16384, 128, "bfloat16", h200) == 8
    for paged, per_sm in ((False, da.PROGRAMS_PER_SM), (True, da.PAGED_PROGRAMS_PER_SM)):
        for batch, seqlen in ((1, 32768), (1, 131072), (8, 16384), (32, 8192), (4, 3000)):
            splits = da.split_count(batch, 8, 4, seqlen, 128, "bfloat16", h200, paged)
            blocks = -(-seqlen // 64)
            programs = batch * 8 * -(-blocks // -(-blocks // splits))  # the non-empty splits' programs
            last_wave = programs % (per_sm * h200.num_sms)
            assert programs <= per_sm * h200.num_sms or last_wave == 0 or 2 * last_wave >= per_sm * h200.num_sms


def test_split_heuristic_fills_the_gpu_for_one_long_sequence_only():
    """B = 1 with a long context splits its sequence across the SMs; a large batch fills the GPU alone and takes one
    split; short caches are never cut finer than MIN_SPLIT_BLOCKS blocks a split."""
    h200 = Target(warp_size=32, num_sms=aot.TARGETS["cuda:90"].num_sms)
    long_one = da.split_count(1, 8, 4, 32768, 128, "bfloat16", h200)
    assert long_one >= 32 and 8 * long_one >= 2 * h200.num_sms
    assert da.split_count(128, 8, 4, 32768, 128, "bfloat16", h200) == 1
    assert da.split_count(1, 8, 4, 128, 128, "bfloat16", h200) == 1
    assert da.split_count(1, 1, 128, 1 << 20, 128, "bfloat16", h200) == da.MAX_SPLITS
    mi300 = Target(warp_size=64, num_sms=aot.TARGETS["hip:gfx942"].num_sms)
    assert da.split_count(1, 8, 4, 32768, 128, "bfloat16", mi300) > long_one
    plan = da.forward(1, 32, 8, 128, 32768, dtype="bfloat16", scale=None, target=h200)
    assert [launch.grid for launch in plan.launches] == [(1, 8, long_one), (1, 32)]
    assert [launch.grid for launch in da.forward(128, 32, 8, 128, 32768, dtype="bfloat16", scale=None,
                                                 target=h200).launches] == [(128, 8, 1)]  # fmt: skip


def test_the_combine_follows_the_split_launch_programmatically_on_sm90_only():
    """On sm_90+ a split plan's combine is a PDL launch (Launch.pdl) and both kernels get PDL (the split lets it start,
    the combine waits); on sm_80, AMD and the interpreter, and with one split, plain launches."""
    for arch, warp, want in ((90, 32, True), (100, 32, True), (80, 32, False), (0, 64, False), (0, 32, False)):
        plan = da.forward(1, 32, 8, 128, 32768, dtype="bfloat16", scale=None, target=Target(warp, 132, arch))
        split, combine = plan.launches
        assert (split.pdl, split.constexprs["PDL"], combine.pdl, combine.constexprs["PDL"]) == (False, want, want, want)
    (single,) = da.forward(128, 32, 8, 128, 2048, dtype="bfloat16", scale=None, target=Target(32, 132, 90)).launches
    assert not single.pdl and not single.constexprs["PDL"]


# ---------------------------------------------------------------------------------------------------------------- JAX


@needs_jax
@pytest.mark.parametrize("paged", [False, True])
def test_jax_jit_and_vmap_as_one_launch(paged):
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    rng = np.random.default_rng(5)
    examples = []
    for i in range(3):
        kwargs = _contiguous(rng, [i * 20, 64 - i, 1], 64, 4, 2, 16)
        examples.append(_paged(rng, kwargs, 16) if paged else kwargs)
    names = ["q", "k_cache", "v_cache", "cache_seqlens"] + (["block_table"] if paged else [])
    stacked = {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in names}

    def f(arrays):
        return tk.decode_attention(**arrays)

    first = {k: v[0] for k, v in stacked.items()}
    np.testing.assert_array_equal(jax.jit(f)(first), f(first))
    text = str(jax.make_jaxpr(jax.vmap(f))(stacked))
    assert text.count("triton_kernel_call[") + text.count("pure_callback[") == 1
    batched = jax.vmap(f)(stacked)
    for i, e in enumerate(examples):
        assert_close(f"vmap {i}", np.asarray(batched[i], np.float64), da.reference(**e)[0], "float32")


# -------------------------------------------------------------------------------------------------------------- torch


@needs_torch
def test_torch_opcheck_and_compile():
    import torch

    import tile_kernels.torch as tk

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    rng = np.random.default_rng(6)
    # capacity 96: two splits (the combine launch; on sm_90 a dependent launch) on a GPU and in the interpreter
    kwargs = _paged(rng, _contiguous(rng, [70, 0, 17], 96, 4, 2, 32), 16)
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")
    q, k, v, lengths, table = (torch.from_numpy(kwargs[n]).to(dev) for n in names)
    ops = torch.ops.tile_kernels
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    fp8_utils = utils[1:]  # test_schema compares the inputs after the call with allclose, which torch lacks for float8
    for op, args, checks in [
        (ops.decode_attention_fwd.default, (q, k, v, lengths, table, 0.2, 1.0), utils),
        (ops.decode_attention_fwd.default, (q, k[:3], v[:3], lengths, None, 0.2, 1.0), utils),
        (ops.decode_attention.default, (q, k, v, lengths, table, None), utils),
        (ops.decode_attention.default, (q, k8, v8, lengths, table, None, 0.5, 2.0), fp8_utils),
    ]:
        result = torch.library.opcheck(op, args, test_utils=checks)
        assert all(r == "SUCCESS" for r in result.values()), (op, result)

    def step(q, k, v, lengths, table):
        return tk.decode_attention(q, k, v, lengths, table).square().sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if DEVICE == "gpu" else "aot_eager")
    torch.testing.assert_close(compiled(q, k, v, lengths, table), step(q, k, v, lengths, table))


# ---------------------------------------------------------------------------------------------------------- peers


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("options", [dict(paged=True, gqa=3), dict(paged=True, gqa=1, page_size=7), dict(gqa=4),
                                     dict(paged=True, gqa=4, fp8=True)])  # fmt: skip
def test_bench_peers_on_every_option(framework, options):
    """The benchmark's torch eager and jax.jit peers compute the same op, paged and with GQA too."""
    from test_bench import _peer

    peer = _peer(framework, da.NAME)
    for seed in range(3):
        kwargs = da.sample(np.random.default_rng(seed), (3, 5, 32), "float32", **options)
        np.testing.assert_allclose(peer(kwargs)[0], da.reference(**kwargs)[0], rtol=2e-5, atol=2e-6)
