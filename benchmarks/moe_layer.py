"""A mixture-of-experts MLP layer's training step (forward + backward) in eager torch, wall time with back-to-back
calls: tile-kernels (moe_route, moe_permute, grouped_matmul, swiglu, grouped_matmul, moe_unpermute) beside the
transformers-style loop over experts (index, two matmuls, index_add_) and a torch._grouped_mm pipeline (argsort,
gather, grouped GEMMs, index_add_), in one run. bf16 weights and activations, softmax top-k router in float32. Each
line: ms per step, peak memory, and the max |difference| of the output to the loop's relative to its largest entry;
then the speed of each relative to the loop.

    python benchmarks/moe_layer.py [--shape mixtral|deepseek-v2-lite|tiny] [--steps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import tile_kernels.torch as tk

# name: (tokens, model dim, expert hidden dim, experts, top-k)
SHAPES = {
    "mixtral": (8192, 4096, 14336, 8, 2),
    "deepseek-v2-lite": (8192, 2048, 1408, 64, 6),
    "tiny": (64, 32, 16, 4, 2),
}


def route(x, router, k):
    gates, ids = torch.softmax(x.float() @ router.float().t(), -1).topk(k, dim=-1)
    return gates / gates.sum(-1, keepdim=True), ids


def tile_kernels_layer(x, router, w_up, w_down, k):
    gates, ids = route(x, router, k)
    positions, sizes = tk.moe_route(ids.int(), w_up.shape[0])
    h = tk.grouped_matmul(tk.moe_permute(x, positions), w_up, sizes)
    ys = tk.grouped_matmul(tk.swiglu(*h.chunk(2, -1)), w_down, sizes)
    return tk.moe_unpermute(ys, positions, gates)


def loop_layer(x, router, w_up, w_down, k):
    """A loop over the experts, each over the tokens routed to it (one host sync an expert, as such loops have)."""
    gates, ids = route(x, router, k)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_up.shape[0]):
        token, choice = torch.where(ids == e)
        gate, up = (x[token] @ w_up[e]).chunk(2, -1)
        out = out.index_add(0, token, (F.silu(gate) * up @ w_down[e]).float() * gates[token, choice, None])
    return out.to(x.dtype)


def grouped_mm_layer(x, router, w_up, w_down, k):
    """torch's grouped GEMM over the choices sorted by expert (argsort), the outputs added back by index_add."""
    gates, ids = route(x, router, k)
    order = ids.flatten().argsort(stable=True)
    offsets = torch.bincount(ids.flatten(), minlength=w_up.shape[0]).cumsum(0).int()
    xs = x[order // k]
    gate, up = torch._grouped_mm(xs, w_up, offs=offsets).chunk(2, -1)
    ys = torch._grouped_mm((F.silu(gate) * up).contiguous(), w_down, offs=offsets).float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add(0, order // k, ys * gates.flatten()[order, None]).to(x.dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", action="append", choices=SHAPES, help="repeatable; default mixtral, deepseek-v2-lite"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layers = {"tile-kernels": tile_kernels_layer, "loop over experts": loop_layer}
    if device == "cuda" and hasattr(torch, "_grouped_mm"):
        layers["torch._grouped_mm"] = grouped_mm_layer
    lines = [f"# {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
             f"{args.steps} steps, forward + backward"]  # fmt: skip
    print(lines[0], flush=True)
    for name in args.shape or ("mixtral", "deepseek-v2-lite"):
        t, d, f, e, k = SHAPES[name]
        g = torch.Generator(device).manual_seed(0)
        x = torch.randn(t, d, generator=g, device=device).to(dtype).requires_grad_()
        router = (torch.randn(e, d, generator=g, device=device) / d**0.5).to(dtype).requires_grad_()
        w_up = (torch.randn(e, d, 2 * f, generator=g, device=device) / d**0.5).to(dtype).requires_grad_()
        w_down = (torch.randn(e, f, d, generator=g, device=device) / f**0.5).to(dtype).requires_grad_()
        dy = torch.randn(t, d, generator=g, device=device).to(dtype)
        params = (x, router, w_up, w_down)
        want = loop_layer(*params, k).float()
        times = {}
        for label, layer in layers.items():
            err = (layer(*params, k).float() - want).abs().max().item() / want.abs().max().item()
            layer(*params, k).backward(dy)  # warm-up: compiles, autotunes
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(args.steps):
                layer(*params, k).backward(dy)
            if device == "cuda":
                torch.cuda.synchronize()
            times[label] = (time.perf_counter() - start) * 1e3 / args.steps
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
            lines.append(f"{name} T={t} D={d} F={f} E={e} k={k} {label}: {times[label]:.2f} ms, peak {peak:.1f} GiB, "
                         f"rel. diff {err:.1e}")  # fmt: skip
            print(lines[-1], flush=True)
        ratios = ", ".join(f"{label} {times['loop over experts'] / ms:.2f}x" for label, ms in times.items())
        lines.append(f"{name}: speed vs the loop: {ratios}")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
