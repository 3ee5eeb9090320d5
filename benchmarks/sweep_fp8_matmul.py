"""fp8_matmul's kernels on the current GPU: device time (CUDA-graph replays, triton.testing.do_bench_cudagraph) of the
Triton kernel (its default tiles) and of each configuration of the TileLang Hopper kernel
(core.fp8_matmul_tilelang.CONFIGS), beside torch._scaled_mm with the same block scales and with per-tensor scales
(cuBLAS's FP8 GEMM: the ceiling the fine scaling should cost nothing against), in the same run. e4m3 operands from
fp8_quantize (a: 1 x 128 blocks, b: 128 x 128), bf16 output. Shapes (M, K, N): 8192^3, Llama-3-8B's MLP up and down
projections over 4096 tokens, and DeepSeek-V3's 7168-wide projection at 16 rows. Each line: us, TFLOP/s, the ratio to
per-tensor _scaled_mm, and the max |difference| to the Triton kernel's output relative to its largest entry.

    python benchmarks/sweep_fp8_matmul.py [--shape 8192,8192,8192 ...] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import fp8_matmul as core
from tile_kernels.core import fp8_matmul_tilelang
from tile_kernels.torch import _runtime
from tile_kernels.torch._calls import cuda_arch
from tile_kernels.torch.bench import _scaled_mm

SHAPES = ((8192, 8192, 8192), (4096, 4096, 14336), (4096, 14336, 4096), (16, 7168, 2048))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="M,K,N (repeatable; default: SHAPES)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split(",")) for s in args.shape] if args.shape else SHAPES
    say = SweepLog(args.out)

    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    g = torch.Generator("cuda").manual_seed(0)
    arch = cuda_arch(torch.device("cuda", torch.cuda.current_device()))
    for m, k, n in shapes:
        a, a_scales = tk.fp8_quantize(torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16))
        b, b_scales = tk.fp8_quantize(torch.randn(n, k, generator=g, device="cuda").to(torch.bfloat16), block_rows=128)
        operands = (a, a_scales, b, b_scales)
        flops, name = 2 * m * n * k, f"{m}x{k}x{n}"
        want = tk.fp8_matmul(*operands).float()
        scale = want.abs().max().item()
        ceiling = triton.testing.do_bench_cudagraph(lambda ops=operands: _scaled_mm(False)(*ops))
        say(f"{name} _scaled_mm per-tensor: {ceiling * 1e3:.1f} us {flops / ceiling / 1e9:.0f} TFLOP/s")
        calls = {"_scaled_mm block scales": lambda ops=operands: _scaled_mm(True)(*ops),
                 "triton (default tiles)": lambda ops=operands: tk.fp8_matmul(*ops, backend="triton")}  # fmt: skip
        if arch in fp8_matmul_tilelang.ARCHS:
            for config, tiles in fp8_matmul_tilelang.CONFIGS.items():
                plan = core.compiled_forward("tilelang", m, n, k, out_dtype="bfloat16", arch=arch,
                                             target=_runtime.target(a.device), tile_config=config)  # fmt: skip
                run = _runtime.Executor(plan)
                calls[f"tilelang {config} {tiles}"] = lambda run=run, ops=operands: run(*ops, device=ops[0].device)[0]
        for label, call in calls.items():
            try:
                err = (call().float() - want).abs().max().item() / scale
                ms = triton.testing.do_bench_cudagraph(call)
            except Exception as e:  # a configuration that does not build (shared memory, registers)
                say(f"{name} {label}: {type(e).__name__}: {str(e)[:120]}")
                continue
            say(f"{name} {label}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s {ceiling / ms:.2f}x per-tensor "
                f"err {err:.2g}")  # fmt: skip
    say.save()


if __name__ == "__main__":
    main()
