"""`tile-kernels bench --megakernel`: one decode step (batch 1, bf16, random weights) of a Llama-shaped stack, timed
five ways in one run on one GPU:

    megakernel                   the persistent kernel, one cooperative launch a step (build_decode_step)
    torch eager                  reference.decode_step
    CUDA graph                   reference.decode_step captured in a CUDA graph and replayed
    per-op, CUDA graph           the megakernel's task bodies launched one op of a layer at a time (5 launches a
                                 layer, Megakernel.staged), captured in a CUDA graph
    per-op, CUDA graph + PDL     the same with programmatic dependent launch: each launch prefetches its weights to
                                 L2, then waits for the previous one (griddepcontrol)

and variants of the megakernel that the GPU runs learn from: without the L2 prefetch, with more of it (a task's first
128 KB of each matrix, or all of it, against the default's 32 KB); weight loads without the L2 evict_first policy; every
thread polling a counter instead of one a CTA, shorter poll sleeps; GEMV weight tiles of 8192 or 32768 elements
(tile_budget; the default is kernel.TILE_BUDGET = 16384, two tiles in flight); 4 warps (8192-element tiles: the same
registers a thread as 8 warps at 16384) / 16 warps; 4 / 8 KV splits; 24-row QKV tasks; 4x O-projection
rows; the queues balanced by each task's traced run time (trace.py) instead of its estimated bytes. Every
megakernel's first launch runs under the watchdog and is compared with the eager step (max |error| recorded).

The floor is (every layer's weights + the KV cache rows read at the context) / the measured copy bandwidth. The
megakernel is timed over back-to-back launches (CUDA events around 20 steps, median of 5): it cannot be replayed from
a CUDA graph, since every launch takes the next epoch of its counters."""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys

SHAPES = {  # name: (layers, hidden, heads, kv heads, head dim, MLP), context 1024
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192),
    "llama-3-8b": (32, 4096, 32, 8, 128, 14336),
}
CONTEXT = 1024


def _events_us(fn, steps: int = 20, repeats: int = 5) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def _graph_us(fn, steps: int = 10) -> float:
    """fn captured `steps` times back to back in one CUDA graph; median replay time per step."""
    import torch

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    return _events_us(graph.replay, steps=1) / steps


def _copy_gbs() -> float:
    import torch

    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = _events_us(lambda: dst.copy_(src), steps=10)
    return 2 * src.numel() * 2 / us / 1e3


