"""Sweep of dequant_matmul's launch configuration (core.dequant_matmul.Blocks) on the current GPU: device time of the
torch op (CUDA-graph replays, triton.testing.do_bench_cudagraph), beside cuBLAS on the weight dequantized once
(torch.mm, the ceiling a W4A16 kernel must beat at decode sizes) in the same run. Llama-3-70B's MLP up projection
(K 8192, N 28672), bf16, group 128, no zeros. Each line: us, GB/s of the int4 weight (+ scales), TFLOP/s, and the
max |difference| to the fp32 product of the dequantized weight, relative to its largest entry. The best per M last.
At prefill sizes (M > 64) the TileLang kernel's configurations (core.dequant_matmul_tilelang.CONFIGS) too, on Hopper.

    python benchmarks/sweep_dequant_matmul.py [--m 1 --m 16 --m 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import triton.testing
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import dequant_matmul as core
from tile_kernels.core import dequant_matmul_tilelang
from tile_kernels.torch import _runtime
from tile_kernels.torch._calls import cuda_arch

K, N, GROUP = 8192, 28672, 128


def decode_candidates(m):
    """split_k 0: the heuristic's."""
    if m == 1:  # the FMA kernel: 4 or 8 columns a thread (block_n / 32 warps), a step of 4 or 8 rows of words
        for (block_n, warps), block_k, split in itertools.product(((256, 1), (512, 2), (1024, 4), (256, 2),
                                                                   (512, 4)), (32, 64), (0, 16, 32)):  # fmt: skip
            yield core.Blocks(1, block_n, block_k, warps, 3, split, gemv=True)
    elif m <= 4:  # the FMA kernel, m rows a program (a's loads and sums per row, the unpacked codes shared)
        for (block_n, warps), block_k, split in itertools.product(((256, 2), (512, 2), (256, 1)), (32, 64), (0, 16)):
            yield core.Blocks(m, block_n, block_k, warps, 3, split, gemv=True)
    for block_n, warps, split in itertools.product((128, 256), (4, 8), (0, 8, 16)):
        yield core.Blocks(16, block_n, 128, warps, 3, split, by_nibble=True)
    for block_n, stages, split in itertools.product((128, 256), (2, 3), (0, 8, 16)):  # W^T a^T, weights in registers
        yield core.Blocks(16, block_n, 128, 4, stages, split, transposed=True)


def prefill_candidates():
    for bm, bn, bk, warps, stages in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                                      (128, 256, 128, 8, 2), (128, 128, 128, 4, 3)]:  # fmt: skip
        yield core.Blocks(bm, bn, bk, warps, stages, post_scale=False)
    for bm, bn, bk, warps, stages in [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3)]:
        yield core.Blocks(bm, bn, bk, warps, stages, by_nibble=True)  # scales after the product
    for bn, bk, warps in [(128, 64, 8), (256, 32, 8), (128, 128, 8), (256, 64, 8)]:  # W formed, then cuBLAS
        yield core.Blocks(128, bn, bk, warps, 1, dequantize_first=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, action="append", help="rows of a (default: 1, 2, 4, 16, 4096)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    say = SweepLog(args.out)

    g = torch.Generator("cuda").manual_seed(0)
    qweight = torch.randint(-(2**31), 2**31 - 1, (K // 8, N), generator=g, device="cuda", dtype=torch.int32)
    scales = (torch.rand(K // GROUP, N, generator=g, device="cuda") * 0.02 + 0.01).to(torch.bfloat16)
    codes = (qweight[:, None, :] >> (4 * torch.arange(8, device="cuda"))[None, :, None]) & 0xF
    w = ((codes.reshape(K, N).float() - 8) * scales.float().repeat_interleave(GROUP, 0)).to(torch.bfloat16)
    weight_bytes = qweight.nbytes + scales.nbytes
    default = core.blocks
    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; K {K} N {N}")
    for m in args.m or (1, 2, 4, 16, 4096):
        a = torch.randn(m, K, generator=g, device="cuda").to(torch.bfloat16)
        want = a.float() @ w.float()
        scale = want.abs().max().item()
        flops = 2 * m * N * K
        cublas = triton.testing.do_bench_cudagraph(lambda a=a: torch.mm(a, w))
        say(f"M {m} cuBLAS (dequantized bf16 weight): {cublas * 1e3:.1f} us {flops / cublas / 1e9:.0f} TFLOP/s")
        results = []

        def measure(label, call, m=m, want=want, scale=scale, flops=flops, cublas=cublas, results=results):
            try:
                err = (call().float() - want).abs().max().item() / scale
                ms = triton.testing.do_bench_cudagraph(call)
            except Exception as e:  # a configuration that does not compile (shared memory, registers)
                say(f"M {m} {label}: {type(e).__name__}: {str(e)[:120]}")
                return
            results.append((ms, label))
            say(f"M {m} {label}: {ms * 1e3:.1f} us {weight_bytes / ms / 1e6:.0f} GB/s {flops / ms / 1e9:.0f} "
                f"TFLOP/s {cublas / ms:.2f}x cuBLAS err {err:.2g}")  # fmt: skip

        for b in decode_candidates(m) if m <= 64 else prefill_candidates():

            def pick(m_, n_, k_, group_size, dtype, target, _b=b):
                split = _b.split_k or default(m_, n_, k_, group_size, dtype, target).split_k
                return dataclasses.replace(_b, split_k=split)

            chosen = pick(m, N, K, GROUP, "bfloat16", _runtime.target(a.device))
            core.blocks = pick
            _runtime._cached_executor.cache_clear()
            measure(str(chosen), lambda a=a: tk.dequant_matmul(a, qweight, scales, GROUP))
        if m > 64 and cuda_arch(a.device) in dequant_matmul_tilelang.ARCHS:
            for config, tiles in dequant_matmul_tilelang.CONFIGS.items():
                plan = core.compiled_forward("tilelang", m, N, K, dtype="bfloat16", group_size=GROUP, has_zeros=False,
                                             arch=cuda_arch(a.device), target=_runtime.target(a.device),
                                             tile_config=config)  # fmt: skip
                run = _runtime.Executor(plan)
                measure(f"tilelang {config} {tiles}", lambda a=a, run=run: run(a, qweight, scales, device=a.device)[0])
        core.blocks = default
        _runtime._cached_executor.cache_clear()
        ms = triton.testing.do_bench_cudagraph(lambda a=a: tk.dequant_matmul(a, qweight, scales, GROUP))
        say(f"M {m} DEFAULT {default(m, N, K, GROUP, 'bfloat16', _runtime.target(a.device))}: {ms * 1e3:.1f} us "
            f"{cublas / ms:.2f}x cuBLAS")  # fmt: skip
        ms, best = min(results)
        say(f"BEST M {m}: {best} {ms * 1e3:.1f} us {cublas / ms:.2f}x cuBLAS")
    say.save()


if __name__ == "__main__":
    main()
