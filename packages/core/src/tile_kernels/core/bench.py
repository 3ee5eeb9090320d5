"""Benchmark records for `tile-kernels bench` (run by tile_kernels.cli): the cases, the timings, the tables and the
plots, framework-neutral.

It builds the cases (inputs drawn by each op's own `sample`, random, never zeros; every case holds >= 2^26 elements
per large tensor, so each call streams well past the 50-60 MB L2 and the timer also flushes L2 between calls), turns
times into GB/s and TFLOP/s from the op's cost metadata, and writes JSON, CSV, a markdown table and PNG plots.
Framework providers (`tile_kernels.torch.bench`, `tile_kernels.jax.bench`, above this layer) own the implementations
(tile-kernels itself and its peers: torch eager, torch.compile, Liger, the jax.jit reference, Pallas ops) and their
timers. A peer that lacks an op or fails is recorded with the reason, never dropped silently."""

from __future__ import annotations

import csv
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from . import backends
from .registry import REGISTRY, Cost

WIDTHS = (256, 1024, 4096, 16384, 65536, 262144)
ELEMENTS = 1 << 26  # per large tensor: 128 MiB in bfloat16
# The configuration users run (sample's options otherwise): fused residual, bias, the last dim, plain mean loss.
OPTIONS = {
    "rms_norm": {"residual": True, "eps": 1e-6},
    "layer_norm": {"residual": True, "bias": True, "eps": 1e-5},
    "softmax": {"last_dim": True},
    "cross_entropy": {"reduction": "mean", "label_smoothing": 0.0, "ignore": True},
    "apply_rotary": {"interleaved": False, "fp32_tables": True},
    "fused_linear_cross_entropy": {"reduction": "mean", "dim": 4096},
    "flash_attention": {"causal": False, "window": False, "gqa": 1, "cross": False, "softcap": False},
    "flash_attention_varlen": {"causal": False, "window": False, "gqa": 1, "cross": False, "softcap": False},
    "decode_attention": {"paged": False, "gqa": 4, "page_size": 64},
    "mla_decode": {"paged": True, "page_size": 64},
    "dequant_matmul": {"zeros": False, "group_size": 128},
    "matmul": {"bias": False, "activation": None, "residual": False},
    "fp8_quantize": {"block_rows": 1},
    "rms_norm_fp8_quantize": {"residual": True, "eps": 1e-6},
    # DeepSeek-V3's routing: 8 of 256 experts (bf16 gates)
    "moe_route": {"topk": 8, "experts": 256},
    "moe_permute": {"topk": 8, "experts": 256},
    "moe_unpermute": {"topk": 8, "experts": 256, "fp32_weights": False},
}
# Variants of OPTIONS benchmarked as separate cases, named by a tag after the shape.
VARIANTS = {
    "flash_attention": {"": {}, " causal": {"causal": True}},
    "flash_attention_varlen": {"": {}, " causal": {"causal": True}},
    "decode_attention": {"": {}, " paged": {"paged": True}, " paged fp8": {"paged": True, "fp8": True}},
    "mla_decode": {" paged": {}, " contiguous": {"paged": False}},
}

# decode ops' (batch, context) sweep at the default size: one sequence of 8K-128K tokens to 128 of 2K
DECODE_SIZES = ((1, 8192), (1, 32768), (1, 131072), (8, 16384), (32, 8192), (128, 2048))

# the note of a backward that a forward computes (fused_linear_cross_entropy): no time of its own
FUSED_BACKWARD = "the forward computes the gradients (step = forward + scaling)."


