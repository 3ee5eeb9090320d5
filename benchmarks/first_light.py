"""First bandwidth figures for the spine's ops on a GPU (the full `bench` command is a later issue's work).

For each op and shape: median time (triton.testing.do_bench) and achieved GB/s from the op's cost metadata
(algorithmic bytes), for tile-kernels through torch and through JAX (jax-triton), torch eager, torch.compile and a
jax.jit reference, beside a device-copy ceiling measured in the same run. Writes JSON and prints a markdown table.

    python benchmarks/first_light.py --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from triton.testing import do_bench

import tile_kernels.torch as tk
from tile_kernels.core import REGISTRY

torch._functorch.config.donated_buffer = False  # compiled backwards are replayed with retain_graph

SHAPES = [(32768, 4096), (16384, 8192), (4096, 65536), (256, 262144)]  # bf16: 256-512 MiB per tensor, > L2


def copy_ceiling_gbs() -> float:
    src = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def torch_cases(shape, dtype):
    rows, n = shape
    x = torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(rows, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)

    def eager_rms(x, w, r):
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-6), h

    def eager_layer(x, w, b, r):
        h = x + r
        return F.layer_norm(h, (n,), w, b, 1e-5), h

    def eager_softmax(x):
        return torch.softmax(x, -1)

    def eager_swiglu(g, u):
        return F.silu(g) * u

    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    u = torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True)
    compiled_rms, compiled_softmax = torch.compile(eager_rms), torch.compile(eager_softmax)
    compiled_layer, compiled_swiglu = torch.compile(eager_layer), torch.compile(eager_swiglu)
    return {
        "layer_norm": (
            {"tile-kernels": lambda: tk.layer_norm(x, w, b, 1e-5, residual=r),
             "torch eager": lambda: eager_layer(x, w, b, r), "torch.compile": lambda: compiled_layer(x, w, b, r)},
            (x, w, b),
            {"x": x, "weight": w, "bias": b, "residual": r},
        ),
        "swiglu": (
            {"tile-kernels": lambda: tk.swiglu(x, u), "torch eager": lambda: eager_swiglu(x, u),
             "torch.compile": lambda: compiled_swiglu(x, u)},
            (x, u),
            {"gate": x, "up": u},
        ),
        "rms_norm": (
            {"tile-kernels": lambda: tk.rms_norm(x, w, 1e-6, residual=r), "torch eager": lambda: eager_rms(x, w, r),
             "torch.compile": lambda: compiled_rms(x, w, r)},
            (x, w),
            {"x": x, "weight": w, "residual": r},
        ),
        "softmax": (
            {"tile-kernels": lambda: tk.softmax(x), "torch eager": lambda: eager_softmax(x),
             "torch.compile": lambda: compiled_softmax(x)},
            (x,),
            {"x": x},
        ),
    }  # fmt: skip


def bench_backward(fn, leaves):
    """Median time of the backward alone: one forward graph, replayed with retain_graph."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    cts = [torch.randn_like(o) for o in outs]
    return do_bench(lambda: torch.autograd.grad(outs, leaves, cts, retain_graph=True))


def jax_forward_ms(op, shape, dtype_name):
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tkj

    rows, n = shape
    x = jax.random.normal(jax.random.key(0), shape, dtype_name)
    r = jax.random.normal(jax.random.key(1), shape, dtype_name)
    w = jax.random.normal(jax.random.key(2), (n,), dtype_name)
    if op == "layer_norm":
        ours = jax.jit(lambda x, w, r: tkj.layer_norm(x, w, w, 1e-5, residual=r))

        def ref(x, w, r):
            h = x + r
            hf = h.astype(jnp.float32)
            c = hf - hf.mean(-1, keepdims=True)
            return (c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * w + w).astype(x.dtype), h

        fns, args = {"tile-kernels (jax)": ours, "jax.jit reference": jax.jit(ref)}, (x, w, r)
    elif op == "swiglu":
        fns = {"tile-kernels (jax)": jax.jit(tkj.swiglu), "jax.jit reference": jax.jit(lambda g, u: jax.nn.silu(g) * u)}
        args = (x, r)
    elif op == "rms_norm":
        ours = jax.jit(lambda x, w, r: tkj.rms_norm(x, w, 1e-6, residual=r))

        def ref(x, w, r):
            h = x + r
            hf = h.astype(jnp.float32)
            return (hf * jax.lax.rsqrt((hf * hf).mean(-1, keepdims=True) + 1e-6) * w).astype(x.dtype), h

        fns, args = {"tile-kernels (jax)": ours, "jax.jit reference": jax.jit(ref)}, (x, w, r)
    else:
        fns, args = {"tile-kernels (jax)": jax.jit(tkj.softmax), "jax.jit reference": jax.jit(jax.nn.softmax)}, (x,)
    times = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args))
        samples = []
        for _ in range(30):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples.append(time.perf_counter() - start)
        times[name] = float(np.median(samples) * 1e3)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="first_light.json")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--render", metavar="JSON", help="print the markdown table of a results file and exit")
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        print(markdown_table(data["meta"], data["results"]))
        return
    dtype = getattr(torch, args.dtype)
    ceiling = copy_ceiling_gbs()
    results = []
    for shape in SHAPES:
        for op, (fns, leaves, kwargs) in torch_cases(shape, dtype).items():
            cost_fwd, cost_bwd = REGISTRY[op].cost({k: _Shape(v) for k, v in kwargs.items()})
            for name, fn in fns.items():
                for direction, cost, ms in (
                    ("fwd", cost_fwd, do_bench(fn)),
                    ("bwd", cost_bwd, bench_backward(fn, leaves)),
                ):
                    results.append(dict(op=op, shape=list(shape), direction=direction, impl=name, ms=ms,
                                        gbs=cost.bytes / ms / 1e6))  # fmt: skip
            if not args.no_jax:
                for name, ms in jax_forward_ms(op, shape, args.dtype).items():
                    results.append(dict(op=op, shape=list(shape), direction="fwd", impl=name, ms=ms,
                                        gbs=cost_fwd.bytes / ms / 1e6))  # fmt: skip
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                date=datetime.date.today().isoformat(), dtype=args.dtype, copy_gbs=ceiling)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    print(markdown_table(meta, results))


def markdown_table(meta: dict, results: list[dict]) -> str:
    lines = [
        f"{meta}",
        "",
        "| op | rows x width | dir | impl | ms | GB/s | % of copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['op']} | {r['shape'][0]}x{r['shape'][1]} | {r['direction']} | {r['impl']} | "
                     f"{r['ms']:.3f} | {r['gbs']:.0f} | {100 * r['gbs'] / meta['copy_gbs']:.0f}% |")  # fmt: skip
    return "\n".join(lines)


class _Shape:
    """Shape/dtype view of a tensor for the core cost functions."""

    def __init__(self, t):
        self.shape, self.dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")


if __name__ == "__main__":
    main()
