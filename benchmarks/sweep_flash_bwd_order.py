"""flash_attention's dK / dV program order (core.flash_attention.key_chunk), timed on this machine's GPU: forward +
backward through autograd (bf16, eager, do_bench ms) per backend and shape, with the chunks' byte budget
L2_CHUNK_BYTES set to each value given ("off": chunk 1, each group's key blocks in turn, the order before the
longest-first grids) and the size limit LPT_MAX_PROGRAMS lifted, so every shape runs every order. One JSON line per
(shape, causal, backend).

    python benchmarks/sweep_flash_bwd_order.py                  # off, 8, 16, 32, 64 MiB
    python benchmarks/sweep_flash_bwd_order.py --budget 0 --budget 64 --backend tilelang
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

import tile_kernels.torch as tk
from tile_kernels.core import flash_attention as fa
from tile_kernels.torch import _runtime

# B, S, Hq, Hk, D, causal: Llama-3.2-1B's attention, Llama-3-8B's at S 4096, long MHA and GQA
SHAPES = ((4, 2048, 32, 8, 64, True), (2, 4096, 32, 8, 128, True), (4, 8192, 32, 32, 128, True),
          (4, 8192, 32, 32, 128, False), (4, 8192, 32, 8, 64, True))  # fmt: skip


def _step(leaves, do, causal: bool, backend: str) -> None:
    out = tk.flash_attention(*leaves, causal=causal, backend=backend)
    torch.autograd.grad(out, leaves, do)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", action="append", type=int, help="MiB, 0 = off (default: 0, 8, 16, 32, 64)")
    p.add_argument("--backend", action="append", choices=("tilelang", "triton"), help="default both")
    args = p.parse_args()
    fa.LPT_MAX_PROGRAMS = 2**31
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__}), flush=True)  # fmt: skip
    for batch, seqlen, heads_q, heads_k, head_dim, causal in SHAPES:
        torch.manual_seed(0)
        q, do = (torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        for backend in args.backend or ("tilelang", "triton"):
            row = dict(shape=[batch, seqlen, heads_q, heads_k, head_dim], causal=causal, backend=backend)
            for budget in args.budget or (0, 8, 16, 32, 64):
                fa.L2_CHUNK_BYTES = budget * 2**20 if budget else 0  # 0: no group fits, chunk 1
                _runtime._cached_executor.cache_clear()  # plans are cached per arguments: rebuild them
                _runtime._COMPACT_RUNS.clear()

                step = functools.partial(_step, leaves, do, causal, backend)
                row[f"{budget}MiB" if budget else "off"] = round(triton.testing.do_bench(step, warmup=30, rep=250), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