def bench_shape(
    shape_name: str,
    layers: int | None = None,
    seed: int = 0,
    device: str = "cuda",
    trace_dir: str | None = None,
    context: int | None = None,
    impls: list[str] | None = None,
    save=None,
) -> dict:
    """Builds the stack with random bf16 weights and times every implementation (with `impls`, the megakernel and
    those whose name contains one of them; a failure recorded, not raised), then traces one megakernel step
    (trace.py): its table per task kind in the result, and with `trace_dir` the Chrome trace and (with matplotlib)
    the SM x time plot as files there. `save`, if given, is called with the result so far after every
    implementation (one dict, filled in as the run goes). `device` "cpu" runs the plumbing in Triton's interpreter
    (tests, with the timers replaced). `context`: the cached positions the step reads (default CONTEXT)."""
    from dataclasses import replace

    import torch

    from . import DecoderConfig, build_decode_step, build_graph, check_schedule, decode_step, pack_weights, schedule
    from .kernel import Megakernel
    from .weights import LAYER_WEIGHTS, layer_weights

    nl, hidden, heads, kv_heads, head_dim, mlp = SHAPES[shape_name]
    nl, context = layers or nl, context or CONTEXT
    config = DecoderConfig(nl, hidden, heads, kv_heads, head_dim, mlp, max_seq=context, rope_theta=500000.0)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for i in range(nl):
        for hf, shape_of in LAYER_WEIGHTS.values():
            shape = shape_of(config)
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            w = w * 0.3 + 1 if len(shape) == 1 else w * shape[1] ** -0.5
            weights[f"model.layers.{i}.{hf}.weight"] = w.to(torch.bfloat16)
    cache = (torch.randn(config.kv_cache_shape(), generator=gen, device=device) * 0.5).to(torch.bfloat16)
    x = torch.randn(1, hidden, generator=gen, device=device).to(torch.bfloat16)
    position = context - 1
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    kv_bytes = 2 * nl * context * kv_heads * head_dim * cache.element_size()
    step = build_decode_step(config, weights, context_hint=context)
    kernel = step.kernel
    eager_out = decode_step(config, weights, x, cache.clone(), position).float()
    err = {"scale": eager_out.abs().max().item()}

    def checked(name: str, k):
        """k's first launch under the watchdog (a hang raises instead of eating the run), its error vs eager."""
        k.debug, k.meta["DEBUG"], k.timeout_ns = True, True, int(2e9)
        err[name] = (k(x, cache.clone(), position).float() - eager_out).abs().max().item()
        k.debug, k.meta["DEBUG"] = False, False
        print(f"bench megakernel {shape_name}: {name}: max |error| vs eager {err[name]:.3g}", file=sys.stderr)
        return k

    def variant(**options):
        """The megakernel with other launch options or tiling, timed over back-to-back launches."""
        tiling, costs = options.pop("tiling", None), options.pop("costs_ns", None)
        graph, sched = step.graph, step.schedule
        if tiling is not None or costs is not None:
            graph = graph if tiling is None else build_graph(config, tiling, context)
            sched = schedule(graph, kernel.grid[0], costs_ns=costs)
            check_schedule(graph, sched)
        label = str(options or tiling or "queues by traced cost")
        k = checked(label, Megakernel(graph, sched, packed, device, **options))
        return _events_us(lambda: k(x, cache, position))

    checked("megakernel", kernel)
    _, trace = step.trace(x, cache.clone(), position)  # each task's run time: the variant scheduled by it
    err["per-op"] = (kernel.staged(x, cache.clone(), position).float() - eager_out).abs().max().item()
    packed = pack_weights(config, layer_weights(config, weights))
    timers = {
        "megakernel": lambda: _events_us(lambda: step(x, cache, position)),
        "torch eager": lambda: _events_us(lambda: decode_step(config, weights, x, cache, position), steps=5),
        "CUDA graph": lambda: _graph_us(lambda: decode_step(config, weights, x, cache, position)),
        "per-op, CUDA graph": lambda: _graph_us(lambda: kernel.staged(x, cache, position)),
        "per-op, CUDA graph + PDL": lambda: _graph_us(lambda: kernel.staged(x, cache, position, pdl=True)),
        # variants of the default: the L2 prefetch's worth, weight bytes in flight, warps, attention splits
        # (the default prefetches a task's first 32 KB of each matrix, or of an ATTN split's K and V, to L2 before
        # its waits)
        "megakernel, no L2 prefetch": lambda: variant(prefetch=None),
        "megakernel, L2 prefetch of 128 KB": lambda: variant(prefetch_bytes=131072),
        "megakernel, L2 prefetch of whole tasks": lambda: variant(prefetch_bytes=None),
        # weight loads without the L2 evict_first policy (the default marks them: read once, they leave L2 first)
        "megakernel, weights evicted normally": lambda: variant(weights_evict_first=False),
        # every thread polls a counter (the default: thread 0 alone, the others wait at a barrier); the polls'
        # nanosleep backoff capped at 64 ns or none (default 256)
        "megakernel, every thread polls": lambda: variant(one_poller=False),
        "megakernel, 64 ns poll sleeps": lambda: variant(poll_sleep_ns=64),
        "megakernel, no poll sleep": lambda: variant(poll_sleep_ns=0),
        # tile_budget: elements of a GEMV weight tile, two in flight per CTA (default 16384: 64 KB of bf16 at most)
        "megakernel, 8192-element tiles": lambda: variant(tile_budget=8192),
        # ptxas spills registers at 32768 (sm_90, 8 warps): whether the bytes in flight outweigh the spills
        "megakernel, 32768-element tiles": lambda: variant(tile_budget=32768),
        "megakernel, 4 warps, 8192-element tiles": lambda: variant(num_warps=4, tile_budget=8192),
        "megakernel, 16 warps": lambda: variant(num_warps=16),
        "megakernel, 4 KV splits": lambda: variant(tiling=replace(step.graph.tiling, kv_splits=4)),
        "megakernel, 8 KV splits": lambda: variant(tiling=replace(step.graph.tiling, kv_splits=8)),
        # QKV tiles of 24 rows (Tiling.auto rounds to 16: 32 rows, 96 tasks on 1B's 132 SMs): 128 shorter tasks
        "megakernel, 24-row QKV tiles": lambda: variant(tiling=replace(step.graph.tiling, qkv=24)),
        # O-projection tiles of 4x the rows: fewer, longer GEMV tasks
        "megakernel, 4x O rows": lambda: variant(tiling=replace(step.graph.tiling, o=4 * step.graph.tiling.o)),
        # the queues balanced by the traced run time of each task instead of its estimated bytes
        "megakernel, queues by traced cost": lambda: variant(costs_ns=trace.costs_ns()),
    }
    times, notes = {}, {}
    result = {
        "shape": shape_name,
        "config": {k: v for k, v in config.__dict__.items() if k != "rope_scaling"},
        "context": context,
        "grid": kernel.grid[0],
        "tasks": len(step.graph.tasks),
        "prefetch": kernel.prefetch,
        "tile_budget": kernel.tile_budget,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "max_abs_err_vs_eager": err,
        "us": times,
        "notes": notes,
        "trace": trace.table(),
        "trace_files": [],
    }
    for impl, timer in timers.items():
        if impls and impl != "megakernel" and not any(part in impl for part in impls):
            continue
        try:
            times[impl] = timer()
        except Exception as e:  # noqa: BLE001 - recorded with the reason, never dropped silently
            times[impl], notes[impl] = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if device != "cpu":
            torch.cuda.synchronize()
        line = f"bench megakernel {shape_name}: {impl}: {times[impl]} us {notes.get(impl, '')}"
        print(line, file=sys.stderr, flush=True)
        if save:
            save(result)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        stem = f"{shape_name}_{context}_trace"
        trace.save(os.path.join(trace_dir, stem + ".json"))
        result["trace_files"].append(stem + ".json")
        try:
            trace.plot(os.path.join(trace_dir, stem + ".png"))
            result["trace_files"].append(stem + ".png")
        except ImportError as e:
            print(f"bench megakernel {shape_name}: no trace plot: {e}", file=sys.stderr)
    return result


