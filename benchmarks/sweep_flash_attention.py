"""Block configurations of flash_attention's Triton kernels, timed on this machine's GPU: forward, then the dK/dV
kernel's candidates (with the dQ kernel fixed), then the dQ kernel's (with the best dK/dV), causal and not, beside
cuDNN's SDPA in the same run. Each line: TFLOP/s (the backward counted as 2.5x the forward's flops) and the max
|difference| of the outputs to the first candidate's, so that a candidate that computes something else shows. The
best become the first entries of flash_attention._FWD / _BWD (the defaults) for the head dim's bucket.

    python benchmarks/sweep_flash_attention.py             # bf16, B 4, S 8192, 32 heads, hd 128 (as the bench)
    python benchmarks/sweep_flash_attention.py --head-dim 64 --batch 4 --seq 2048 --kv-heads 8 --causal-only
    TRITON_INTERPRET=1 python benchmarks/sweep_flash_attention.py --small    # a dry run on the CPU
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton.testing

from tile_kernels.core import flash_attention as core
from tile_kernels.torch._runtime import Executor, target

CANDIDATES = {  # head-dim bucket -> (forward, dK/dV, dQ) candidates, (BLOCK_M, BLOCK_N, num_warps, num_stages)
    128: ([(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 4, 2),
           (64, 128, 4, 3), (256, 64, 8, 2)],
          [(32, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 3),
           (64, 64, 4, 3), (32, 128, 4, 5)],
          [(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)]),
    64: ([(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 2), (128, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
          (128, 32, 4, 3), (256, 64, 8, 3), (128, 128, 8, 2)],
         [(32, 128, 4, 3), (64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
          (16, 128, 4, 3), (64, 128, 8, 2), (32, 128, 4, 4), (128, 128, 8, 2)],
         [(128, 32, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3),
          (128, 128, 8, 2)]),
}  # fmt: skip


def main(args) -> None:
    small = args.small
    batch, seq, heads, heads_k, dim = (1, 96, 2, 1, args.head_dim) if small else (
        args.batch, args.seq, args.heads, args.kv_heads or args.heads, args.head_dim)  # fmt: skip
    bucket = core._bucket(dim)
    fwd_candidates, dkdv_candidates, dq_candidates = CANDIDATES[bucket]
    device = torch.device("cpu" if small else "cuda")
    bench = (lambda fn, **_: (fn(), 1.0)[1]) if small else triton.testing.do_bench
    torch.manual_seed(0)
    q, dout = (torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, seq, heads_k, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    sizes = (batch, seq, seq, heads, heads_k, dim)
    print(
        f"B {batch} S {seq} heads {heads}/{heads_k} hd {dim} bf16; torch {torch.__version__}, "
        f"triton {triton.__version__}",
        flush=True,
    )

    def tflops(ms: float, causal: bool, passes: float) -> float:
        return passes * 4 * batch * heads * seq * seq * dim / (2 if causal else 1) / ms / 1e9

    def report(what: str, build, inputs, ref, passes: float, causal: bool):
        """Builds the plan of the current configuration, runs and times it: (ms, outputs, reference)."""
        try:
            run = Executor(build())
            outs = run(*inputs, device=device)
            ms = bench(lambda: run(*inputs, device=device), warmup=5, rep=30)
            ref = outs if ref is None else ref
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref))
            print(f"causal={causal} {what}: {ms:.3f} ms {tflops(ms, causal, passes):.0f} TFLOP/s |diff| {diff:.3g}",
                  flush=True)  # fmt: skip
            return ms, outs, ref
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or launch is reported, not fatal
            print(f"causal={causal} {what}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None, None, ref

    def sdpa(causal: bool) -> None:
        """cuDNN's SDPA (B, H, S, D layout) forward and forward + backward, the peer to beat."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        gt = dout.transpose(1, 2)
        call = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=causal,
                                 enable_gqa=heads != heads_k)  # fmt: skip
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fwd = bench(call, warmup=5, rep=30)
                    step = bench(lambda: torch.autograd.grad(call(), (qt, kt, vt), gt), warmup=5, rep=30)
                print(f"causal={causal} sdpa {name}: fwd {fwd:.3f} ms {tflops(fwd, causal, 1):.0f} TFLOP/s, "
                      f"fwd+bwd {step:.3f} ms {tflops(step, causal, 3.5):.0f} TFLOP/s", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a backend this build or shape lacks is reported, not fatal
                print(f"causal={causal} sdpa {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)

    saved = core._FWD[32][bucket], core._BWD[32][bucket]
    try:
        for causal in (True,) if args.causal_only else (False, True):
            if not small:
                sdpa(causal)
            opts = dict(dtype="bfloat16", causal=causal, window=(-1, -1), scale=None, softcap=0.0)
            opts["target"] = target(device)
            ref = fwd = None
            for cfg in fwd_candidates:
                core._FWD[32][bucket] = [cfg]
                build = functools.partial(core.forward, *sizes, **opts)
                _, outs, ref = report(f"fwd {cfg}", build, (q, k, v), ref, 1, causal)
                fwd = fwd or outs
            out, lse = fwd
            best, gref = dkdv_candidates[0], None
            for stage, candidates in (("dkdv", dkdv_candidates), ("dq", dq_candidates)):
                timed = []
                for cfg in candidates:
                    pair = (cfg, dq_candidates[0]) if stage == "dkdv" else (best, cfg)
                    core._BWD[32][bucket] = [pair]
                    ms, _, gref = report(f"bwd {stage} {pair}", functools.partial(core.backward, *sizes, **opts),
                                         (q, k, v, out, dout, lse), gref, 2.5, causal)  # fmt: skip
                    if ms is not None:
                        timed.append((ms, cfg))
                best = min(timed)[1] if stage == "dkdv" and timed else best
    finally:
        core._FWD[32][bucket], core._BWD[32][bucket] = saved


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128, choices=sorted(CANDIDATES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=0, help="key/value heads (GQA); default: --heads")
    parser.add_argument("--causal-only", action="store_true")
    parser.add_argument("--small", action="store_true", help="a dry run on the CPU (TRITON_INTERPRET=1)")
    main(parser.parse_args())
