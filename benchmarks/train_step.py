"""End-to-end training step of a randomly initialised Hugging Face transformers Llama, as a user runs it: stock
(SDPA attention), patched with tile_kernels.torch.apply_to, and patched with Liger-Kernel's
apply_liger_kernel_to_llama; eager and (--mode compile) torch.compile of the model. A step = forward with labels (the
loss), backward, zero_grad (no optimizer: it costs every variant the same); use_cache=False, as training recipes set it
(with the default True, transformers fills a KV cache in the training forward: a torch.cat of keys and of values a
layer, ~1 ms of a Llama-1B step for every variant; results before 2026-12-02's fourth session include it). Reports
ms a step, tokens/s, peak memory, and each variant's speed relative to stock and to Liger in the same run; writes
train_step.json / .md under --out.

    python benchmarks/train_step.py --shape llama-1b --shape llama-8b-4layers --out benchmarks/results/h200
    python benchmarks/train_step.py --tiny --device cpu      # the plumbing, on a CPU (TRITON_INTERPRET=1)

--profile adds, per variant: host and device time of the forward and of the backward (CUDA events; the host time is
until the call returns: a host time below the device time means the device never waits for launches), and the
kernels of one more step (torch.profiler, device activity only): device time by kernel, its total and the idle gaps
between kernels (the profiler's own host cost adds to them), written as train_step_kernels.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import importlib.metadata
import json
import os
import sys
import time
import types

# hidden, intermediate, layers, heads, kv heads, vocab, batch, seq
SHAPES = {
    "llama-1b": (2048, 8192, 16, 32, 8, 128256, 4, 2048),  # Llama-3.2-1B
    "llama-8b-4layers": (4096, 14336, 4, 32, 8, 128256, 2, 4096),  # Llama-3-8B's layers, four of them
    "tiny": (64, 96, 2, 4, 2, 160, 2, 32),
}
# tile-kernels: flash_attention's default backend (TileLang on sm_90 at head dims 64 and 128 in training);
# +triton-attn: its Triton kernels; +sdpa: transformers' SDPA attention. liger: Liger-Kernel's patch of the model.
VARIANTS = ("stock", "tile-kernels", "tile-kernels+residual-add", "tile-kernels+adds",
            "tile-kernels+triton-attn", "tile-kernels+sdpa", "tile-kernels+kept-norms", "liger")  # fmt: skip
# apply_to's switches per variant (the defaults otherwise); +residual-add keeps the decoder layers' post-attention add;
# +adds: q / k / v and gate / up as separate Linears (autograd adds their input gradients), the layer input's
# gradients added by autograd (the input norm as a plain RMSNorm); +kept-norms: the Linears keep the norm outputs they
# read instead of recomputing them in the backward (nn.remember_norm)
PATCH = {"tile-kernels+residual-add": dict(residual=False), "tile-kernels+adds": dict(qkv=False),
         "tile-kernels+triton-attn": dict(attention="triton"), "tile-kernels+sdpa": dict(attention=False)}  # fmt: skip


_NORM_OF = None  # tile_kernels.torch.nn._norm_of as shipped


def build(shape: str, variant: str, device: str, dtype):
    global _NORM_OF
    import torch
    import transformers

    hidden, inter, layers, heads, kv, vocab, _, _ = SHAPES[shape]
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if variant.startswith("tile-kernels"):
        import tile_kernels.torch as tk

        _NORM_OF = _NORM_OF or tk.nn._norm_of
        tk.apply_to(model, **PATCH.get(variant, {}))
        tk.nn._norm_of = _NORM_OF if variant != "tile-kernels+kept-norms" else lambda x: None
        if variant == "tile-kernels+adds":
            for mlp in (m for m in model.modules() if isinstance(m, tk.nn.SwiGLUMLP)):
                mlp.forward = lambda x, m=mlp: m.down_proj(tk.swiglu(m.gate_proj(x), m.up_proj(x)))
            for layer in (m for m in model.modules() if hasattr(m, "post_attention_layernorm")):
                layer.forward = types.MethodType(_layer_with_adds, layer)
    elif variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)  # patches the modeling module too: run it last
    model.train()
    return model


def _layer_with_adds(self, hidden_states, **kwargs):
    """The patched decoder layer as before the gradients joined in the input norm: autograd adds them."""
    attention_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    normed, hidden_states = self.post_attention_layernorm(attention_out, residual=hidden_states)
    return hidden_states + self.mlp(normed)


def kernels(step, ids, top: int = 25) -> dict:
    """One step under torch.profiler: wall ms, the summed device time of its kernels, the `top` kernels by device
    time (name, calls, ms), the device's idle gaps over 20 us (before which kernel, how long), and the kernels that
    memsets most often come between."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step(ids)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) * 1e3
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    rows = [(e.key[:90], e.count, e.self_device_time_total / 1e3) for e in events]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as exported:
            trace = json.load(exported)["traceEvents"]
    device = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    gaps = [(b["ts"] - a["ts"] - a["dur"], b["name"][:60]) for a, b in zip(device, device[1:])]
    long_gaps = sorted((g for g in gaps if g[0] > 20), reverse=True)
    between = collections.Counter(
        (a["name"][:50], c["name"][:50]) for a, b, c in zip(device, device[1:], device[2:]) if b["cat"] == "gpu_memset"
    )
    return {"wall_ms": wall, "kernel_ms": sum(r[2] for r in rows), "launches": sum(r[1] for r in rows),
            "top": rows[:top], "gaps_ms": sum(g for g, _ in gaps) / 1e3, "long_gaps": len(long_gaps),
            "long_gaps_ms": sum(g for g, _ in long_gaps) / 1e3,
            "longest": [(round(g), name) for g, name in long_gaps[:12]],
            "memsets_between": between.most_common(8)}  # fmt: skip