def markdown(result: dict) -> str:
    copy = result["copy_gbs"]
    lines = [
        f"# megakernel decode step: {result['gpu']}, {result['date']}, copy {copy:.0f} GB/s",
        "",
        "| shape | context | implementation | us / step | tokens / s | % of floor | time / megakernel's | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape in result["shapes"]:
        floor_us = (shape["weight_bytes"] + shape["kv_bytes"]) / copy / 1e3
        mk = shape["us"].get("megakernel")
        row = f"| {shape['shape']} | {shape['context']} |"
        lines.append(f"{row} floor (weights + KV / copy) | {floor_us:.0f} | {1e6 / floor_us:.0f} | 100% | | |")
        for impl, us in shape["us"].items():
            if us is None:
                lines.append(f"{row} {impl} | failed | | | | {shape['notes'].get(impl, '')} |")
                continue
            ratio = f"{us / mk:.2f}x" if mk else ""
            lines.append(f"{row} {impl} | {us:.0f} | {1e6 / us:.0f} | {100 * floor_us / us:.0f}% | {ratio} | |")
    for shape in result["shapes"]:
        if "trace" in shape:
            lines += ["", f"## {shape['shape']}, context {shape['context']}: one traced megakernel step", "",
                      shape["trace"]]  # fmt: skip
    return "\n".join(lines)


def run(out: str | None = None, shapes=None, layers: int | None = None, contexts=None, impls=None) -> dict:
    import importlib.metadata

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench --megakernel: no CUDA device visible to torch")
    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "triton": importlib.metadata.version("triton")},
        "copy_gbs": _copy_gbs(),
        "shapes": [],
    }
    save = functools.partial(_save, out, result)  # after every implementation: a cut-short run keeps it
    for name in shapes or SHAPES:
        for context in contexts or (CONTEXT,):
            save(bench_shape(name, layers, trace_dir=out, context=context, impls=impls, save=save))
    return result


def _save(out: str | None, result: dict, shape: dict) -> None:
    """`shape` (a bench_shape result, maybe still filling in) into `result`, then both files into `out`."""
    if not any(s is shape for s in result["shapes"]):
        result["shapes"].append(shape)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "megakernel.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out, "megakernel.md"), "w") as f:
            f.write(markdown(result) + "\n")
