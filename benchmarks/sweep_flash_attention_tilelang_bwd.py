"""flash_attention's TileLang backward, timed on this machine's GPU beside the Triton backward and cuDNN's SDPA.

For each head dim and causal / not (bf16, B 4, S 8192, 32 heads by default): the TileLang forward in each
configuration of CONFIGS (c0 = default), with its output's max |difference| to the
Triton forward's; then forward + backward as
    triton                 the Triton forward and backward (backend="triton")
    tilelang-fwd+triton    the TileLang forward, the Triton backward (backend="tilelang" before the TileLang backward)
    tilelang c<i>          the TileLang forward and backward, backward configuration i of BWD_CONFIGS (c0 = default)
    public tilelang        tile_kernels.torch.flash_attention(backend="tilelang") through torch.autograd (eager)
    sdpa cudnn / flash     torch's SDPA, forward + backward through autograd
Each line: ms, TFLOP/s (forward 4 B H S^2 D flops, halved when causal; backward counted as 2.5x the forward), and for
the TileLang backwards the max |difference| of dq, dk, dv to the Triton backward's from the same (out, lse). The
kernels are built first in parallel processes (TileLang's disk cache keeps them), so the timed runs load them.

    python benchmarks/sweep_flash_attention_tilelang_bwd.py --out results/fa_bwd            # hd 128 and 64
    python benchmarks/sweep_flash_attention_tilelang_bwd.py --prebuild-only --jobs 16         # fill the cache only
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import os
import platform
import time


def _build(kernel: str, dtype: str, arch: int) -> tuple[str, float, str]:
    """Builds one TileLang kernel (into TileLang's disk cache); (kernel, seconds, error or '')."""
    from tile_kernels.core import flash_attention_tilelang as tl_fa

    start = time.time()
    try:
        tl_fa.build(kernel, dtype, dtype, tl_fa.target(arch))
        return f"{kernel}[{dtype}]", time.time() - start, ""
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return f"{kernel}[{dtype}]", time.time() - start, f"{type(e).__name__}: {str(e)[:300]}"


def prebuild(kernels: list[tuple[str, str]], arch: int, jobs: int, log) -> None:
    """Builds `kernels` ((name, dtype)) in `jobs` processes (TileLang's compiler holds a lock per process)."""
    start = time.time()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for name, seconds, error in pool.map(_build, *zip(*kernels), [arch] * len(kernels)):
            log(f"  built {name} in {seconds:.0f} s" + (f": FAILED {error}" if error else ""))
    log(f"prebuilt {len(kernels)} kernels in {time.time() - start:.0f} s ({jobs} processes)")


def all_kernels(dtypes) -> list[tuple[str, str]]:
    """Every TileLang kernel of flash_attention (forward and backward) plus the alternative configurations of both."""
    from tile_kernels.core import flash_attention_tilelang as tl_fa

    return [(k, d) for k, d, _ in tl_fa.variants(dtypes) + tl_fa.sm90_variants(dtypes, alternatives=True)]


def main(args) -> None:
    import torch
    import triton
    import triton.testing

    from tile_kernels.core import flash_attention_tilelang as tl_fa

    os.makedirs(args.out, exist_ok=True)
    lines: list[str] = []
    records: list[dict] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    arch = 10 * major + minor
    head_dims = [int(d) for d in args.head_dims.split(",")]
    dtype = args.dtype
    log(f"{torch.cuda.get_device_name(device)} sm_{arch}; torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    kernels = all_kernels(["bfloat16", "float16"]) if args.prebuild_all else [
        (k, dtype) for d in head_dims for k in
        [tl_fa.kernel_name(d, False, "bwd_pre"), tl_fa.kernel_name(d, False, "bwd_post")]
        + [tl_fa.kernel_name(d, False, "fwd", i) for i in range(len(tl_fa.CONFIGS["sm90"][d]))]
        + [tl_fa.kernel_name(d, False, "bwd", i) for i in range(len(tl_fa.BWD_CONFIGS["sm90"][d]))]
    ]  # fmt: skip
    prebuild(kernels, arch, args.jobs, log)
    if args.prebuild_only:
        _write(args.out, lines, records)
        return

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep)

    for dim in head_dims:
        heads_k = args.kv_heads or args.heads
        torch.manual_seed(0)
        shape_q, shape_k = (args.batch, args.seq, args.heads, dim), (args.batch, args.seq, heads_k, dim)
        q, dout = (torch.randn(shape_q, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
        k, v = (torch.randn(shape_k, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
        log(f"\nB {args.batch} S {args.seq} heads {args.heads}/{heads_k} hd {dim} {dtype}")
        for causal in (False, True) if not args.causal_only else (True,):
            case(q, k, v, dout, causal, arch, bench, log, records)
    _write(args.out, lines, records)


def case(q, k, v, dout, causal, arch, bench, log, records) -> None:
    """One shape, causal or not: every variant of the module doc, timed."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.core import dtype_name
    from tile_kernels.core import flash_attention as core
    from tile_kernels.core import flash_attention_tilelang as tl_fa
    from tile_kernels.torch._runtime import Executor, target

    device = q.device
    batch, seq, heads, dim = q.shape
    heads_k = k.shape[2]
    flops = 4 * batch * heads * seq * seq * dim / (2 if causal else 1)
    sizes = (batch, seq, seq, heads, heads_k, dim)
    opts = dict(dtype=dtype_name(q.dtype), causal=causal, window=(-1, -1), scale=None, softcap=0.0)

    def report(what: str, ms: float | None, passes: float, diffs=None, error: str = "") -> None:
        rec = dict(head_dim=dim, causal=causal, what=what, ms=ms, error=error, diffs=diffs,
                   tflops=None if ms is None else passes * flops / ms / 1e9)  # fmt: skip
        records.append(rec)
        if ms is None:
            log(f"hd={dim} causal={causal} {what}: FAILED {error}")
            return
        d = "" if diffs is None else " max|diff| vs triton: " + " ".join(f"{n} {x:.3g}" for n, x in diffs.items())
        log(f"hd={dim} causal={causal} {what}: {ms:.3f} ms {rec['tflops']:.0f} TFLOP/s{d}")

    tri_fwd = Executor(core.forward(*sizes, **opts, target=target(device)))
    tri_bwd = Executor(core.backward(*sizes, **opts, target=target(device)))
    tl_fwd = Executor(core.compiled_forward("tilelang", *sizes, **opts, arch=arch))
    out, lse = tri_fwd(q, k, v, device=device)
    ref = tri_bwd(q, k, v, out, dout, lse, device=device)

    def triton_step():
        o, s = tri_fwd(q, k, v, device=device)
        return tri_bwd(q, k, v, o, dout, s, device=device)

    def tl_fwd_triton_bwd():
        o, s = tl_fwd(q, k, v, device=device)
        return tri_bwd(q, k, v, o, dout, s, device=device)

    report("triton fwd", bench(lambda: tri_fwd(q, k, v, device=device)), 1)
    report("triton bwd", bench(lambda: tri_bwd(q, k, v, out, dout, lse, device=device)), 2.5)
    report("triton fwd+bwd", bench(triton_step), 3.5)
    for i, cfg in enumerate(tl_fa.CONFIGS["sm90"][tl_fa.bucket(dim)]):
        try:
            fwd = tl_fwd if i == 0 else Executor(core.compiled_forward("tilelang", *sizes, **opts, arch=arch, config=i))
            diffs = {"out": (fwd(q, k, v, device=device)[0].float() - out.float()).abs().max().item()}
            report(f"tilelang fwd c{i} {cfg}", bench(lambda fwd=fwd: fwd(q, k, v, device=device)), 1, diffs)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, not fatal
            report(f"tilelang fwd c{i} {cfg}", None, 1, error=f"{type(e).__name__}: {str(e)[:300]}")
    report("tilelang-fwd+triton-bwd", bench(tl_fwd_triton_bwd), 3.5)
    for i, cfg in enumerate(tl_fa.BWD_CONFIGS["sm90"][tl_fa.bucket(dim)]):
        what = f"tilelang bwd c{i} {cfg}"
        try:
            plan = core.compiled_backward("tilelang", *sizes, **opts, arch=arch, config=i)
            tl_bwd = Executor(plan)
            got = tl_bwd(q, k, v, out, dout, lse, device=device)
            diffs = {f"d{n}": (a.float() - b.float()).abs().max().item() for n, a, b in zip("qkv", got, ref)}
            report(what, bench(lambda tl_bwd=tl_bwd: tl_bwd(q, k, v, out, dout, lse, device=device)), 2.5, diffs)

            def tl_step(tl_bwd=tl_bwd):
                o, s = tl_fwd(q, k, v, device=device)
                return tl_bwd(q, k, v, o, dout, s, device=device)

            report(f"tilelang fwd+bwd c{i}", bench(tl_step), 3.5)
            # each kernel's share: the calls run once in order (real delta, lse), then each is timed
            bufs = {n: torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device=device)
                    for n, b in plan.buffers.items()}  # fmt: skip
            bufs |= dict(zip(plan.inputs, (q, k, v, out, dout, lse)))
            steps = [(c.key, c.load(), [bufs[n] for n in c.reads + c.writes] + list(c.attrs.values()))
                     for c in plan.launches]  # fmt: skip
            for _, fn, a in steps:
                fn(*a)
            for key, fn, a in steps:
                log(f"    {key}: {bench(lambda fn=fn, a=a: fn(*a)):.3f} ms")
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, not fatal
            report(what, None, 2.5, error=f"{type(e).__name__}: {str(e)[:300]}")

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def public_step():
        o = tk.flash_attention(*leaves, causal=causal, backend="tilelang")
        return torch.autograd.grad(o, leaves, dout)

    report("public tilelang fwd+bwd (autograd)", bench(public_step), 3.5)
    sdpa(q, k, v, dout, causal, heads != heads_k, bench, report)


def sdpa(q, k, v, dout, causal, gqa, bench, report) -> None:
    """cuDNN's (and flash-attn 2's) SDPA forward + backward through autograd, (B, H, S, D) views of the inputs."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    gt = dout.transpose(1, 2)
    call = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=causal,
                             enable_gqa=gqa)  # fmt: skip
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                report(f"sdpa {name} fwd", bench(call), 1)
                report(f"sdpa {name} fwd+bwd", bench(lambda: torch.autograd.grad(call(), (qt, kt, vt), gt)), 3.5)
        except Exception as e:  # noqa: BLE001 - a backend this build or shape lacks is reported, not fatal
            report(f"sdpa {name}", None, 3.5, error=f"{type(e).__name__}: {str(e)[:200]}")


def _write(out: str, lines: list[str], records: list[dict]) -> None:
    with open(os.path.join(out, "sweep_flash_attention_tilelang_bwd.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "sweep_flash_attention_tilelang_bwd.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the .txt log and the .json records")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=0, help="key/value heads (GQA); default: --heads")
    parser.add_argument("--causal-only", action="store_true")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rep", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel kernel builds")
    parser.add_argument("--prebuild-only", action="store_true", help="build the kernels (TileLang's cache), no runs")
    parser.add_argument(
        "--prebuild-all",
        action="store_true",
        help="build every flash_attention TileLang kernel, fp16 and bf16 (what the GPU tests use)",
    )
    main(parser.parse_args())
