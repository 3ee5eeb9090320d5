"""mla_decode on the current GPU: the Triton path against the TileLang kernel (backend="tilelang", each of
mla_decode_tilelang.CONFIGS) on DeepSeek-V3 decode shapes (128 heads, Dc 512, Dr 64, bf16, every sequence full),
contiguous and paged (page 64). Device time of the op (triton.testing.do_bench medians, inputs rotated past L2; and
CUDA-graph replays where the calls capture), TFLOP/s, GB/s, the split count, and max |diff| of out / lse to the
Triton output. Writes results.txt and results.json (with GPU name, versions, date) to --out.

    python benchmarks/sweep_mla_decode_tilelang.py --out DIR [--shape B,S ...] [--dtype bfloat16] [--splits 8,16]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform

import torch
import triton
from sweep_mla_decode import HEADS, LATENT, PAGE, ROPE, inputs  # the script's folder is on sys.path

import tile_kernels.torch as tk
from tile_kernels.core import dtype_name
from tile_kernels.core import mla_decode as core
from tile_kernels.core import mla_decode_tilelang as tl_kernel
from tile_kernels.torch._calls import cuda_arch
from tile_kernels.torch._runtime import Executor, target

SHAPES = ("1,32768", "32,8192", "64,4096", "128,4096", "128,2048")
L2_BYTES = 60 << 20


def tilelang_call(x, tile_config, num_splits=None):
    """The TileLang plan of one config (built once; num_splits None: the heuristic's), as a call of the input
    tuple."""
    q_nope, q_pe, kv, kp, lengths, table = x
    batch, heads, latent = q_nope.shape
    paged = table is not None
    capacity = kv.shape[1] * (table.shape[1] if paged else 1)
    plan = core.compiled_forward("tilelang", batch, heads, latent, q_pe.shape[2], capacity,
                                 dtype=dtype_name(q_nope.dtype), scale=None, arch=cuda_arch(q_nope.device),
                                 target=target(q_nope.device), page_size=kv.shape[1] if paged else None,
                                 tile_config=tile_config, num_splits=num_splits)  # fmt: skip
    splits = plan.buffers["partial_o"].shape[2] if "partial_o" in plan.buffers else 1
    run = Executor(plan)

    def call(x):
        args = [t for t in x if t is not None]
        return run(*args, device=args[0].device)

    return call, splits


def timed(fn, sets):
    """(eager ms, graph ms or None): medians over calls that cycle through the input sets."""
    it = itertools.cycle(sets)
    eager = triton.testing.do_bench(lambda: fn(next(it)), warmup=25, rep=200)
    graph = None
    try:
        x = sets[0]
        fn(x)
        torch.cuda.synchronize()
        graph = triton.testing.do_bench_cudagraph(lambda: fn(x), rep=200)
    except Exception as e:  # noqa: BLE001 - a call that does not capture: eager time only
        print(f"    (no CUDA graph: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})", flush=True)
        torch.cuda.synchronize()
    return eager, graph


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help=f"batch,context (default: {' '.join(SHAPES)})")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--configs", default=",".join(tl_kernel.CONFIGS), help="TileLang configs to time")
    parser.add_argument("--splits", default="", help="split counts to time with the default config, e.g. 8,16,32")
    parser.add_argument("--out", required=True, help="directory for results.txt and results.json")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(map(int, s.split(","))) for s in args.shape or SHAPES]
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(),
               date=datetime.datetime.now().isoformat(timespec="seconds"))  # fmt: skip
    try:
        import tilelang

        env["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001
        pass
    lines, rows = [json.dumps(env)], []

    def say(line):
        print(line, flush=True)
        lines.append(line)

    say(str(env))
    for (batch, seqlen), paged in itertools.product(shapes, (False, True)):
        layout = f"paged{PAGE}" if paged else "contig"
        flops = 2 * batch * HEADS * seqlen * (2 * LATENT + ROPE)
        item = torch.finfo(dtype).bits // 8
        nbytes = batch * seqlen * (LATENT + ROPE) * item + batch * HEADS * (2 * LATENT + ROPE) * item
        copies = max(1, math.ceil(2 * L2_BYTES / nbytes))  # rotate input sets so that no call reads from L2 only
        sets = [inputs(batch, seqlen, paged, dtype, seed=i) for i in range(copies)]
        want = tk.mla_decode(*sets[0], return_lse=True, backend="triton")
        runs = [("triton", lambda x: tk.mla_decode(*x, return_lse=True, backend="triton"), 0)]
        runs.append(("tilelang public", lambda x: tk.mla_decode(*x, return_lse=True, backend="tilelang"), None))
        for cfg in args.configs.split(","):
            try:
                call, splits = tilelang_call(sets[0], cfg)
            except Exception as e:  # noqa: BLE001 - e.g. a page size the config does not take
                say(f"{batch}x{seqlen} {layout} tilelang[{cfg}]: {type(e).__name__}: {e}")
                continue
            runs.append((f"tilelang[{cfg}]", call, splits))
        for count in filter(None, args.splits.split(",")):
            call, splits = tilelang_call(sets[0], None, int(count))
            runs.append((f"tilelang splits={count}", call, splits))
        for name, fn, splits in runs:
            try:
                got = fn(sets[0])
                torch.cuda.synchronize()
                diff = (got[0].float() - want[0].float()).abs().max().item()
                lse_diff = (got[1] - want[1]).abs().max().item()
                eager, graph = timed(fn, sets)
            except Exception as e:  # noqa: BLE001 - a kernel that fails to build or run: reported, the sweep goes on
                say(f"{batch}x{seqlen} {layout} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            best = graph or eager
            row = dict(batch=batch, seqlen=seqlen, layout=layout, kernel=name, splits=splits, eager_us=eager * 1e3,
                       graph_us=graph * 1e3 if graph else None, tflops=flops / best / 1e9, gbps=nbytes / best / 1e6,
                       max_diff=diff, max_lse_diff=lse_diff)  # fmt: skip
            rows.append(row)
            say(
                f"{batch}x{seqlen} {layout} {name:<22} splits {str(splits):>3}: eager {eager * 1e3:8.1f} us, graph "
                f"{(f'{graph * 1e3:8.1f} us' if graph else '       -   ')} {row['tflops']:6.0f} TFLOP/s "
                f"{row['gbps']:6.0f} GB/s  max|diff| {diff:.3g} lse {lse_diff:.3g}"
            )
        del sets
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "results.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
