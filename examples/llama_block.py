"""A Llama-style block's normalization and attention-softmax path, in torch and in JAX, through tile-kernels.

    h1, x1 = rms_norm(x, w1, residual=r)            (fused residual add)
    p      = softmax(causal(q k^T / sqrt(d)))       (q, k, v from x1 by plain matmuls)
    h2, x2 = rms_norm(p v Wo, w2, residual=h1)

Each framework's result is checked against the same block written with that framework's own ops in float32. On a
GPU both are timed; on a CPU (no GPU found) the kernels run in Triton's interpreter at a small size."""

from __future__ import annotations

import argparse
import os
import shutil
import time

GPU = shutil.which("nvidia-smi") is not None or shutil.which("rocm-smi") is not None
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede any triton import

import numpy as np  # noqa: E402

SIZES = {"cpu": dict(batch=1, seq=64, dim=256, heads=4), "gpu": dict(batch=4, seq=2048, dim=4096, heads=32)}


def make_inputs(batch, seq, dim, heads, seed=0):
    rng = np.random.default_rng(seed)
    scale = dim**-0.5
    return dict(
        x=rng.standard_normal((batch, seq, dim)), r=rng.standard_normal((batch, seq, dim)),
        w1=rng.uniform(0.5, 1.5, dim), w2=rng.uniform(0.5, 1.5, dim),
        wq=rng.standard_normal((dim, dim)) * scale, wk=rng.standard_normal((dim, dim)) * scale,
        wv=rng.standard_normal((dim, dim)) * scale, wo=rng.standard_normal((dim, dim)) * scale,
    )  # fmt: skip


def block(ops, np_like, x, r, w1, w2, wq, wk, wv, wo, heads):
    """The block, written once against a namespace `ops` (rms_norm, softmax) and an array module `np_like`."""
    b, s, d = x.shape
    hd = d // heads
    h1, x1 = ops.rms_norm(x, w1, 1e-6, residual=r)

    def split(t):
        return np_like.swapaxes(t.reshape(b, s, heads, hd), 1, 2)

    q, k, v = split(h1 @ wq), split(h1 @ wk), split(h1 @ wv)
    scores = (q @ np_like.swapaxes(k, -1, -2)) * hd**-0.5
    causal = np_like.tril(np_like.ones_like(scores[0, 0], dtype=bool))
    p = ops.softmax(np_like.where(causal, scores, -float("inf")), dim=-1)
    attn = np_like.swapaxes(p @ v, 1, 2).reshape(b, s, d)
    return ops.rms_norm(attn @ wo, w2, 1e-6, residual=x1)


class TorchPlain:
    @staticmethod
    def rms_norm(x, w, eps, residual):
        import torch

        h = x + residual
        return torch.nn.functional.rms_norm(h, h.shape[-1:], w, eps), h

    @staticmethod
    def softmax(x, dim):
        return x.softmax(dim)


class JaxPlain:
    @staticmethod
    def rms_norm(x, w, eps, residual):
        import jax

        h = x + residual
        return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + eps) * w, h

    @staticmethod
    def softmax(x, dim):
        import jax

        return jax.nn.softmax(x, axis=dim)


def run_torch(inputs, heads, dtype_name):
    import torch

    import tile_kernels.torch as tk

    device = "cuda" if GPU else "cpu"
    dtype = getattr(torch, dtype_name)
    args = {k: torch.tensor(v, device=device, dtype=dtype) for k, v in inputs.items()}

    class Plain:
        rms_norm, softmax = TorchPlain.rms_norm, TorchPlain.softmax

    ours = block(tk, torch, heads=heads, **args)
    ref = block(Plain, torch, heads=heads, **{k: v.float() for k, v in args.items()})
    timing = None
    if GPU:
        from triton.testing import do_bench

        timing = (do_bench(lambda: block(tk, torch, heads=heads, **args)),
                  do_bench(lambda: block(Plain, torch, heads=heads, **args)))  # fmt: skip
    return [o.float().cpu().numpy() for o in ours], [o.cpu().numpy() for o in ref], timing


def run_jax(inputs, heads, dtype_name):
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    args = {k: jnp.asarray(v, dtype=dtype_name) for k, v in inputs.items()}
    ours_fn = jax.jit(lambda a: block(tk, jnp, heads=heads, **a))
    plain_fn = jax.jit(lambda a: block(JaxPlain, jnp, heads=heads, **a))
    ours = ours_fn(args)
    ref = plain_fn({k: v.astype(jnp.float32) for k, v in args.items()})
    timing = None
    if GPU:

        def bench(fn):
            jax.block_until_ready(fn(args))
            start = time.perf_counter()
            for _ in range(20):
                out = fn(args)
            jax.block_until_ready(out)
            return (time.perf_counter() - start) / 20 * 1e3

        timing = bench(ours_fn), bench(plain_fn)
    return [np.asarray(o, dtype=np.float32) for o in ours], [np.asarray(o) for o in ref], timing


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16" if GPU else "float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--frameworks", default="torch,jax")
    args = parser.parse_args()
    size = SIZES["gpu" if GPU else "cpu"]
    inputs = make_inputs(**size)
    tol = {"float32": 2e-3, "float16": 3e-2, "bfloat16": 1e-1}[args.dtype]
    print(f"device: {'GPU' if GPU else 'CPU (Triton interpreter)'}; {size}; {args.dtype}")
    failed = False
    for name in args.frameworks.split(","):
        ours, ref, timing = {"torch": run_torch, "jax": run_jax}[name](inputs, size["heads"], args.dtype)
        err = max(float(np.abs(o - r).max() / max(1.0, np.abs(r).max())) for o, r in zip(ours, ref))
        ok = err <= tol
        failed |= not ok
        line = f"{name:5s}: max relative error vs plain {name} fp32 = {err:.2e} ({'ok' if ok else 'FAIL'})"
        if timing:
            line += f"; block {timing[0]:.3f} ms with tile-kernels, {timing[1]:.3f} ms plain"
        print(line)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