def memory_at_peak(step, ids, top: int = 14) -> dict:
    """One step under torch's allocation history: the step's peak (MiB above what was allocated before it) and the
    allocations alive at that moment, summed by where they were made (the innermost three Python frames outside
    torch), largest first."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=1_000_000)
    step(ids)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    alive, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and alive.pop(event["addr"], None) is not None:
            total -= event["size"]
        if total > peak:
            peak, at_peak = total, dict(alive)
    sites = {}
    for event in at_peak.values():
        frames = event.get("frames", ())
        frames = [f for f in frames if "tile_kernels" in f["filename"] or "/torch/" not in f["filename"]][:3]
        site = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames) or "?"
        count, size = sites.get(site, (0, 0))
        sites[site] = (count + 1, size + event["size"])
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
    return {"peak_mib": peak / 2**20, "at_peak": [(site, n, size / 2**20) for site, (n, size) in ranked]}


def phases(run, model, ids, steps: int = 3) -> dict:
    """Mean host ms (until each call returns) and device ms (CUDA events) of the forward and of the backward."""
    import torch

    times = []
    for _ in range(steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events[0].record()
        loss = run(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        events[1].record()
        loss.backward()
        t2 = time.perf_counter()
        events[2].record()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(
            ((t1 - t0) * 1e3, events[0].elapsed_time(events[1]), (t2 - t1) * 1e3, events[1].elapsed_time(events[2]))
        )
    keys = ("forward_host_ms", "forward_device_ms", "backward_host_ms", "backward_device_ms")
    return {k: sum(t[i] for t in times) / steps for i, k in enumerate(keys)}


def measure(
    model, shape: str, device: str, steps: int, compiled: bool, profiled: bool = False, memory: bool = False
) -> dict:
    import torch

    *_, vocab, batch, seq = SHAPES[shape]
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(2)]
    run = torch.compile(model) if compiled else model

    def step(ids):
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    started = time.perf_counter()
    losses = [step(batches[i % 2]).item() for i in range(3)]  # warm-up (compiles)
    warmup_s = time.perf_counter() - started
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    sync()
    started = time.perf_counter()
    for i in range(steps):
        loss = step(batches[i % 2])
    sync()
    ms = (time.perf_counter() - started) / steps * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    # phases first: measured after a profiled step, the host times came out higher (a profiler's leftover cost)
    profile = {"phases": phases(run, model, batches[0]), "kernels": kernels(step, batches[0])} if profiled else {}
    profile |= {"memory": memory_at_peak(step, batches[0])} if memory else {}
    return profile | {"ms": ms, "tokens_per_s": batch * seq / ms * 1e3, "peak_gib": peak, "loss": float(loss.item()),
            "warmup_loss": losses[0], "warmup_s": warmup_s}  # fmt: skip


def run_meta(script: str, gpu: str, dists) -> dict:
    """The run's GPU, date, versions of `dists` (those installed) and the command that reproduces it."""
    versions = {}
    for dist in dists:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"gpu": gpu, "date": datetime.date.today().isoformat(), "versions": versions,
            "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}  # fmt: skip


