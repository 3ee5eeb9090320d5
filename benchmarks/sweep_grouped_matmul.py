"""Sweep of grouped_matmul's launch configuration (core.grouped_matmul.Blocks) on the current GPU: device time
(CUDA-graph replays, triton.testing.do_bench_cudagraph) of the forward and of forward + backward (dx and dW through
autograd) beside torch._grouped_mm in the same run, bf16, groups of equal size. Shapes (E, T, K, N): Mixtral's up
and down projections (8 experts, 8192 tokens x top-2); torch._grouped_mm stops the run with a device assert at 64
experts, DeepSeek-V2-Lite's shape (benchmarks/results/h200/notes.md). Each line: us and TFLOP/s of the forward and of
the step, their ratios to torch._grouped_mm; each Triton configuration with backend="triton", then DEFAULT:
backend=None (TileLang's kernels where preferred_backend picks them). On Hopper also the TileLang forward's
configurations (core.grouped_matmul_tilelang.CONFIGS; the step backend="tilelang"'s: forward and dx on the
configuration's tiles, dW Triton's).
With --kernels, each Triton configuration's line also gives the backward's two kernels (torch.profiler device time
of one backward: dx, the row kernel, and dW, the weight-gradient kernel) beside torch._grouped_mm's dx and dW
products timed alone, and on Hopper each TileLang configuration's line the same of backend="tilelang"'s backward
(dx on the TileLang row kernel).

    python benchmarks/sweep_grouped_matmul.py [--shape 8,16384,4096,14336 ...] [--kernels] [--tilelang] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton.testing
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import grouped_matmul as core
from tile_kernels.core import grouped_matmul_tilelang
from tile_kernels.torch import _runtime
from tile_kernels.torch._calls import cuda_arch, resolve_backend
from tile_kernels.torch.grouped_matmul import grouped_matmul_bwd, grouped_matmul_bwd_compiled

SHAPES = ((8, 16384, 4096, 14336), (8, 16384, 14336, 4096))
CANDIDATES = [core.Blocks(*c) for c in [(64, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3),
                                         (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 32, 4, 4),
                                         (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3, 8),
                                         (128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 16)]]  # fmt: skip


BACKWARD_KERNELS = {"grouped_rows_kernel": "dx", "grouped_weight_grad_kernel": "dW"}


def backward_kernels(backward) -> str:
    """'dx <us>, dW <us>': device time of the backward's kernels, the mean of 5 profiled calls of `backward`."""
    backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            backward()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name in BACKWARD_KERNELS:
            times.setdefault(BACKWARD_KERNELS[event.name], []).append(event.device_time)
    return ", ".join(f"{label} {sum(v) / len(v):.0f} us" for label, v in sorted(times.items(), reverse=True))


