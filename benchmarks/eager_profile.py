"""Where an eager call's host time goes: wall time per call of back-to-back calls (forward, forward + backward) of
tile-kernels' rms_norm and softmax beside torch's, the pieces of a call (plan lookup, plan run, bound launch, Triton's
own launch path), a trivial Python autograd.Function against the native op, and a torch.profiler trace (CPU and
CUDA) of rms_norm's eager forward + backward at 16384x4096, written to --out as a Chrome trace.

    python benchmarks/eager_profile.py --out /tmp/profile       # on a GPU machine
    python benchmarks/eager_profile.py --compiled                # the TVM-FFI (TileLang) path beside Triton's
    python benchmarks/eager_profile.py --split                   # whose launches cost with autograd's threads on
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.nn.functional as F

import tile_kernels.torch as tk
from tile_kernels.core import norms
from tile_kernels.torch import _runtime
from tile_kernels.torch.norms import _forward
from tile_kernels.torch.norms import _rms_bwd as rms_norm_backward_body
from tile_kernels.torch.norms import _rms_fwd as rms_norm_body


def wall_us(fn, calls: int = 1000, host_only: bool = False) -> float:
    """Best of three rounds of `calls` back-to-back calls, per call; host_only: the time to issue them (the rounds do
    not wait for the device inside the timed span)."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        if not host_only:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    torch.cuda.synchronize()
    return best


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _KernelForward(torch.autograd.Function):
    """rms_norm's forward body, a backward of torch ops: what the backward kernels cost beside autograd's own."""

    @staticmethod
    def forward(ctx, x, w):
        y, _, rstd = rms_norm_body(x, w, None, 1e-6)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, _ = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class _KernelBackward(torch.autograd.Function):
    """A forward of torch ops, rms_norm's backward body."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = torch.ones(x.shape[:-1], device=x.device)
        ctx.save_for_backward(x, w, rstd)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        return rms_norm_backward_body(g, x, w, rstd, None)


def autograd_rows(x, w, ct) -> None:
    """Where a forward + backward's host time goes beside the forward's: autograd's device thread (multithreading
    off runs the backward on the calling thread), a kernel forward or a kernel backward alone in a Python
    autograd.Function, and a cProfile of the steps on one thread."""

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dh = torch.randn_like(x)
    step = lambda: torch.autograd.grad(tk.rms_norm(xg, wg), [xg, wg], ct)  # noqa: E731
    fwd = tk.rms_norm(xg, wg)
    rstd = torch.ones(x.shape[0], device=x.device)
    rows = {
        "tk.rms_norm fwd (grad graph)": lambda: tk.rms_norm(xg, wg),
        "tk.rms_norm fwd+bwd": step,
        "tk.rms_norm fwd+bwd .backward()": lambda: tk.rms_norm(xg, wg).backward(ct),
        "backward body (rms_norm_bwd)": lambda: rms_norm_backward_body(ct, x, w, rstd, None),
        "backward body + residual grad": lambda: rms_norm_backward_body(ct, x, w, rstd, dh),
        "Function: kernel fwd, torch bwd": lambda: torch.autograd.grad(_KernelForward.apply(xg, wg), [xg, wg], ct),
        "Function: torch fwd, kernel bwd": lambda: torch.autograd.grad(_KernelBackward.apply(xg, wg), [xg, wg], ct),
    }
    import sys
    import threading

    print("python threads:", [t.name for t in threading.enumerate()], "switch interval", sys.getswitchinterval())
    for threads in (True, False):
        with torch.autograd.set_multithreading_enabled(threads):
            for name, fn in rows.items():
                print(f"{name:34s} {wall_us(fn):8.1f} us  (autograd threads {'on' if threads else 'off'})", flush=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    print(f"{'tk.rms_norm fwd+bwd, switch 10 us':34s} {wall_us(step):8.1f} us", flush=True)
    sys.setswitchinterval(interval)
    del fwd
    with torch.autograd.set_multithreading_enabled(False):
        print_profile(step, 500, 30)


def print_profile(fn, calls: int, top: int) -> None:
    """A cProfile of `calls` calls of fn (then a device synchronization): the `top` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def wake_rows(x, ct) -> None:
    """Is autograd's device thread slow to wake? A forward + backward of x*2 (native and as a Python Function) after
    the calling thread has busied itself for S us, with autograd's device threads on and off: the time beyond S."""
    xg = x.clone().requires_grad_()
    for s in (0, 25, 50, 100, 200, 400, 800):
        cells = []
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                for name, fn in (("native", lambda: xg * 2), ("Function", lambda: _Double.apply(xg))):
                    us = wall_us(lambda s=s, fn=fn: (spin(s), torch.autograd.grad(fn(), [xg], ct)), calls=300) - s
                    cells.append(f"{name} threads {'on ' if threads else 'off'} {us:7.1f}")
        print(f"spin {s:4d} us: " + " | ".join(cells), flush=True)


