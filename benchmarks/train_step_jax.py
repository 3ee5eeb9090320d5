"""End-to-end training step of a Llama-shaped decoder in JAX under jit, written once and run with two sets of ops:
plain JAX (jnp norms, SwiGLU and rotary, jax.nn.dot_product_attention with XLA's or cuDNN's attention, logits +
log-softmax loss) and tile-kernels' (tile_kernels.jax: rms_norm with the residual add fused, swiglu, apply_rotary,
flash_attention, fused_linear_cross_entropy). A step = jit(value_and_grad(loss)) over every parameter (no optimizer:
it costs both the same), bf16 parameters and activations, random init. Reports ms a step, tokens/s, peak device
memory, the speed relative to jnp in the same run; writes train_step_jax.json / .md under --out.

    python benchmarks/train_step_jax.py --shape llama-1b --shape llama-8b-4layers --out benchmarks/results/h200
    python benchmarks/train_step_jax.py --tiny        # the plumbing and the loss match, on a CPU (interpret mode)

--profile adds the kernels of one more step, recorded by torch.profiler (CUPTI sees the process's kernels, XLA's
too; needs torch): device time by kernel and the idle gaps, written as train_step_jax_kernels.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from train_step import SHAPES, kernel_lines, kernels, run_meta, write  # no torch import at module level

EPS = 1e-5


def jnp_ops(attention: str | None):
    """The model's ops in plain JAX; attention: jax.nn.dot_product_attention's implementation (None: XLA)."""
    import jax
    import jax.numpy as jnp

    def norm(x, w, residual=None):
        h = x if residual is None else x + residual
        hf = h.astype(jnp.float32)
        y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS) * w.astype(jnp.float32)
        return y.astype(x.dtype), h

    def rotary(x, cos, sin):  # GPT-NeoX halves, cos/sin (S, D/2)
        a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        c, s = cos[:, None].astype(jnp.float32), sin[:, None].astype(jnp.float32)
        return jnp.concatenate([a * c - b * s, b * c + a * s], -1).astype(x.dtype)

    def loss(hidden, weight, labels):
        logits = jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], -1))

    return dict(
        norm=norm, rotary=rotary, loss=loss, swiglu=lambda g, u: jax.nn.silu(g) * u,
        attention=lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention),
    )  # fmt: skip


def tile_kernels_ops(attention: str | None = None):
    """tile_kernels.jax's ops; attention "cudnn": jax.nn.dot_product_attention's cuDNN attention instead of ours."""
    import tile_kernels.jax as tkj

    def norm(x, w, residual=None):
        if residual is None:
            return tkj.rms_norm(x, w, EPS), x
        return tkj.rms_norm(x, w, EPS, residual=residual)

    ops = dict(norm=norm, rotary=tkj.apply_rotary, swiglu=tkj.swiglu, loss=tkj.fused_linear_cross_entropy,
               attention=lambda q, k, v: tkj.flash_attention(q, k, v, causal=True))  # fmt: skip
    return ops | ({"attention": jnp_ops(attention)["attention"]} if attention else {})


# jnp (XLA's attention materializes the scores) last: at the large shapes it runs out of memory
VARIANTS = {"jnp+cudnn": lambda: jnp_ops("cudnn"), "tile-kernels": tile_kernels_ops,
            "tile-kernels+cudnn": lambda: tile_kernels_ops("cudnn"), "jnp": lambda: jnp_ops(None)}  # fmt: skip


def init(shape: str, dtype, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    hidden, inter, layers, heads, kv, vocab, _, _ = SHAPES[shape]
    head_dim = hidden // heads
    keys = iter(jax.random.split(jax.random.key(seed), 8 * layers + 2))

    def dense(*shape):
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def layer():
        return {
            "attn_norm": jnp.ones(hidden, dtype), "mlp_norm": jnp.ones(hidden, dtype),
            "wq": dense(hidden, heads * head_dim), "wk": dense(hidden, kv * head_dim),
            "wv": dense(hidden, kv * head_dim), "wo": dense(heads * head_dim, hidden),
            "wg": dense(hidden, inter), "wu": dense(hidden, inter), "wd": dense(inter, hidden),
        }  # fmt: skip

    return {"embed": dense(vocab, hidden), "layers": [layer() for _ in range(layers)],
            "final_norm": jnp.ones(hidden, dtype), "lm_head": dense(vocab, hidden)}  # fmt: skip


def loss_fn(ops: dict, shape: str, params: dict, ids, labels):
    import jax.numpy as jnp

    hidden, _, _, heads, kv, _, batch, seq = SHAPES[shape]
    head_dim = hidden // heads
    inv_freq = 1.0 / (500000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(angles).astype(params["embed"].dtype), jnp.sin(angles).astype(params["embed"].dtype)
    x, residual = params["embed"][ids], None  # x: the last sublayer's output, residual: the stream before it
    for p in params["layers"]:
        y, residual = ops["norm"](x, p["attn_norm"], residual)
        q = ops["rotary"]((y @ p["wq"]).reshape(batch, seq, heads, head_dim), cos, sin)
        k = ops["rotary"]((y @ p["wk"]).reshape(batch, seq, kv, head_dim), cos, sin)
        v = (y @ p["wv"]).reshape(batch, seq, kv, head_dim)
        x = ops["attention"](q, k, v).reshape(batch, seq, heads * head_dim) @ p["wo"]
        y, residual = ops["norm"](x, p["mlp_norm"], residual)
        x = ops["swiglu"](y @ p["wg"], y @ p["wu"]) @ p["wd"]
    y, _ = ops["norm"](x, params["final_norm"], residual)
    return ops["loss"](y.reshape(batch * seq, hidden), params["lm_head"], labels.reshape(-1))


def measure(shape: str, variant: str, dtype, steps: int, profile: bool = False) -> dict:
    import functools

    import jax
    import numpy as np

    *_, vocab, batch, seq = SHAPES[shape]
    params = init(shape, dtype)
    rng = np.random.default_rng(1)
    ids = [jax.numpy.asarray(rng.integers(0, vocab, (batch, seq)), jax.numpy.int32) for _ in range(2)]
    labels = [jax.numpy.roll(i, -1, axis=1) for i in ids]
    step = jax.jit(jax.value_and_grad(functools.partial(loss_fn, VARIANTS[variant](), shape)))
    started = time.perf_counter()
    loss, grads = step(params, ids[0], labels[0])
    first = float(loss)
    warmup_s = time.perf_counter() - started
    for i in range(2):
        jax.block_until_ready(step(params, ids[i % 2], labels[i % 2]))
    started = time.perf_counter()
    for i in range(steps):
        loss, grads = step(params, ids[i % 2], labels[i % 2])
    jax.block_until_ready(grads)
    ms = (time.perf_counter() - started) / steps * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    row = {"ms": ms, "tokens_per_s": batch * seq / ms * 1e3, "peak_gib": None if peak is None else peak / 2**30,
           "loss": first, "warmup_s": warmup_s}  # fmt: skip
    if profile:
        row["kernels"] = kernels(lambda i: jax.block_until_ready(step(params, ids[i], labels[i])), 0, top=40)
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# JAX training step, {meta['gpu']}, {meta['date']}",
        "",
        "A Llama-shaped decoder in bfloat16 under jit: value_and_grad of the loss over every parameter (no optimizer "
        "step), wall time per step over back-to-back steps after warm-up. jnp = plain JAX (XLA fusions, "
        "jax.nn.dot_product_attention with XLA's attention); jnp+cudnn = the same with cuDNN's attention; "
        "tile-kernels = tile_kernels.jax's rms_norm (residual fused), swiglu, apply_rotary, flash_attention and "
        "fused_linear_cross_entropy; tile-kernels+cudnn = the same with cuDNN's attention. Peak = the device's peak "
        "bytes in use since the process started (a running maximum over the variants run so far).",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. Command: `{meta['command']}`.",
        "",
        "| shape | variant | ms / step | tokens/s | vs jnp | vs jnp+cudnn | peak GiB | loss at step 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['variant']} | failed: {r['error'][:100]} | | | | | |")
            continue
        same = {x["variant"]: x["ms"] for x in rows if x["shape"] == r["shape"] and "ms" in x}
        ratios = [f"{same[other] / r['ms']:.2f}" if other in same else "" for other in ("jnp", "jnp+cudnn")]
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else ""
        lines.append(f"| {r['shape']} | {r['variant']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {ratios[0]} | "
                     f"{ratios[1]} | {peak} | {r['loss']:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default llama-1b")
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="default all")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="the tiny shape in float32 on the CPU (interpret mode)")
    p.add_argument("--out", help="directory for train_step_jax.json / train_step_jax.md")
    p.add_argument("--profile", action="store_true", help="the kernels of one more step (torch.profiler)")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    shapes = ["tiny"] if args.tiny else args.shape or ["llama-1b"]
    variants = args.variant or (["jnp", "tile-kernels"] if args.tiny else list(VARIANTS))  # cuDNN: GPUs only
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    meta = run_meta("train_step_jax.py", jax.devices()[0].device_kind, ("jax", "jaxlib", "jax-triton", "triton"))
    rows = []
    for shape in shapes:
        for variant in variants:
            row = {"shape": shape, "variant": variant}
            try:
                row |= measure(shape, variant, dtype, 2 if args.tiny else args.steps, args.profile)
            except Exception as e:  # a variant that cannot run is reported, not dropped
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            jax.clear_caches()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    text = markdown(meta, rows)
    print(text)
    write(args.out, "train_step_jax", meta, rows, text)
    if args.profile:
        text = kernel_markdown(rows)
        print(text)
        write(args.out, "train_step_jax_kernels", meta, [], text)
    return 0


def kernel_markdown(rows: list[dict]) -> str:
    lines = ["# Kernels of one JAX training step", ""]
    for r in (r for r in rows if "kernels" in r):
        k = r["kernels"]
        lines += [f"## {r['shape']}, {r['variant']}: wall {k['wall_ms']:.1f} ms (profiled), kernels "
                  f"{k['kernel_ms']:.1f} ms in {k['launches']} launches (XLA overlaps kernels on its streams)",
                  ""]  # fmt: skip
        lines += kernel_lines(k)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
