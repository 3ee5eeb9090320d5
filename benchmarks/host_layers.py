"""Host time of the library's Python layers in eager torch calls, without a GPU: the ops run on CPU tensors (Triton's
interpreter switch on) with every kernel launch stubbed out, so a call times only what tile-kernels adds around its
launches (checks, plan lookup, allocation, autograd). torch's own ops beside them compute on the CPU, so their column
is an upper bound on their host cost, not a like-for-like figure. Use it to compare the Python layers before and after
a change on one machine (best of several rounds; 2-core virtual machines vary by 10%); the H200 host table
(`tile-kernels bench --framework torch --elements 1024 --width 256`) stays the measure of what users get.

    python benchmarks/host_layers.py [--op rms_norm ...]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the device checks; nothing is interpreted here

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import tile_kernels.torch as tk  # noqa: E402


def best_us(fn, calls: int = 2000, rounds: int = 9) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", action="append", help="only these rows (default: all)")
    args = p.parse_args()
    # the launches stubbed out: each step still gathers its arguments, as on a GPU, then calls a no-op
    InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None

    x = torch.randn(4, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    gate, up = torch.randn(4, 256, requires_grad=True), torch.randn(4, 256, requires_grad=True)
    r, dy = torch.randn(4, 256), torch.randn(4, 256)
    labels = torch.randint(0, 256, (4,))
    q, kv = torch.randn(1, 4, 4, 64, requires_grad=True), torch.randn(1, 4, 4, 64, requires_grad=True)  # B S H D
    rows = {  # name: (tile-kernels, torch)
        "rms_norm": (lambda: tk.rms_norm(x, w), lambda: F.rms_norm(x, (256,), w)),
        "rms_norm+residual": (lambda: tk.rms_norm(x, w, residual=r)[0], lambda: F.rms_norm(x + r, (256,), w)),
        "layer_norm": (lambda: tk.layer_norm(x, w, w), lambda: F.layer_norm(x, (256,), w, w)),
        "softmax": (lambda: tk.softmax(x), lambda: F.softmax(x, -1)),
        "swiglu": (lambda: tk.swiglu(gate, up), lambda: F.silu(gate) * up),
        "cross_entropy": (lambda: tk.cross_entropy(x, labels), lambda: F.cross_entropy(x, labels)),
        "flash_attention": (
            lambda: tk.flash_attention(q, kv, kv, causal=True).sum(),
            lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True).sum(),
        ),
    }

    def step(fn):
        def run():
            out = fn()
            out.backward(dy if out.dim() else None)
            x.grad = w.grad = gate.grad = up.grad = q.grad = kv.grad = None

        return run

    print(
        "4 x 256 float32 (attention: 1 x 4 x 4 x 64, causal), us a call (best of 9 rounds); fwd: forward with "
        "autograd recording, step: fwd + backward"
    )
    print(f"{'op':18s} {'tk fwd':>8s} {'torch fwd':>10s} {'tk step':>8s} {'torch step':>11s}")
    for name, (ours, theirs) in rows.items():
        if args.op and name not in args.op:
            continue
        cells = [best_us(ours), best_us(theirs), best_us(step(ours), calls=500), best_us(step(theirs), calls=500)]
        print(f"{name:18s} " + " ".join(f"{c:{n}.1f}" for c, n in zip(cells, (8, 10, 8, 11), strict=True)))


if __name__ == "__main__":
    main()
