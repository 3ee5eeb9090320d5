"""Block configurations of flash_attention's Triton kernels for head dim 128, timed on this machine's GPU: forward,
then the dK/dV kernel's candidates (with the dQ kernel fixed), then the dQ kernel's (with the best dK/dV), causal and
not. Each line: TFLOP/s (the backward counted as 2.5x the forward's flops) and the max |difference| of the outputs to
the first candidate's, so that a candidate that computes something else shows. The best become the first entries of
flash_attention._FWD / _BWD (the defaults).

    python benchmarks/sweep_flash_attention.py             # bf16, B 4, S 8192, 32 heads (as the bench)
    TRITON_INTERPRET=1 python benchmarks/sweep_flash_attention.py --small    # a dry run on the CPU
"""

from __future__ import annotations

import functools
import sys

import torch
import triton.testing

from tile_kernels.core import flash_attention as core
from tile_kernels.torch._runtime import run_plan, target

FWD = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 4, 2),
       (64, 128, 4, 3), (256, 64, 8, 2)]  # fmt: skip
DKDV = [(32, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 3),
        (64, 64, 4, 3), (32, 128, 4, 5)]  # fmt: skip
DQ = [(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)]


def main(small: bool) -> None:
    batch, seq, heads, dim = (1, 96, 2, 128) if small else (4, 8192, 32, 128)
    device = torch.device("cpu" if small else "cuda")
    bench = (lambda fn, **_: (fn(), 1.0)[1]) if small else triton.testing.do_bench
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16) for _ in range(4))
    sizes = (batch, seq, seq, heads, heads, dim)

    def tflops(ms: float, causal: bool, passes: float) -> float:
        return passes * 4 * batch * heads * seq * seq * dim / (2 if causal else 1) / ms / 1e9

    def report(what: str, build, inputs, ref, passes: float, causal: bool):
        """Builds the plan of the current configuration, runs and times it: (ms, outputs, reference)."""
        try:
            plan = build()
            outs = run_plan(plan, *inputs, device=device)
            ms = bench(lambda: run_plan(plan, *inputs, device=device), warmup=5, rep=30)
            ref = outs if ref is None else ref
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref))
            print(f"causal={causal} {what}: {ms:.3f} ms {tflops(ms, causal, passes):.0f} TFLOP/s |diff| {diff:.3g}",
                  flush=True)  # fmt: skip
            return ms, outs, ref
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or launch is reported, not fatal
            print(f"causal={causal} {what}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None, None, ref

    saved = core._FWD[32][128], core._BWD[32][128]
    try:
        for causal in (False, True):
            opts = dict(dtype="bfloat16", causal=causal, window=(-1, -1), scale=None, softcap=0.0)
            opts["target"] = target(device)
            ref = fwd = None
            for cfg in FWD:
                core._FWD[32][128] = [cfg]
                build = functools.partial(core.forward, *sizes, **opts)
                _, outs, ref = report(f"fwd {cfg}", build, (q, k, v), ref, 1, causal)
                fwd = fwd or outs
            out, lse = fwd
            best, gref = DKDV[0], None
            for stage, candidates in (("dkdv", DKDV), ("dq", DQ)):
                timed = []
                for cfg in candidates:
                    pair = (cfg, DQ[0]) if stage == "dkdv" else (best, cfg)
                    core._BWD[32][128] = [pair]
                    ms, _, gref = report(f"bwd {stage} {pair}", functools.partial(core.backward, *sizes, **opts),
                                         (q, k, v, out, dout, lse), gref, 2.5, causal)  # fmt: skip
                    if ms is not None:
                        timed.append((ms, cfg))
                best = min(timed)[1] if stage == "dkdv" and timed else best
    finally:
        core._FWD[32][128], core._BWD[32][128] = saved


if __name__ == "__main__":
    main("--small" in sys.argv[1:])
