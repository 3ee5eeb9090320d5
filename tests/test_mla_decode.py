"""mla_decode beyond the registry-driven suite: DeepSeek-V3's dims (latent 512, rope 64), paged and contiguous caches
agree on the same data (pages out of order), split counts 1 and many agree with the log-sum-exp (the plans run
directly, poisoned), and the adapters' guarantees (JAX jit / vmap as one launch, torch opcheck and torch.compile)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import Target, host, mla_decode_tilelang
from tile_kernels.core import mla_decode as mla
from tile_kernels.core.registry import round_to

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
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


# ---------------------------------------------------------------------------------------------------------------------
# backend="tilelang": the Hopper split kernel (mla_decode_tilelang.py)

needs_gpu = pytest.mark.skipif(DEVICE != "gpu", reason="the TileLang kernel runs on an NVIDIA Hopper GPU only (sm_90a)")


def _poison_past_lengths(kwargs: dict) -> dict:
    """The cache slots past each sequence's length (and the spare pages) set to NaN: a kernel must never let them
    reach the output (0 x NaN is NaN)."""
    out = dict(kwargs)
    lengths, table = kwargs["cache_seqlens"], kwargs["block_table"]
    for name in ("kv_c", "k_pe"):
        cache = kwargs[name].copy()
        if table is None:
            for b, length in enumerate(lengths):
                cache[b, length:] = np.nan
        else:
            page = cache.shape[1]
            used = np.zeros(cache.shape[:2], bool)
            for b, length in enumerate(lengths):
                for p in range(length):
                    used[table[b, p // page], p % page] = True
            cache[~used] = np.nan
        out[name] = cache
    return out


def test_default_backend_is_tilelang_where_its_kernel_runs():
    from tile_kernels.core import backends

    assert mla.preferred_backend(90, "bfloat16", 512, 64) == mla.preferred_backend(90, "float16", 512, 64, 128)
    assert mla.preferred_backend(90, "bfloat16", 512, 64, 64) == "tilelang"
    others = [(90, "float32", 512, 64, None), (90, "bfloat16", 256, 64, None), (90, "bfloat16", 512, 64, 16),
              (80, "bfloat16", 512, 64, None), (0, "bfloat16", 512, 64, None)]  # fmt: skip
    for args in others:
        assert mla.preferred_backend(*args) == "triton", args
    assert backends.resolve(mla.NAME, None, "cpu", preferred="tilelang") == "triton"  # no interpreter: falls back


def test_tilelang_backend_refuses_what_it_cannot_run():
    """Clear errors (ValueError naming the backend and the feature) for float32, other dims, pages that are not a
    multiple of 64 and GPUs other than Hopper; its plans: one Call when S = 1, the Triton combine after it when
    S > 1, the Triton plan for an empty cache."""
    from tile_kernels.core.backends import Call
    from tile_kernels.core.plan import Launch

    for args, match in [
        (("float32", 512, 64), "supports q_nope, kv_c in float16 / bfloat16 only"),
        (("bfloat16", 256, 64), "supports Dc = 512, Dr = 64 only"),
        (("bfloat16", 512, 64, 16), "needs a page size that is a multiple of 64, got 16"),
        (("bfloat16", 512, 64, None, 80), "runs on sm_90 \\(Hopper: wgmma, TMA\\) only, got sm_80"),
    ]:
        with pytest.raises(ValueError, match=f"mla_decode: backend 'tilelang' {match}.*; backend='triton' runs it"):
            mla.check_backend("tilelang", *args)
    mla.check_backend("tilelang", "float16", 512, 64, 128, 90)
    target = Target(num_sms=132)
    one = mla.compiled_forward("tilelang", 128, 128, 512, 64, 4096, dtype="bfloat16", scale=None, arch=90,
                               target=target, page_size=64)  # fmt: skip
    assert [type(s) for s in one.launches] == [Call] and one.launches[0].writes == ("out", "lse")
    assert one.launches[0].key == "tile_kernels_tilelang_mla_decode_paged_bfloat16_sm90"
    assert one.launches[0].reads == ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table")
    many = mla.compiled_forward("tilelang", 1, 128, 512, 64, 32768, dtype="float16", scale=0.1, arch=90,
                                target=target)  # fmt: skip
    assert [type(s) for s in many.launches] == [Call, Launch]
    assert many.launches[0].key == "tile_kernels_tilelang_mla_decode_partial_float16_sm90"
    assert many.launches[0].attrs == {"scale": 0.1} and many.buffers["partial_o"].shape[2] == 64
    empty = mla.compiled_forward("tilelang", 2, 16, 512, 64, 0, dtype="bfloat16", scale=None, arch=90, target=target)
    assert all(isinstance(s, Launch) for s in empty.launches)  # Triton's kernels write 0 and -inf
    # the split heuristic: one wave of programs a multiprocessor, splits only where they shorten the waves
    assert mla.tilelang_split_count(64, 128, 4096, 132, 64) == 1
    assert mla.tilelang_split_count(32, 128, 8192, 132, 64) == 2
    assert mla.tilelang_split_count(1, 128, 32768, 132, 64) == 64  # 2 x 64 programs of 8 blocks
    assert mla.tilelang_split_count(128, 128, 4096, 132, 64) == 1
    assert mla.tilelang_split_count(3, 16, 64, 132, 64) == 1  # at least MIN_SPLIT_BLOCKS blocks a split


@needs_torch
@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's error")
def test_tilelang_backend_on_the_cpu_is_a_clear_error():
    import torch

    import tile_kernels.torch as tk

    q = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    args = (q, q[..., :64], q.new_zeros(1, 64, 512), q.new_zeros(1, 64, 64), torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="mla_decode: backend 'tilelang' cannot run on the CPU"):
        tk.mla_decode(*args, backend="tilelang")


# (lengths, heads, paged) at DeepSeek-V3's dims: B 1 and odd, lengths 0, 1, 63, 65 and long ones, 16 / 64 / 128 heads
TILELANG_CASES = [
    ([2000], 128, False),
    ([2000], 128, True),
    ([0, 1, 63, 65, 1500], 16, True),
    ([0, 1, 63, 65, 1500], 128, False),
    ([65, 0, 4097], 64, True),
    ([130, 7, 0], 128, True),
    ([0, 0, 0], 128, False),
    ([64 * 40, 33, 64 * 3 + 1, 1000, 5, 640, 64], 128, True),
]


@needs_gpu
@pytest.mark.parametrize("framework", sorted(DRIVERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("lengths, heads, paged", TILELANG_CASES)
def test_tilelang_matches_the_reference(framework, dtype, lengths, heads, paged):
    """The public function with backend="tilelang" against the float64 reference, the cache slots it must not read
    poisoned with NaN (pages shuffled, two spare); a contiguous cache's capacity need not be a multiple of 64."""
    if framework == "jax":
        import importlib.util

        if importlib.util.find_spec("jax_tvm_ffi") is None:
            pytest.skip("jax-tvm-ffi not installed")
    rng = np.random.default_rng(len(lengths) * 1000 + heads + paged)
    capacity = max(max(lengths), 1) + (0 if paged else 3)
    if paged:
        capacity = -(-capacity // 64) * 64
    kwargs = _contiguous(rng, lengths, capacity, heads, 512, 64, dtype)
    kwargs = _poison_past_lengths(_paged(rng, kwargs, 64) if paged else kwargs)
    want = mla.reference(**{**kwargs, "kv_c": np.nan_to_num(kwargs["kv_c"]), "k_pe": np.nan_to_num(kwargs["k_pe"])})
    driver = DRIVERS[framework](DEVICE)
    for return_lse in (True, False):
        got = driver.call("mla_decode", {**kwargs, "return_lse": return_lse, "backend": "tilelang"})
        assert len(got) == (2 if return_lse else 1)
        assert_close("out", got[0], want[0], dtype)
        if return_lse:
            assert_close("lse", got[1], want[1], "float32")
    empty = [b for b, length in enumerate(lengths) if length == 0]
    assert np.all(got[0][empty] == 0)


def _tilelang_plans_agree(lengths, heads, paged, splits, tile_config=None):
    """The TileLang plan run directly (poisoned buffers, TILE_KERNELS_POISON=1) with forced split counts against
    the float64 reference, the cache slots past each length NaN."""
    import torch

    from tile_kernels.torch._runtime import Executor, target

    rng = np.random.default_rng(len(lengths) * 100 + heads + paged)
    capacity = -(-max(max(lengths), 1) // 64) * 64
    kwargs = _contiguous(rng, lengths, capacity, heads, 512, 64, "bfloat16")
    kwargs = _poison_past_lengths(_paged(rng, kwargs, 64) if paged else kwargs)
    want = mla.reference(**{**kwargs, "kv_c": np.nan_to_num(kwargs["kv_c"]), "k_pe": np.nan_to_num(kwargs["k_pe"])})
    names = ["q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens"] + (["block_table"] if paged else [])
    driver = DRIVERS["torch"](DEVICE)
    tensors = [driver.array(kwargs[n]) for n in names]
    device = tensors[0].device
    major, minor = torch.cuda.get_device_capability(device)
    for s in splits:
        plan = mla.compiled_forward("tilelang", len(lengths), heads, 512, 64, capacity, dtype="bfloat16", scale=None,
                                    arch=10 * major + minor, target=target(device), page_size=64 if paged else None,
                                    num_splits=s, tile_config=tile_config)  # fmt: skip
        out, lse = (driver.numpy(t) for t in Executor(plan)(*tensors, device=device))
        assert_close(f"out, {tile_config}, {s} splits", out, want[0], "bfloat16")
        assert_close(f"lse, {tile_config}, {s} splits", lse, want[1], "float32")


@needs_gpu
@needs_torch
@pytest.mark.parametrize("paged", [False, True])
def test_tilelang_split_counts_agree(paged):
    """Split counts 1 (the whole kernel), 2, 5 and 33 (the partial kernel and the Triton combine) at one length of
    each kind."""
    _tilelang_plans_agree([0, 1, 65, 3000], 128, paged, (1, 2, 5, 33))


@needs_gpu
@needs_torch
@pytest.mark.parametrize("tile_config", sorted(mla_decode_tilelang.CONFIGS))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths, heads", [([0, 1, 63, 64, 65, 128, 3000], 128), ([1, 129, 700], 16)])
def test_every_tilelang_configuration_matches_the_reference(tile_config, paged, lengths, heads):
    """Each of mla_decode_tilelang.CONFIGS, whole and split: lengths around its blocks (and pairs of blocks), fewer
    heads than a tile."""
    _tilelang_plans_agree(lengths, heads, paged, (1, 3), tile_config)


@needs_gpu
@needs_torch
def test_tilelang_torch_opcheck_and_compile():
    import torch

    import tile_kernels.torch as tk

    rng = np.random.default_rng(12)
    kwargs = _paged(rng, _contiguous(rng, [100, 0, 64], 128, 16, 512, 64, "bfloat16"), 64)
    names = ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table")
    driver = DRIVERS["torch"](DEVICE)
    q_nope, q_pe, kv, kp, lengths, table = (driver.array(kwargs[n]) for n in names)
    ops = torch.ops.tile_kernels
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in [
        (ops.mla_decode_fwd_compiled.default, (q_nope, q_pe, kv, kp, lengths, table, 0.2, "tilelang")),
        (ops.mla_decode.default, (q_nope, q_pe, kv, kp, lengths, table, None, True, "tilelang")),
    ]:
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(r == "SUCCESS" for r in result.values()), (op, result)

    def step(q_nope, q_pe, kv, kp, lengths, table):
        out, lse = tk.mla_decode(q_nope, q_pe, kv, kp, lengths, table, return_lse=True, backend="tilelang")
        return out.float().square().sum(-1) + lse.clamp_min(-1e4)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(
        compiled(q_nope, q_pe, kv, kp, lengths, table), step(q_nope, q_pe, kv, kp, lengths, table)
    )
