"""num_warps of the row kernels (softmax forward and backward, cross_entropy forward, rms_norm backward), timed on this
machine's GPU at 2^26 elements over a sweep of row widths, beside Liger-Kernel's softmax where it is installed. Each
line: device time (triton.testing.do_bench), % of the measured copy bandwidth (algorithmic bytes: each input read
once, each output written once); the warps the op's plan picks are marked *. The in-register rms_norm backward also
with one and with two rows' loads in flight (its kernel's ROWS_AHEAD; norms.BACKWARD_ROWS_AHEAD is the default).

    python benchmarks/sweep_row_warps.py
"""

from __future__ import annotations

import dataclasses

import torch
import triton.testing

from tile_kernels.core import cross_entropy, norms, softmax
from tile_kernels.torch._runtime import Executor, target
from tile_kernels.torch.bench import _copy_gbs

WIDTHS = (256, 1024, 2048, 4096, 8192, 16384)
WARPS = (1, 2, 4, 8, 16, 32)


def with_first(plan, **changes):
    """The plan with its first launch (the row kernel) replaced by `changes` (Launch fields; constexprs merged)."""
    first, *rest = plan.launches
    if "constexprs" in changes:
        changes["constexprs"] = {**first.constexprs, **changes["constexprs"]}
    return dataclasses.replace(plan, launches=(dataclasses.replace(first, **changes), *rest))


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    tgt = target(device)
    copy_gbs = _copy_gbs(device)  # the bench's copy ceiling
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_gbs:.0f} GB/s", flush=True)  # fmt: skip
    try:
        from liger_kernel.transformers.functional import liger_softmax
    except ImportError:
        liger_softmax = None
    for n in WIDTHS:
        m = 2**26 // n
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        weight, rstd = torch.randn(n, device=device, dtype=torch.bfloat16), torch.rand(m, device=device) + 0.5
        labels = torch.randint(0, n, (m,), device=device)
        cases = {
            "softmax fwd": (softmax.forward(m, n, dtype="bfloat16", target=tgt), (x,), 2),
            "softmax bwd": (softmax.backward(m, n, dtype="bfloat16", target=tgt), (x, dy), 3),
            "cross_entropy fwd": (
                cross_entropy.forward(1, m, n, dtype="bfloat16", target_dtype="int64", reduction="mean",
                                      ignore_index=-100, label_smoothing=0.0, target=tgt, stride_row=n),
                (x, labels), 1,
            ),
            # the persistent backward (norms.BACKWARD_BYTES_PER_THREAD: 8 warps at 4096 wide; 16 warps: 104 registers)
            "rms_norm bwd": (
                norms.backward(1, m, n, is_rms=True, x_dtype="bfloat16", weight_dtype="bfloat16", has_bias=False,
                               has_dh=False, target=tgt),
                (dy, x, weight, rstd), 3,
            ),
        }  # fmt: skip
        if n <= norms.BACKWARD_MAX_ROW_BLOCK:  # the in-register backward: one or two rows' loads in flight
            for has_dh in (False, True):
                plan = norms.backward(1, m, n, is_rms=True, x_dtype="bfloat16", weight_dtype="bfloat16",
                                      has_bias=False, has_dh=has_dh, target=tgt)  # fmt: skip
                inputs = (dy, x, weight, rstd) + ((dy,) if has_dh else ())
                for ahead in (1, 2):
                    label = f"rms_norm bwd{' + dh' if has_dh else ''}, {ahead} row(s) ahead"
                    cases[label] = (with_first(plan, constexprs={"ROWS_AHEAD": ahead}), inputs, 4 if has_dh else 3)
        for name, (plan, inputs, passes) in cases.items():
            line, default = [], plan.launches[0].num_warps
            for warps in WARPS:
                run = Executor(with_first(plan, num_warps=warps))
                ms = triton.testing.do_bench(lambda run=run, inputs=inputs: run(*inputs, device=device))
                pct = 100 * passes * x.numel() * 2 / ms / 1e6 / copy_gbs
                line.append(f"{warps}{'*' if warps == default else ''}: {ms * 1e3:.1f} us {pct:.0f}%")
            print(f"{m}x{n} {name}: " + ", ".join(line), flush=True)
        if liger_softmax is not None:
            ms = triton.testing.do_bench(lambda x=x: liger_softmax(x))
            print(f"{m}x{n} liger softmax fwd: {ms * 1e3:.1f} us {100 * 4 * x.numel() / ms / 1e6 / copy_gbs:.0f}%")


if __name__ == "__main__":
    main()
