"""Sweep of matmul's launch configuration (core.matmul.Blocks) on the current GPU: device time of the torch op
(CUDA-graph replays, triton.testing.do_bench_cudagraph) beside cuBLAS (torch.mm on the same operands) in the same
run, bf16, b = W.t() of a Linear weight W (N, K) as a model calls it. Shapes (M, K, N): 8192^3, Llama-3-8B's MLP up and
down projections over 4096 tokens, and the up projection at 16 and 64 rows. Each line: us, TFLOP/s, the ratio to
cuBLAS, and the max |difference| to cuBLAS's result relative to its largest entry. The default and the best per shape
last.

With --backend tilelang, the configurations of the TileLang Hopper kernel (core.matmul_tilelang.CONFIGS) instead.
With --epilogue, every call computes gelu(a @ W.t() + bias) + residual, and the peer is cuBLAS's addmm followed by
torch's gelu and add.

    python benchmarks/sweep_matmul.py [--shape 8192,8192,8192 ...] [--backend triton|tilelang] [--epilogue] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import matmul as core
from tile_kernels.core import matmul_tilelang
from tile_kernels.torch import _runtime
from tile_kernels.torch._calls import cuda_arch

SHAPES = ((8192, 8192, 8192), (4096, 4096, 14336), (4096, 14336, 4096), (16, 4096, 14336), (64, 4096, 14336))


def candidates(m: int):
    if m <= 64:
        for bm, bn, bk, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256), (3, 4, 5)):
            if bm <= max(16, m):
                yield core.Blocks(bm, bn, bk, 4, stages)
        return
    for bm, bn, bk, warps, stages in [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                                      (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
                                      (64, 256, 64, 4, 4), (128, 64, 64, 4, 4)]:  # fmt: skip
        yield core.Blocks(bm, bn, bk, warps, stages)


def triton_calls(a, w, m: int, epilogue: dict):
    """(label, call) of each Triton tile configuration: tk.matmul with core.blocks patched while the caller times it
    (the generator resumes, and patches the next, after)."""
    for b in candidates(m):
        core.blocks = lambda *args, _b=b, **kwargs: _b
        _runtime._cached_executor.cache_clear()
        yield str(b), lambda: tk.matmul(a, w.t(), **epilogue)


def tilelang_calls(a, w, epilogue: dict):
    """(label, call) of each TileLang configuration: its compiled plan run directly (b = w.t(), column-major)."""
    (m, k), n = a.shape, w.shape[0]
    flags = dict(activation=epilogue.get("activation"), has_bias="bias" in epilogue,
                 has_residual="residual" in epilogue)  # fmt: skip
    operands = [epilogue[name] for name in ("bias", "residual") if name in epilogue]
    for config in matmul_tilelang.CONFIGS:
        plan = core.compiled_forward("tilelang", m, n, k, dtype="bfloat16", b_col=True, arch=cuda_arch(a.device),
                                     target=_runtime.target(a.device), tile_config=config, **flags)  # fmt: skip
        run = _runtime.Executor(plan)
        label = f"tilelang {config} {matmul_tilelang.CONFIGS[config]}"
        yield label, lambda run=run: run(a, w, *operands, device=a.device)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="M,K,N (repeatable; default: SHAPES)")
    parser.add_argument("--backend", choices=("triton", "tilelang"), default="triton")
    parser.add_argument("--epilogue", action="store_true", help="bias, gelu and a residual on every call")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split(",")) for s in args.shape] if args.shape else SHAPES
    say = SweepLog(args.out)

    default = core.blocks
    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    g = torch.Generator("cuda").manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
        epilogue = {}
        if args.epilogue:
            epilogue = dict(bias=torch.randn(n, generator=g, device="cuda").to(torch.bfloat16), activation="gelu",
                            residual=torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16))  # fmt: skip

        def peer(a=a, w=w, e=epilogue):
            if not e:
                return a @ w.t()
            return torch.nn.functional.gelu(torch.addmm(e["bias"], a, w.t())) + e["residual"]

        want = peer()
        scale = want.abs().max().item()
        flops = 2 * m * n * k
        cublas = triton.testing.do_bench_cudagraph(peer)
        say(f"{m}x{k}x{n} cuBLAS{' + torch epilogue' if epilogue else ''}: {cublas * 1e3:.1f} us "
            f"{flops / cublas / 1e9:.0f} TFLOP/s")  # fmt: skip
        results = []
        calls = tilelang_calls(a, w, epilogue) if args.backend == "tilelang" else triton_calls(a, w, m, epilogue)
        for label, call in calls:
            try:
                err = (call().float() - want.float()).abs().max().item() / scale
                ms = triton.testing.do_bench_cudagraph(call)
            except Exception as e:  # a configuration that does not compile (shared memory, registers)
                say(f"{m}x{k}x{n} {label}: {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((ms, label))
            say(f"{m}x{k}x{n} {label}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s {cublas / ms:.2f}x cuBLAS "
                f"err {err:.2g}")  # fmt: skip
        core.blocks = default
        _runtime._cached_executor.cache_clear()
        ms = triton.testing.do_bench_cudagraph(lambda a=a, w=w, e=epilogue: tk.matmul(a, w.t(), **e))
        chosen = core.preferred_backend(cuda_arch(a.device), "bfloat16", m, k, n)
        if chosen == "triton":
            chosen = default(m, n, k, "bfloat16", _runtime.target(a.device), epilogue=bool(epilogue))
        say(f"{m}x{k}x{n} DEFAULT {chosen}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s {cublas / ms:.2f}x cuBLAS")
        if results:
            ms, best = min(results)
            say(f"BEST {m}x{k}x{n}: {best} {ms * 1e3:.1f} us {cublas / ms:.2f}x cuBLAS")
    say.save()


if __name__ == "__main__":
    main()