def threads_on_off(fn, calls: int = 500) -> str:
    """wall_us of fn with autograd's device threads on, then off, as one line's cells."""
    cells = []
    for threads in (True, False):
        with torch.autograd.set_multithreading_enabled(threads):
            cells.append(f"threads {'on ' if threads else 'off'} {wall_us(fn, calls=calls):7.1f} us")
    return " | ".join(cells)


def launch_rows(x, ct) -> None:
    """Which part of a forward makes autograd's device-thread hand-off dear: x*2 as a Python Function whose forward
    also runs (a) a torch kernel, (b) a Triton kernel through Triton's launch, (c) the same through its bound
    launcher, (d) only reads the current device and stream; threads on and off."""
    import triton
    import triton.language as tl

    @triton.jit
    def touch(ptr):
        tl.store(ptr, tl.load(ptr) + 1.0)

    scratch = torch.zeros(16, device=x.device)
    compiled = touch[(1,)](scratch)
    stream = _runtime._stream(x.device.index)

    def bound():
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, scratch)

    extras = {
        "nothing": lambda: None,
        "torch kernel (add_)": lambda: scratch.add_(1.0),
        "triton kernel[grid]": lambda: touch[(1,)](scratch),
        "triton bound launch": bound,
        "current device + stream": lambda: (torch.cuda.current_device(), _runtime._stream(x.device.index)),
    }
    xg = x.clone().requires_grad_()
    for name, extra in extras.items():

        class Extra(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, extra=extra):
                extra()
                return a * 2

            @staticmethod
            def backward(ctx, g):
                return g * 2

        print(f"forward + {name:26s}: " + threads_on_off(lambda: torch.autograd.grad(Extra.apply(xg), [xg], ct)),
              flush=True)  # fmt: skip


def split_rows(x, w, ct) -> None:
    """Which thread's launches make a tk.rms_norm forward + backward dear with autograd's device threads on: the
    step with the launches of the calling thread (the forward's), of the other threads (the backward's), or of both
    skipped (results wrong, host work unchanged up to the driver call), the step with a 1 us GIL switch interval and
    with the garbage collector off, and the backward alone (retained graph)."""
    import gc
    import sys
    import threading

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    step = lambda: torch.autograd.grad(tk.rms_norm(xg, wg), [xg, wg], ct)  # noqa: E731
    main_thread, real_run = threading.get_ident(), _runtime._LaunchStep.run
    skip = {"forward": False, "backward": False}

    def run(self, tensors, addresses, device):
        if not skip["forward" if threading.get_ident() == main_thread else "backward"]:
            real_run(self, tensors, addresses, device)

    _runtime._LaunchStep.run = run
    try:
        for skipped in ((), ("backward",), ("forward",), ("forward", "backward")):
            skip.update({k: k in skipped for k in skip})
            name = "all launches" if not skipped else f"no {' / '.join(skipped)} launches"
            print(f"tk.rms_norm fwd+bwd, {name:34s}: " + threads_on_off(step), flush=True)
        skip.update(forward=False, backward=False)
        interval = sys.getswitchinterval()
        for name, before, after in (
            ("GIL switch interval 1 us", lambda: sys.setswitchinterval(1e-6), lambda: sys.setswitchinterval(interval)),
            ("gc disabled", gc.disable, gc.enable),
        ):
            before()
            try:
                print(f"tk.rms_norm fwd+bwd, {name:34s}: threads on    {wall_us(step, calls=500):7.1f} us", flush=True)
            finally:
                after()
        for name, out in (("tk.rms_norm", tk.rms_norm(xg, wg)), ("F.rms_norm", F.rms_norm(xg, (256,), wg, 1e-6))):
            fn = functools.partial(torch.autograd.grad, out, [xg, wg], ct, retain_graph=True)
            print(f"{name} backward alone (retained graph){'':9s}: " + threads_on_off(fn), flush=True)
    finally:
        _runtime._LaunchStep.run = real_run


