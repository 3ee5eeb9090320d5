"""The streamed cross-entropy forward that fused_linear_cross_entropy runs on each chunk of logits (rows wider than
rows.MAX_ROW_BLOCK, the gradient for a unit cotangent written over the logits in place), timed on this machine's GPU
over its launch parameters: programs (the grid; a program loops over rows), the streamed chunk (BLOCK_V) and warps.
A program's row is read twice (the online max / sum, then the gradient pass): with few rows in flight the second
read can come from L2. Each line: device time (triton.testing.do_bench), % of the measured copy bandwidth for one
read and one write of the logits, and whether its lse and gradient match the default launch's; the default is
marked *; Liger-Kernel's forward last, where installed. Llama-3's vocabulary by default:

    python benchmarks/sweep_ce_wide.py [--rows 1024] [--classes 128256]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton.testing

from tile_kernels.core import cross_entropy
from tile_kernels.core.plan import BufferSpec, Plan
from tile_kernels.torch._runtime import Executor, target
from tile_kernels.torch.bench import _copy_gbs


def plan_with(rows: int, classes: int, tgt, programs=None, block=None, warps=None, online=None) -> Plan:
    """The forward launch as fused_linear_cross_entropy builds it (gradient in place), with the parameters replaced
    (`online`: the kernel's BLOCK_ONLINE, a running max / sum for the row instead of one a lane)."""
    launch = cross_entropy.forward_launch(1, rows, classes, logits="logits", labels="target", loss="loss", lse="lse",
                                          valid="valid", dlogits="logits", ignore_index=-100, label_smoothing=0.0,
                                          target=tgt)  # fmt: skip
    if programs is not None:
        launch = dataclasses.replace(launch, grid=(programs, 1))
    if block is not None:
        launch = dataclasses.replace(launch, constexprs={**launch.constexprs, "BLOCK_V": block})
    if warps is not None:
        launch = dataclasses.replace(launch, num_warps=warps)
    if online is not None:
        launch = dataclasses.replace(launch, constexprs={**launch.constexprs, "BLOCK_ONLINE": online})
    buffers = {n: BufferSpec((1, rows), "float32") for n in ("loss", "lse", "valid")}
    return Plan({"logits": "bfloat16", "target": "int64"}, buffers, (launch,), ("lse", "logits"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--classes", type=int, default=128256)
    args = parser.parse_args()
    rows, classes = args.rows, args.classes
    device = torch.device("cuda", torch.cuda.current_device())
    tgt = target(device)
    copy_gbs = _copy_gbs(device)  # the bench's copy ceiling
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_gbs:.0f} GB/s; {rows} x {classes} bf16 logits, {tgt.num_sms} SMs", flush=True)  # fmt: skip
    logits = torch.randn(rows, classes, device=device, dtype=torch.bfloat16) * 3
    labels = torch.randint(0, classes, (rows,), device=device)
    default = plan_with(rows, classes, tgt)
    launch = default.launches[0]
    print(f"default: {launch.grid[0]} programs, BLOCK_V {launch.constexprs['BLOCK_V']}, {launch.num_warps} warps")
    want_lse, want_grad = Executor(default)(logits.clone(), labels, device=device)
    configs = [(None, None, None, None)]  # the default; a persistent grid of 8-16 warps gained nothing (2026-12-06)
    configs += [(rows, block, warps, False) for block in (8192, 16384) for warps in (16, 32)]
    configs += [
        (programs, block, warps, True)
        for programs in (tgt.num_sms, 2 * tgt.num_sms, rows)
        for block in (16384, 32768)
        for warps in (16, 32)
    ]
    for programs, block, warps, online in configs:
        run = Executor(plan_with(rows, classes, tgt, programs, block, warps, online))
        try:
            lse, grad = run(logits.clone(), labels, device=device)
            same = (
                max((lse - want_lse).abs().max().item(), (grad.float() - want_grad.float()).abs().max().item()) < 1e-3
            )
            work = logits.clone()  # overwritten by the gradient at the first call: the same bytes and exps after
            ms = triton.testing.do_bench(lambda run=run, work=work: run(work, labels, device=device))
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile or run is reported
            print(f"{programs} programs, BLOCK_V {block}, {warps} warps, online {online}: {type(e).__name__}: "
                  f"{str(e)[:120]}")  # fmt: skip
            continue
        pct = 100 * 2 * logits.numel() * 2 / ms / 1e6 / copy_gbs
        name = "default*" if programs is None else f"{programs} programs, BLOCK_V {block}, {warps} warps"
        name += " a row's running max" if online else ""
        print(f"{name}: {ms * 1e3:.1f} us {pct:.0f}% {'same' if same else 'DIFFERENT'}", flush=True)
    liger(logits, labels, copy_gbs)


def liger(logits, labels, copy_gbs: float) -> None:
    """Liger-Kernel's cross-entropy forward on the same logits in the same run: it too writes the gradient over the
    logits (a row a program, 32 warps on Hopper); its host syncs (two .item() a call) are in its time."""
    try:
        from liger_kernel.ops.cross_entropy import cross_entropy_forward
    except ImportError:
        print("liger: not installed")
        return
    work = logits.clone().requires_grad_()  # its kernel writes the gradient only for an input that wants one
    ms = triton.testing.do_bench(lambda: cross_entropy_forward(work, labels, None, -100, 0.0, 0.0, "mean", None, False))
    pct = 100 * 2 * logits.numel() * 2 / ms / 1e6 / copy_gbs
    print(f"liger (with its host syncs): {ms * 1e3:.1f} us {pct:.0f}%", flush=True)


if __name__ == "__main__":
    main()