def sweep(e: int, t: int, k: int, n: int, say, kernels: bool = False, triton_candidates: bool = True) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(e, k, n, generator=g, device="cuda") / k**0.5).to(torch.bfloat16).requires_grad_()
    sizes = torch.full((e,), t // e, dtype=torch.int32, device="cuda")
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    dy = torch.randn(t, n, generator=g, device="cuda").to(torch.bfloat16)
    flops, name = 2 * t * k * n, f"E{e} T{t} K{k} N{n}"

    def step(f):
        x.grad = w.grad = None
        f().backward(dy)

    def peer():
        return torch._grouped_mm(x, w, offs=offs)

    def ours(backend):
        return tk.grouped_matmul(x, w, sizes, backend=backend)

    peer_fwd = triton.testing.do_bench_cudagraph(lambda: peer().detach())
    peer_step = triton.testing.do_bench(lambda: step(peer))
    say(f"{name} torch._grouped_mm: fwd {peer_fwd * 1e3:.0f} us {flops / peer_fwd / 1e9:.0f} TFLOP/s, step "
        f"{peer_step * 1e3:.0f} us {3 * flops / peer_step / 1e9:.0f} TFLOP/s")  # fmt: skip
    x0, w0 = x.detach(), w.detach()
    if kernels:
        peer_dx = triton.testing.do_bench_cudagraph(lambda: torch._grouped_mm(dy, w0.transpose(1, 2), offs=offs))
        peer_dw = triton.testing.do_bench_cudagraph(lambda: torch._grouped_mm(x0.t(), dy, offs=offs))
        say(f"{name} torch._grouped_mm backward products: dx {peer_dx * 1e3:.0f} us, dW {peer_dw * 1e3:.0f} us")

    def backward(backend):  # the backward that `ours(backend)` records (backend=None: the one it resolves to)
        backend = resolve_backend(core.NAME, backend, x.device, core.preferred_backend, "bfloat16", t, k, n, True)
        if backend == "triton":
            return functools.partial(grouped_matmul_bwd, dy, x0, w0, sizes)
        return functools.partial(grouped_matmul_bwd_compiled, dy, x0, w0, sizes, backend)

    default = core.blocks
    for b in [*CANDIDATES * triton_candidates, "DEFAULT"]:
        core.blocks = default if b == "DEFAULT" else (lambda *a, _b=b: _b)
        _runtime._cached_executor.cache_clear()
        try:
            run = functools.partial(ours, None if b == "DEFAULT" else "triton")  # DEFAULT: backend=None's choice
            fwd = triton.testing.do_bench_cudagraph(lambda: run().detach())  # noqa: B023 - called in this iteration
            st = triton.testing.do_bench(lambda: step(run))  # noqa: B023
            bwd = "; backward " + backward_kernels(backward(None if b == "DEFAULT" else "triton")) if kernels else ""
        except Exception as ex:  # a configuration that does not compile (shared memory, registers)
            say(f"{name} {b}: {type(ex).__name__}: {str(ex)[:120]}")
            continue
        finally:
            core.blocks = default
        say(f"{name} {b}: fwd {fwd * 1e3:.0f} us {flops / fwd / 1e9:.0f} TFLOP/s {peer_fwd / fwd:.2f}x, step "
            f"{st * 1e3:.0f} us {3 * flops / st / 1e9:.0f} TFLOP/s {peer_step / st:.2f}x{bwd}")  # fmt: skip
    _runtime._cached_executor.cache_clear()
    if cuda_arch(x.device) not in grouped_matmul_tilelang.ARCHS:
        return
    compiled_forward, compiled_backward = core.compiled_forward, core.compiled_backward
    tilelang = functools.partial(ours, "tilelang")
    for config, tiles in grouped_matmul_tilelang.CONFIGS.items():
        core.compiled_forward = lambda *a, _c=config, **kw: compiled_forward(*a, **kw, tile_config=_c)
        core.compiled_backward = lambda *a, _c=config, **kw: compiled_backward(*a, **kw, tile_config=_c)
        try:
            fwd = triton.testing.do_bench_cudagraph(lambda: tilelang().detach())
            st = triton.testing.do_bench(lambda: step(tilelang))
            bwd = "; backward " + backward_kernels(backward("tilelang")) if kernels else ""
        except Exception as ex:  # a configuration that does not build (shared memory, registers)
            say(f"{name} tilelang {config}: {type(ex).__name__}: {str(ex)[:120]}")
            continue
        finally:
            core.compiled_forward, core.compiled_backward = compiled_forward, compiled_backward
        say(
            f"{name} tilelang {config} {tiles}: fwd {fwd * 1e3:.0f} us {flops / fwd / 1e9:.0f} TFLOP/s "
            f"{peer_fwd / fwd:.2f}x, step {st * 1e3:.0f} us {3 * flops / st / 1e9:.0f} TFLOP/s "
            f"{peer_step / st:.2f}x{bwd}"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="E,T,K,N (repeatable; default: SHAPES)")
    parser.add_argument("--kernels", action="store_true", help="also the backward's dx and dW kernels, and torch's")
    parser.add_argument("--tilelang", action="store_true", help="the TileLang configurations only (and the default)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split(",")) for s in args.shape] if args.shape else SHAPES
    say = SweepLog(args.out)

    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape in shapes:
        sweep(*shape, say, args.kernels, triton_candidates=not args.tilelang)
    say.save()


if __name__ == "__main__":
    main()
