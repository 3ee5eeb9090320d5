"""Sweep of mla_decode's split-kernel configuration (BLOCK_H, BLOCK_N, num_warps, num_stages) on the current GPU:
device time (triton.testing.do_bench) and TFLOP/s of the torch op on DeepSeek-V3 decode shapes (128 heads, Dc 512,
Dr 64, bf16), paged (page 64) and contiguous, each configuration checked against the default's output. Prints one
line per configuration; the best per shape last.

    python benchmarks/sweep_mla_decode.py [--shape B,S ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import mla_decode as core
from tile_kernels.torch import _runtime

HEADS, LATENT, ROPE, PAGE = 128, 512, 64, 64


def inputs(batch, seqlen, paged, dtype=torch.bfloat16, seed=0, device="cuda"):
    """DeepSeek-V3 decode inputs, every sequence full; paged: pages of PAGE in a shuffled block table."""
    g = torch.Generator(device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    q_nope, q_pe = rnd(batch, HEADS, LATENT), rnd(batch, HEADS, ROPE)
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    if not paged:
        return q_nope, q_pe, rnd(batch, seqlen, LATENT), rnd(batch, seqlen, ROPE), lengths, None
    pages = seqlen // PAGE
    table = torch.randperm(batch * pages, generator=g, device=device).to(torch.int32).view(batch, pages)
    return q_nope, q_pe, rnd(batch * pages, PAGE, LATENT), rnd(batch * pages, PAGE, ROPE), lengths, table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="batch,context (default: 1,32768 8,16384 32,8192 128,2048)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes = [tuple(map(int, s.split(","))) for s in args.shape or ("1,32768", "8,16384", "32,8192", "128,2048")]
    default = core.config
    say = SweepLog(args.out)

    for (batch, seqlen), paged in itertools.product(shapes, (True, False)):
        x = inputs(batch, seqlen, paged)
        flops = 2 * batch * HEADS * seqlen * (2 * LATENT + ROPE)
        core.config = default
        _runtime._cached_executor.cache_clear()
        want = tk.mla_decode(*x)
        results = []
        for bh, bn, warps, stages in itertools.product((32, 64), (16, 32, 64), (4, 8), (1, 2, 3)):
            core.config = lambda *a, _c=(bh, bn, LATENT, ROPE, warps, stages), **k: _c
            _runtime._cached_executor.cache_clear()
            try:
                got = tk.mla_decode(*x)
                err = (got.float() - want.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda x=x: tk.mla_decode(*x), warmup=10, rep=50)
            except Exception as e:  # a configuration that does not compile (shared memory, registers)
                say(f"{batch}x{seqlen} {'paged' if paged else 'contig'} {bh} {bn} {warps} {stages}: {type(e).__name__}")
                continue
            results.append((ms, bh, bn, warps, stages))
            say(
                f"{batch}x{seqlen} {'paged' if paged else 'contig'} BLOCK_H {bh} BLOCK_N {bn} warps {warps} "
                f"stages {stages}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s err {err:.3g}"
            )
        core.config = default
        ms, *best = min(results)
        say(
            f"BEST {batch}x{seqlen} {'paged' if paged else 'contig'}: {best} {ms * 1e3:.1f} us "
            f"{flops / ms / 1e9:.0f} TFLOP/s"
        )
    say.save()


if __name__ == "__main__":
    main()