def shapes(op: str, widths, elements: int) -> list[tuple[int, ...]]:
    """The shapes an op is benchmarked at: rows x width with rows x width = elements, except where the op's shape is
    not a row width (rotary: (B, S, H, head_dim) of Llama-like heads; the LM head's loss: (tokens, vocabulary) with
    hidden size 4096, Llama-3's 128K vocabulary; the decode ops: (batch, context, heads, head dim), DECODE_SIZES)."""
    if op == "apply_rotary":
        return [(4, max(1, elements // (4 * 32 * d)), 32, d) for d in (64, 128)]
    if op == "fused_linear_cross_entropy":
        return [(max(1, elements // (1 << 13)), 128256)]  # 8192 tokens at the default size
    if op in ("flash_attention", "flash_attention_varlen"):  # (B, S, H, D): 4 x 8192 tokens of 32 heads of 128
        return [(4, max(64, elements // (1 << 13)), 32, 128)]
    if op == "dequant_matmul":  # (M, K, N): Llama-3-70B's MLP up projection at batch 1, 16 and a 4096-token prefill
        scale = min(1.0, elements / ELEMENTS)  # a smaller --elements shrinks K and N alike
        k, n = (max(256, round(d * scale) // 128 * 128) for d in (8192, 28672))
        return [(m, k, n) for m in dict.fromkeys((1, 16, max(16, round(4096 * scale))))]
    if op == "grouped_matmul":  # (E, T, K, N): Mixtral-8x7B's expert up projections over 8192 tokens, even routing
        scale = min(1.0, elements / ELEMENTS)
        return [(8, *(max(256, round(d * scale) // 128 * 128) for d in (8192, 4096, 14336)))]
    if op in ("matmul", "fp8_matmul"):  # (M, K, N): 8192^3; Llama-3-8B's MLP up and down over 4096 tokens; 16 rows
        scale = min(1.0, elements / ELEMENTS)  # a smaller --elements shrinks every dim alike
        sizes = ((8192, 8192, 8192), (4096, 4096, 14336), (4096, 14336, 4096), (16, 4096, 14336))
        return [tuple(max(256, round(d * scale) // 128 * 128) if d > 16 else d for d in s) for s in sizes]
    if op in ("decode_attention", "mla_decode"):  # (B, capacity, heads, head dim), every sequence full
        scale = min(1.0, elements / ELEMENTS)  # a smaller --elements shrinks the batches and contexts alike
        sizes = dict.fromkeys((max(1, round(b * scale)), max(256, round(s * scale))) for b, s in DECODE_SIZES)
        heads, dim = (8, 128) if op == "decode_attention" else (128, 512)  # Llama-3-8B's KV heads; DeepSeek-V3's MLA
        return [(b, s, heads, dim) for b, s in sizes]
    return [(max(1, elements // w), w) for w in widths]


@dataclass
class Case:
    op: str
    shape: tuple[int, ...]
    dtype: str
    kwargs: dict  # NumPy arrays and attributes, as OpInfo.sample returns them
    cost: tuple[Cost, Cost]  # forward, backward
    tag: str = ""  # the VARIANTS entry, shown after the shape


@dataclass
class Record:
    op: str
    shape: str
    dtype: str
    direction: str  # "fwd" | "bwd" | "step" (forward with gradients recorded + backward)
    impl: str
    ms: float | None
    gbs: float | None = None
    tflops: float | None = None
    of_ceiling: float | None = None  # floor time / time; floor = max(bytes / copy, flops / gemm), both measured
    vs_compile: float | None = None  # torch.compile time / this time (> 1: faster than torch.compile)
    eager_ms: float | None = None  # wall time per call of back-to-back plain calls (host included), fwd and step
    eager_vs_compile: float | None = None  # the same for torch.compile's call / this one
    peak_mib: float | None = None  # peak device memory of one forward + backward above the inputs (torch impls)
    note: str = ""


@dataclass
class Ceilings:
    copy_gbs: float
    gemm_tflops: float

    def floor_ms(self, cost: Cost) -> float:
        return max(cost.bytes / self.copy_gbs / 1e6, cost.flops / self.gemm_tflops / 1e9)


@dataclass
class Timing:
    """What a provider returns for one implementation of one case."""

    impl: str
    fwd_ms: float | None
    bwd_ms: float | None
    step_ms: float | None = None  # forward with gradients recorded + backward: one training step
    peak_mib: float | None = None
    note: str = ""
    eager_fwd_ms: float | None = None  # wall time per call of back-to-back calls, as a user calls the op
    eager_step_ms: float | None = None

    @property
    def eager_bwd_ms(self):  # a backward alone is not called by users: no eager figure
        return None


@dataclass
class Meta:
    gpu: str
    date: str
    versions: dict
    ceilings: Ceilings
    command: str
    extra: dict = field(default_factory=dict)


def other_backends(op: str, fn, platform: str) -> dict:
    """{"tile-kernels[<backend>]": fn with backend=<backend>} beside plain "tile-kernels" (backend=None) for an op of
    several backends: each one other than the platform's default, and the default too where the op prefers another
    for some inputs (flash_attention). An unavailable one fails when called and is reported with the reason."""
    if fn is None or len(backends.backends_of(op)) < 2:
        return {}
    default = "" if op in backends.INPUT_AWARE else backends.default(op, platform)
    return {f"tile-kernels[{b}]": functools.partial(fn, backend=b) for b in backends.backends_of(op) if b != default}


def cases(ops, widths, dtypes, elements: int, seed: int = 0) -> Iterator[Case]:
    rng = np.random.default_rng(seed)
    for op in ops:
        info = REGISTRY[op]
        for shape in shapes(op, widths, elements):
            for dtype in dtypes:
                for tag, extra in VARIANTS.get(op, {"": {}}).items():
                    kwargs = info.sample(rng, shape, dtype, **{**OPTIONS.get(op, {}), **extra})
                    yield Case(op, shape, dtype, kwargs, info.cost(kwargs), tag)


def records(case: Case, timings: list[Timing], ceilings: Ceilings) -> list[Record]:
    fwd, bwd = case.cost
    costs = {"fwd": fwd, "bwd": bwd, "step": Cost(fwd.bytes + bwd.bytes, fwd.flops + bwd.flops)}
    compiled = next((t for t in timings if t.impl == "torch.compile"), None)
    out = []
    for t in timings:
        for direction, cost in costs.items():
            ms = getattr(t, f"{direction}_ms")
            if ms is None and (not t.note or direction == "step"):
                continue
            r = Record(case.op, "x".join(map(str, case.shape)) + case.tag, case.dtype, direction, t.impl, ms,
                       peak_mib=t.peak_mib, note=t.note)  # fmt: skip
            if ms:
                ref = compiled and getattr(compiled, f"{direction}_ms")
                r.gbs, r.tflops = cost.bytes / ms / 1e6, cost.flops / ms / 1e9
                r.of_ceiling = ceilings.floor_ms(cost) / ms
                r.vs_compile = ref / ms if ref else None
            r.eager_ms = getattr(t, f"eager_{direction}_ms")
            eager_ref = compiled and getattr(compiled, f"eager_{direction}_ms")
            r.eager_vs_compile = eager_ref / r.eager_ms if eager_ref and r.eager_ms else None
            out.append(r)
    return out


def progress(done: int, total: int, started: float, line: str) -> None:
    eta = (time.perf_counter() - started) / max(done, 1) * (total - done)
    print(f"[{done}/{total} eta {eta:4.0f}s] {line}", file=sys.stderr, flush=True)


def summary_line(case: Case, timings: list[Timing], ceilings: Ceilings) -> str:
    parts = []
    for t in timings:
        if t.fwd_ms is None:
            parts.append(f"{t.impl}: {t.note[:60]}")
            continue
        pct = 100 * ceilings.floor_ms(case.cost[0]) / t.fwd_ms
        bwd = f"/{100 * ceilings.floor_ms(case.cost[1]) / t.bwd_ms:.0f}" if t.bwd_ms and t.bwd_ms > 0 else ""
        parts.append(f"{t.impl} {pct:.0f}{bwd}%" + (f" step {t.step_ms:.3g} ms" if t.step_ms else ""))
    shape = "x".join(map(str, case.shape)) + case.tag
    return f"{case.op} {case.dtype} {shape} (fwd/bwd of ceiling): " + ", ".join(parts)


# ------------------------------------------------------------------------------------------------------ outputs


def write(out_dir: str, meta: Meta, recs: list[Record]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path + ".tmp", "w") as f:  # then renamed: a run killed mid-write keeps the previous file whole
        json.dump({"meta": asdict(meta), "records": [asdict(r) for r in recs]}, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(recs[0]) if recs else Record.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(r) for r in recs)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(meta, recs))
    plot(out_dir, recs)


def load(path: str) -> tuple[Meta, list[Record]]:
    with open(path) as f:
        data = json.load(f)
    m = data["meta"]
    meta = Meta(**{**m, "ceilings": Ceilings(**m["ceilings"])})
    return meta, [Record(**r) for r in data["records"]]  # files written before a field existed lack it: defaults


def _fmt(value, spec: str, missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def markdown(meta: Meta, recs: list[Record]) -> str:
    c = meta.ceilings
    versions = ", ".join(f"{k} {v}" for k, v in meta.versions.items())
    lines = [
        f"# tile-kernels bench: {meta.gpu}, {meta.date}",
        "",
        f"Ceilings measured in the same run: device copy {c.copy_gbs:.0f} GB/s, dense bf16 GEMM "
        f"{c.gemm_tflops:.0f} TFLOP/s. `of ceiling` = max(bytes / copy, flops / GEMM) / time, from the op's cost "
        "metadata (algorithmic bytes: each input read once, each output written once). `vs compile` = torch.compile "
        "time / this time. fwd = forward without autograd, bwd = backward of a recorded forward, step = forward with "
        "autograd recording + backward. torch rows: `ms` is device time of CUDA-graph replays (no host overhead), "
        "`eager ms` the wall time per call of back-to-back plain calls (host included: what an eager PyTorch user "
        "gets) and `eager vs compile` torch.compile's eager ms / this one; JAX rows: wall time per call of "
        "back-to-back jitted calls. Peak = device memory of one forward + backward above the inputs (torch).",
        "",
        f"Versions: {versions}. Command: `{meta.command}`.",
        "",
    ]
    for op in dict.fromkeys(r.op for r in recs):
        lines += [f"## {op}", "", "| shape | dtype | dir | impl | ms | GB/s | TFLOP/s | of ceiling | vs compile | "
                  "eager ms | eager vs compile | peak MiB | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in (r for r in recs if r.op == op):
            tflops = _fmt(r.tflops, ".1f") if r.tflops and r.tflops >= 1 else ""
            lines.append(
                f"| {r.shape} | {r.dtype} | {r.direction} | {r.impl} | "
                f"{_fmt(r.ms, '.3f', 'in fwd' if FUSED_BACKWARD in r.note else 'failed')} | "
                f"{_fmt(r.gbs, '.0f')} | {tflops} | {_fmt(r.of_ceiling and 100 * r.of_ceiling, '.0f')}"
                f"{'%' if r.of_ceiling else ''} | {_fmt(r.vs_compile, '.2f')} | {_fmt(r.eager_ms, '.3f')} | "
                f"{_fmt(r.eager_vs_compile, '.2f')} | {_fmt(r.peak_mib, '.0f')} | "
                f"{r.note.replace('|', '/')[:120]} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(out_dir: str, recs: list[Record]) -> None:
    """One PNG per op: % of ceiling against shape, a line per implementation; forward, backward, training step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; skipped the plots (pip install matplotlib)", file=sys.stderr)
        return
    for op in dict.fromkeys(r.op for r in recs):
        fig, axes = plt.subplots(1, 3, figsize=(16, 4), sharey=True)
        for ax, direction in zip(axes, ("fwd", "bwd", "step")):
            mine = [r for r in recs if r.op == op and r.direction == direction and r.of_ceiling]
            labels = list(dict.fromkeys(f"{r.shape} {r.dtype}" for r in mine))
            for k, impl in enumerate(dict.fromkeys(r.impl for r in recs if r.op == op)):
                if not any(r.impl == impl for r in mine):
                    continue
                points = {f"{r.shape} {r.dtype}": 100 * r.of_ceiling for r in mine if r.impl == impl}
                xs = [i for i, label in enumerate(labels) if label in points]
                ax.plot(xs, [points[labels[i]] for i in xs], marker="os^Dv<>"[k % 7], color=plt.cm.tab20(k % 20),
                        linestyle="-" if impl.startswith("tile-kernels") else "--", label=impl)  # fmt: skip
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{op} {direction}")
            ax.set_ylim(0, 110)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("% of ceiling (copy bandwidth or GEMM peak)")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{op}.png"), dpi=110)
        plt.close(fig)
