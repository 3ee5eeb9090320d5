"""The benchmark harness: its cases cover the registry, its peers compute the same op as tile-kernels (a faster peer
that computes something else would make the comparison meaningless), and its outputs round-trip. On a GPU, a small
sweep runs end to end."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest

from tile_kernels import cli
from tile_kernels.core import REGISTRY, bench
from tile_kernels.core.registry import Cost

OPS = sorted(REGISTRY)
GPU = os.environ.get("TILE_KERNELS_TEST_DEVICE") == "gpu"


def test_cases_cover_every_registered_op():
    cases = list(bench.cases(OPS, widths=(256, 1000), dtypes=("bfloat16",), elements=1 << 12))
    assert {c.op for c in cases} == set(OPS)
    for case in cases:
        arrays = [v for v in case.kwargs.values() if isinstance(v, np.ndarray)]
        floats = [v for v in arrays if "float" in v.dtype.name]  # none for moe_route (expert ids)
        assert arrays and all(np.count_nonzero(v.astype(np.float32)) > v.size // 2 for v in floats), case.op
        differentiable = bool(REGISTRY[case.op].grad_args)  # an op without a gradient has no backward cost
        assert case.cost[0].bytes > 0 and (case.cost[1].bytes > 0) == differentiable, case.op


def _peer(framework: str, op: str):
    if framework == "torch":
        pytest.importorskip("torch")
        from tile_kernels.torch.bench import EAGER, _tensor

        return lambda kw: [
            o.double().numpy() for o in _tuple(EAGER[op](**{k: _tensor(v, "cpu") for k, v in kw.items()}))
        ]
    jax = pytest.importorskip("jax")
    from tile_kernels.jax.bench import REFERENCE

    def call(kw):  # float32 products in float32 (a GPU's default is TF32), as the CPU computes them
        with jax.default_matmul_precision("highest"):
            return [np.asarray(o, np.float64) for o in _tuple(REFERENCE[op](**kw))]

    return call


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("op", OPS)
def test_peers_compute_the_same_op(framework, op):
    """float32 inputs (the peers compute in float32) against the float64 reference."""
    info = REGISTRY[op]
    peer = _peer(framework, op)
    rng = np.random.default_rng(0)
    kwargs = info.sample(rng, (2, 3, 40), "float32", **bench.OPTIONS.get(op, {}))
    outs, refs = peer(kwargs), info.reference(**kwargs)
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-6, err_msg=f"{framework} peer of {op}")


@pytest.mark.parametrize("page_size", [None, 8])
def test_torch_sdpa_decode_peer_computes_decode_attention(page_size):
    """The bench's SDPA row of decode_attention (padded cache, length mask, GQA; a paged cache gathered first)."""
    pytest.importorskip("torch")
    import torch

    from tile_kernels.torch.bench import _sdpa_decode

    rng = np.random.default_rng(1)
    b, s, hq, hk, d = 3, 40, 8, 2, 16
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in [(b, hq, d)] + [(b, s, hk, d)] * 2)
    kwargs = {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": np.array([40, 7, 23], np.int32)}
    if page_size:
        pages = b * s // page_size
        kwargs |= {name: kwargs[name].reshape(pages, page_size, hk, d) for name in ("k_cache", "v_cache")}
        kwargs["block_table"] = rng.permutation(pages).astype(np.int32).reshape(b, -1)
    ref = REGISTRY["decode_attention"].reference(**kwargs)[0]
    out = _sdpa_decode(**{k: torch.from_numpy(v) for k, v in kwargs.items()})
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=2e-5, atol=1e-6)


def test_outputs_round_trip(tmp_path):
    case = next(bench.cases(["rms_norm"], widths=(512,), dtypes=("bfloat16",), elements=1 << 12))
    case.cost = (Cost(bytes=4_000_000, flops=0), Cost(bytes=8_000_000, flops=0))
    ceilings = bench.Ceilings(copy_gbs=4000.0, gemm_tflops=800.0)
    timings = [bench.Timing("tile-kernels", 0.0011, 0.0025, peak_mib=3.0), bench.Timing("torch.compile", 0.002, 0.004),
               bench.Timing("liger", None, None, note="RuntimeError: no kernel")]  # fmt: skip
    recs = bench.records(case, timings, ceilings)
    ours = {r.direction: r for r in recs if r.impl == "tile-kernels"}
    assert ours["fwd"].gbs == pytest.approx(4_000_000 / 0.0011 / 1e6)
    assert ours["fwd"].of_ceiling == pytest.approx(0.001 / 0.0011)
    assert ours["bwd"].vs_compile == pytest.approx(0.004 / 0.0025)
    assert [r.note for r in recs if r.impl == "liger"] == ["RuntimeError: no kernel"] * 2
    meta = bench.Meta(gpu="test", date="2026-11-29", versions={"x": "1"}, ceilings=ceilings, command="bench")
    bench.write(str(tmp_path), meta, recs)
    meta2, recs2 = bench.load(str(tmp_path / "results.json"))
    assert meta2 == meta and recs2 == recs
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(recs)
    table = (tmp_path / "results.md").read_text()
    assert "| 8x512 | bfloat16 | fwd | tile-kernels | 0.001 | 3636 |" in table and "failed" in table

    # a partial re-run renders over the full one: its rows replace the same rows in place, the others stay
    rerun = [bench.Record("rms_norm", "8x512", "bfloat16", "fwd", "tile-kernels", 0.0009)]
    bench.write(str(tmp_path / "rerun"), bench.Meta("test", "2026-11-30", {}, ceilings, "bench --op rms_norm"), rerun)
    cli.bench(["--render", str(tmp_path / "results.json"), "--render", str(tmp_path / "rerun" / "results.json"),
                "--out", str(tmp_path / "merged")])  # fmt: skip
    meta3, recs3 = bench.load(str(tmp_path / "merged" / "results.json"))
    assert [(r.direction, r.impl) for r in recs3] == [(r.direction, r.impl) for r in recs]
    assert [r.ms for r in recs3 if (r.direction, r.impl) == ("fwd", "tile-kernels")] == [0.0009]
    assert meta3.command == "bench; bench --op rms_norm"


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_small_sweep_runs_on_the_gpu(tmp_path):
    assert cli.bench(["--op", "rms_norm", "--width", "1024", "--elements", str(1 << 16), "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.json") as f:
        recs = json.load(f)["records"]
    ours = {(r["impl"], r["direction"]): r for r in recs if r["impl"].startswith("tile-kernels")}
    for key in [("tile-kernels", "fwd"), ("tile-kernels", "bwd"), ("tile-kernels (jax)", "fwd")]:
        assert ours[key]["ms"] > 0 and ours[key]["gbs"] > 0, key
