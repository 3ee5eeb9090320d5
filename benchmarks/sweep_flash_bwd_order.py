"""flash_attention's dK / dV program order (core.flash_attention.key_chunk), timed on this machine's GPU: forward +
backward through autograd (bf16, eager, do_bench ms) per backend and shape, with the chunks' byte budget
L2_CHUNK_BYTES set to each value given ("off": chunk 1, each group's key blocks in turn, the order before the
longest-first grids) and the size limit LPT_MAX_PROGRAMS lifted, so every shape runs every order. One JSON line per
(shape, causal, backend); --default adds the library's own choice ("default") and cuDNN's SDPA (its line's backend
"cudnn"), both through autograd.

    python benchmarks/sweep_flash_bwd_order.py                  # off, 8, 16, 32, 64 MiB
    python benchmarks/sweep_flash_bwd_order.py --budget 0 --budget 64 --backend tilelang
    python benchmarks/sweep_flash_bwd_order.py --budget 0 --default     # the old order, the default, cuDNN
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


def _cudnn(leaves, do, causal: bool) -> None:
    """SDPA's cuDNN attention on (B, H, S, D) tensors, forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = leaves
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
        )
    torch.autograd.grad(out, leaves, do)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", action="append", type=int, help="MiB, 0 = off (default: 0, 8, 16, 32, 64)")
    p.add_argument("--backend", action="append", choices=("tilelang", "triton"), help="default both")
    p.add_argument("--default", action="store_true", help="also the default order and cuDNN's SDPA")
    args = p.parse_args()
    limit = fa.LPT_MAX_PROGRAMS
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__}), flush=True)  # fmt: skip
    for batch, seqlen, heads_q, heads_k, head_dim, causal in SHAPES:
        torch.manual_seed(0)
        q, do = (torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        shape = [batch, seqlen, heads_q, heads_k, head_dim]
        for backend in args.backend or ("tilelang", "triton"):
            row = dict(shape=shape, causal=causal, backend=backend)
            budgets = [(b * 2**20, 2**31, f"{b}MiB" if b else "off") for b in args.budget or (0, 8, 16, 32, 64)]
            for budget, programs, name in budgets + ([(64 * 2**20, limit, "default")] if args.default else []):
                fa.L2_CHUNK_BYTES, fa.LPT_MAX_PROGRAMS = budget, programs  # budget 0: no group fits, chunk 1
                _runtime._cached_executor.cache_clear()  # plans are cached per arguments: rebuild them
                _runtime._COMPACT_RUNS.clear()
                step = functools.partial(_step, leaves, do, causal, backend)
                row[name] = round(triton.testing.do_bench(step, warmup=30, rep=250), 4)
            print(json.dumps(row), flush=True)
        if args.default:
            bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
            step = functools.partial(_cudnn, bhsd, do.transpose(1, 2).contiguous(), causal)
            ms = round(triton.testing.do_bench(step, warmup=30, rep=250), 4)
            print(json.dumps(dict(shape=shape, causal=causal, backend="cudnn", default=ms)), flush=True)


if __name__ == "__main__":
    main()
