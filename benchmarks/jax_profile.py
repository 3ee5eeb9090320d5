"""What XLA runs for tile-kernels' JAX ops under jit, beside the same math in jnp: for rms_norm (with a residual) and
softmax at 16384x4096 bf16, the forward, the backward (a vjp with a random cotangent), the step (forward + backward in
one jit, returning both) and the gradients alone: wall time of back-to-back jitted calls, and the ops of each compiled
HLO module (custom calls, fusions, copies), which show launches and copies the kernels do not need.

    python benchmarks/jax_profile.py            # on a GPU machine
"""

from __future__ import annotations

import collections
import re
import time

import jax
import jax.numpy as jnp

import tile_kernels.jax as tkj


def jnp_rms_norm(x, w, residual, eps=1e-6):
    h = x + residual
    hf = h.astype(jnp.float32)
    y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + eps) * w.astype(jnp.float32)
    return y.astype(x.dtype), h


def wall_ms(fn, *args, calls: int = 200) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - started) / calls * 1e3)
    return best


def hlo_ops(compiled) -> str:
    """The entry computation's instructions by kind (custom-call targets by name), e.g. 'fusion x3, triton x2'."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    kinds = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+(\w[\w-]*)\(", line)
        if not m or m.group(1) in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kinds[target.group(1) if target else m.group(1)] += 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))


def rows(name, fn, args, cts):
    def fwd(*a):
        return fn(*a)

    def bwd(vjp_fn, c):
        return vjp_fn(c)

    def step(a, c):  # outputs and gradients, as a model consumes both
        outs, vjp_fn = jax.vjp(fn, *a)
        return outs, vjp_fn(c)

    def grads_only(a, c):  # what XLA may shrink: the forward's outputs are dead, only the gradients leave
        return jax.vjp(fn, *a)[1](c)

    jf = jax.jit(fwd)
    _, vjp_fn = jax.vjp(fn, *args)
    jb = jax.jit(bwd)
    js, jg = jax.jit(step), jax.jit(grads_only)
    cases = (("fwd", jf, args), ("bwd", jb, (vjp_fn, cts)), ("step", js, (args, cts)), ("grad", jg, (args, cts)))
    for label, jitted, call_args in cases:
        ms = wall_ms(jitted, *call_args)
        ops = hlo_ops(jitted.lower(*call_args).compile())
        print(f"{name:24s} {label:4s} {ms * 1e3:8.1f} us  {ops}", flush=True)


def main() -> None:
    key = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(key[0], (16384, 4096), jnp.bfloat16)
    r = jax.random.normal(key[1], (16384, 4096), jnp.bfloat16)
    w = jax.random.normal(key[2], (4096,), jnp.bfloat16)
    cts = tuple(jax.random.normal(k, (16384, 4096), jnp.bfloat16) for k in jax.random.split(key[3], 2))
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    rows("tk.rms_norm +residual", lambda x, w, r: tkj.rms_norm(x, w, residual=r), (x, w, r), cts)
    rows("jnp rms_norm +residual", jnp_rms_norm, (x, w, r), cts)
    rows("tk.rms_norm", lambda x, w: tkj.rms_norm(x, w), (x, w), cts[0])
    rows("jnp rms_norm", lambda x, w: jnp_rms_norm(x, w, jnp.zeros_like(x))[0], (x, w), cts[0])
    rows("tk.softmax", tkj.softmax, (x,), cts[0])
    rows("jax.nn.softmax", lambda x: jax.nn.softmax(x, -1), (x,), cts[0])


if __name__ == "__main__":
    main()