def compiled_rows(dev) -> None:
    """The TVM-FFI path (TileLang kernels) beside Triton's: flash_attention's wall and host time a call by backend, the
    raw TVM-FFI forward call, and a cProfile of TileLang forward + backward steps."""
    for shape in ((1, 128, 4, 2, 64), (4, 2048, 32, 8, 64)):
        step = _compiled_shape(dev, *shape)
    print_profile(step, 100, 25)


def _compiled_shape(dev, b, s, hq, hk, d):
    """compiled_rows' lines for one (batch, seq, query heads, key/value heads, head dim); returns the TileLang step."""
    from tile_kernels.core import flash_attention as fa_core
    from tile_kernels.torch._calls import cuda_arch

    q = torch.randn(b, s, hq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    host = functools.partial(wall_us, calls=100, host_only=True)

    def fwd(backend):
        return tk.flash_attention(q, k, v, causal=True, backend=backend)

    def step(backend):
        return torch.autograd.grad(fwd(backend), [q, k, v], dout)

    for backend in ("triton", "tilelang"):
        calls = (("fwd", functools.partial(fwd, backend)), ("fwd+bwd", functools.partial(step, backend)))
        cells = [f"{name} wall {wall_us(fn, 200):8.1f} host {host(fn):8.1f}" for name, fn in calls]
        print(f"flash_attention {(b, s, hq, hk, d)} {backend:8s}: " + " | ".join(cells) + " us", flush=True)
    run = _runtime.executor(fa_core.compiled_forward, "tilelang", b, s, s, hq, hk, d, dtype="bfloat16", causal=True,
                            window=(-1, -1), scale=None, softcap=0.0, arch=cuda_arch(dev))  # fmt: skip
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = run(qd, kd, vd, device=dev)
    call = run.steps[0]
    args = (qd, kd, vd, out, lse, *call.attrs)
    executor_run = functools.partial(run, qd, kd, vd, device=dev)
    print(f"  executor run (tilelang fwd) wall {wall_us(executor_run, 200):8.1f} host {host(executor_run):8.1f} us; "
          f"raw TVM-FFI call host {host(lambda: call.function(*args)):8.1f} us", flush=True)  # fmt: skip
    return functools.partial(step, "tilelang")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for the profiler trace (eager_step_trace.json)")
    p.add_argument("--wake", action="store_true", help="only the device-thread wake-up rows")
    p.add_argument("--launch", action="store_true", help="only the rows of what a forward launches")
    p.add_argument("--compiled", action="store_true", help="only the TVM-FFI (TileLang) rows")
    p.add_argument("--split", action="store_true", help="only the rows of which thread's launches cost")
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, device=dev, dtype=torch.bfloat16)
    xg, wg, ct = x.clone().requires_grad_(), w.clone().requires_grad_(), torch.randn_like(x)
    if args.wake:
        return wake_rows(x, ct)
    if args.launch:
        return launch_rows(x, ct)
    if args.compiled:
        return compiled_rows(dev)
    if args.split:
        return split_rows(x, w, ct)
    run = _runtime.executor(
        norms.forward, 1, 4, 256, is_rms=True, x_dtype="bfloat16", weight_dtype="bfloat16", has_residual=False,
        has_bias=False, eps=1e-6, target=_runtime.target(dev), stride_x=256, stride_residual=None,
    )  # fmt: skip
    run(x, w, device=dev)
    step = run.steps[0]
    tensors = [x, w, torch.empty_like(x), torch.empty(4, device=dev)]
    addresses = [t.data_ptr() for t in tensors] + run.constants  # the Executor's lists
    launch_args, launch_addresses = step.arguments(tensors + run.constants), step.arguments(addresses)
    bound, function, metadata = next(iter(step.bound.values()))
    stream = _runtime._stream(dev.index)
    rows = {
        "tk.rms_norm fwd": lambda: tk.rms_norm(x, w),
        "F.rms_norm fwd": lambda: F.rms_norm(x, (256,), w, 1e-6),
        "tk.rms_norm fwd+bwd": lambda: torch.autograd.grad(tk.rms_norm(xg, wg), [xg, wg], ct),
        "F.rms_norm fwd+bwd": lambda: torch.autograd.grad(F.rms_norm(xg, (256,), wg, 1e-6), [xg, wg], ct),
        "tk.softmax fwd": lambda: tk.softmax(x),
        "F.softmax fwd": lambda: F.softmax(x, -1),
        "tk.softmax fwd+bwd": lambda: torch.autograd.grad(tk.softmax(xg), [xg], ct),
        "F.softmax fwd+bwd": lambda: torch.autograd.grad(F.softmax(xg, -1), [xg], ct),
        "autograd.Function x*2 fwd+bwd": lambda: torch.autograd.grad(_Double.apply(xg), [xg], ct),
        "native x*2 fwd+bwd": lambda: torch.autograd.grad(xg * 2, [xg], ct),
        "rms_norm body (_forward)": lambda: _forward(x, w, None, None, 1e-6, True),
        "plan lookup (executor)": lambda: _runtime.executor(
            norms.forward,
            1,
            4,
            256,
            is_rms=True,
            x_dtype="bfloat16",
            weight_dtype="bfloat16",
            has_residual=False,
            has_bias=False,
            eps=1e-6,
            target=_runtime.target(dev),
            stride_x=256,
            stride_residual=None,
        ),  # fmt: skip
        "plan run (Executor)": lambda: run(x, w, device=dev),
        "bound launch, tensors": lambda: bound(
            *step.grid, stream, function, metadata, None, None, None, *launch_args, *step.constexprs
        ),  # fmt: skip
        "bound launch, addresses (as run)": lambda: bound(
            *step.grid, stream, function, metadata, None, None, None, *launch_addresses, *step.constexprs
        ),  # fmt: skip
        "Triton's launch (kernel[grid])": lambda: step.launch.kernel[step.grid](*launch_args, **step.options),
        "torch.empty": lambda: torch.empty((4, 256), dtype=torch.bfloat16, device=dev),
    }
    for name, fn in rows.items():
        print(f"{name:34s} {wall_us(fn):8.1f} us", flush=True)
    autograd_rows(x, w, ct)

    if args.out:
        from torch.profiler import ProfilerActivity, profile

        big = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.ones(4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        residual, grad = torch.randn_like(big), torch.randn_like(big)
        for _ in range(5):
            torch.autograd.grad(tk.rms_norm(big, weight, residual=residual), [big, weight], [grad, grad])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.autograd.grad(tk.rms_norm(big, weight, residual=residual), [big, weight], [grad, grad])
            torch.cuda.synchronize()
        os.makedirs(args.out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out, "eager_step_trace.json"))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