def write(out_dir: str | None, name: str, meta: dict, rows: list[dict], text: str) -> None:
    """<name>.json (meta and rows) and <name>.md (text) under out_dir, when given."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Training step, {meta['gpu']}, {meta['date']}",
        "",
        "A randomly initialised transformers Llama in bfloat16 (use_cache=False): forward with labels (loss), "
        "backward, zero_grad (no optimizer step). Wall time per step over back-to-back steps after 3 warm-up steps. "
        "stock = transformers with SDPA attention; tile-kernels = `tile_kernels.torch.apply_to(model)` (RMSNorm, "
        "SwiGLU, rotary, attention, fused linear cross-entropy; flash_attention's default backend: TileLang on sm_90 "
        "at head dims 64 and 128 in training, Triton elsewhere); "
        'tile-kernels+triton-attn = the same with `attention="triton"`; '
        "tile-kernels+sdpa = the same with `attention=False` (transformers' SDPA); "
        "liger = `apply_liger_kernel_to_llama(model=model)` (RMSNorm, SwiGLU, rotary, fused linear cross-entropy; "
        "SDPA attention).",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. Command: `{meta['command']}`.",
        "",
        "| shape | mode | variant | ms / step | tokens/s | vs stock | vs liger | peak GiB | loss at step 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['mode']} | {r['variant']} | failed: {r['error'][:100]} | | | | | |")
            continue
        same = {x["variant"]: x["ms"] for x in rows if (x["shape"], x["mode"]) == (r["shape"], r["mode"]) and "ms" in x}
        ratios = [f"{same[other] / r['ms']:.2f}" if other in same else "" for other in ("stock", "liger")]
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else ""
        lines.append(f"| {r['shape']} | {r['mode']} | {r['variant']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{ratios[0]} | {ratios[1]} | {peak} | {r['warmup_loss']:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def kernel_markdown(rows: list[dict]) -> str:
    lines = ["# Kernels of one training step", ""]
    for r in rows:
        if "kernels" not in r:
            continue
        k, p = r["kernels"], r["phases"]
        lines += [f"## {r['shape']}, {r['mode']}, {r['variant']}: wall {k['wall_ms']:.1f} ms (profiled), kernels "
                  f"{k['kernel_ms']:.1f} ms in {k['launches']} launches, idle {k['wall_ms'] - k['kernel_ms']:.1f} ms",
                  "", f"Forward: host {p['forward_host_ms']:.1f} ms, device {p['forward_device_ms']:.1f} ms; "
                  f"backward: host {p['backward_host_ms']:.1f} ms, device {p['backward_device_ms']:.1f} ms.",
                  ""]  # fmt: skip
        lines += kernel_lines(k)
    return "\n".join(lines)


def kernel_lines(k: dict) -> list[str]:
    """A `kernels` result as markdown: the kernel table, the idle gaps, where the memsets sit."""
    lines = ["| kernel | calls | ms |", "|---|---|---|"]
    lines += [f"| `{name}` | {calls} | {ms:.2f} |" for name, calls, ms in k["top"]]
    return lines + [
        "",
        f"Device idle between its first and last kernel: {k['gaps_ms']:.1f} ms, of which {k['long_gaps']} "
        f"gaps over 20 us: {k['long_gaps_ms']:.1f} ms; the longest (us, the kernel after): {k['longest']}",
        "",
        f"Memsets, most often between (count): {k['memsets_between']}",
        "",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default llama-1b")
    p.add_argument("--variant", action="append", choices=VARIANTS, help="default all")
    p.add_argument("--mode", action="append", choices=("eager", "compile"),
                   help="eager model calls, torch.compile(model), or both (repeat); default eager")  # fmt: skip
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny shape, float32 (a CPU check of the plumbing)")
    p.add_argument("--profile", action="store_true", help="the kernels of one more step (a CUDA device)")
    p.add_argument("--memory", action="store_true", help="what is allocated at the peak of one more step (CUDA)")
    p.add_argument("--out", help="directory for train_step.json / train_step.md")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    shapes = ["tiny"] if args.tiny else args.shape or ["llama-1b"]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    variants = args.variant or list(VARIANTS)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    meta = run_meta("train_step.py", gpu, ("torch", "triton", "tilelang", "transformers", "liger-kernel"))
    cases = [(shape, mode, variant) for shape in shapes for mode in args.mode or ["eager"] for variant in variants]
    rows = []
    # Liger's patch replaces transformers' modeling functions for every model built after it: its rows run last
    for shape, mode, variant in sorted(cases, key=lambda case: case[2] == "liger"):
        row = {"shape": shape, "mode": mode, "variant": variant}
        try:
            model = build(shape, variant, args.device, dtype)
            row |= measure(model, shape, args.device, args.steps, mode == "compile", args.profile, args.memory)
        except Exception as e:  # a variant that cannot run is reported, not dropped
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        model = None
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch._dynamo.reset()
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    rows.sort(key=lambda row: cases.index((row["shape"], row["mode"], row["variant"])))
    text = markdown(meta, rows)
    print(text)
    write(args.out, "train_step", meta, rows, text)
    for r in (r for r in rows if "memory" in r):
        print(f"{r['variant']}: peak {r['memory']['peak_mib']:.0f} MiB above the step's start; alive then (MiB):")
        print("\n".join(f"  {size:8.1f} x{n:<4} {site}" for site, n, size in r["memory"]["at_peak"]))
    if args.profile:
        profiled = kernel_markdown(rows)
        print(profiled)
        write(args.out, "train_step_kernels", meta, [], profiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
