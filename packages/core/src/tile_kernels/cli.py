"""The `tile-kernels` command, the layer above the packages: it compiles ahead of time (tile_kernels.core.aot) and
runs the benchmarks through the framework providers (tile_kernels.torch.bench, tile_kernels.jax.bench) and the
mega-kernel's harness, which the core it reads its records from (tile_kernels.core.bench) does not know.

tile-kernels aot [--target cuda:90 --target hip:gfx942 ...] [--op rms_norm] [--out DIR] [--jobs N] [--list]
                 [--report] [--no-spills]
tile-kernels bench [--op rms_norm] [--width 4096] [--dtype bfloat16] [--out DIR] [--render JSON]   (see bench --help)

    tile-kernels bench --out results/            # default sweep, bfloat16
    tile-kernels bench --op rms_norm --dtype float32 --width 4096 --width 65536
    tile-kernels bench --render results/results.json --out results/    # tables and plots again, no GPU
    tile-kernels bench --megakernel --out results/    # the decode-step mega-kernel vs eager / CUDA graph / + PDL
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections.abc import Callable

from tile_kernels.core import bench as results
from tile_kernels.core.registry import REGISTRY


def _progress(done: int, total: int, target: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} compiled ({target})")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _aot(args) -> int:
    from tile_kernels.core import aot

    targets = args.target or list(aot.TARGETS)
    unknown = [t for t in targets if t not in aot.TARGETS]
    if unknown:
        raise SystemExit(f"tile-kernels aot: unknown target(s) {unknown}; known: {', '.join(aot.TARGETS)}")
    unknown = [o for o in (args.op or []) + (args.skip or []) if o not in REGISTRY]
    if unknown:
        raise SystemExit(f"tile-kernels aot: unknown op(s) {unknown}; registered: {', '.join(sorted(REGISTRY))}")
    if args.per_kernel is not None and args.per_kernel < 1:
        raise SystemExit(f"tile-kernels aot: --per-kernel must be at least 1, got {args.per_kernel}")
    if args.skip:
        args.op = [o for o in (args.op or sorted(REGISTRY)) if o not in args.skip]
    if args.list:
        for name in targets:
            for cfg in aot.configs(aot.TARGETS[name], args.op, args.per_kernel):
                print(f"{name}  {cfg.describe()}")
        return 0
    tilelang = [t for t in targets if t in aot.TILELANG_TARGETS]
    if tilelang and aot.missing_tilelang():
        print(f"tile-kernels aot: TileLang kernels left out of {', '.join(tilelang)}: {aot.missing_tilelang()}")
    start = time.perf_counter()
    result = aot.run_matrix(targets, args.op, args.out, args.jobs, None if args.quiet else _progress,
                            with_resources=args.report or args.no_spills, per_kernel=args.per_kernel)  # fmt: skip
    failures = list(result.failures)
    for name, records in result.manifest.items():
        for record in records:
            used = record.get("resources")
            if used and args.report:
                print(f"{name}  {record['config']}  {used.describe()}")
            if used and args.no_spills and used.spill_bytes:
                failures.append(f"{name}: {record['config']} spills {used.spill_bytes} bytes a thread")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    seconds = time.perf_counter() - start
    status = f"{len(failures)} failed" if failures else "all compiled"
    print(
        f"tile-kernels aot: {', '.join(targets)}: {status} in {seconds:.0f} s"
        + (f"; wrote {args.out}" if args.out else "")
    )
    return 1 if failures else 0


def _providers(frameworks) -> list:
    found = []
    for name in frameworks:
        module = __import__(f"tile_kernels.{name}.bench", fromlist=["Provider"])
        found.append(module.Provider())
    return found


def run(args, provider_factory: Callable = _providers) -> tuple[results.Meta, list[results.Record]]:
    ops = args.op or sorted(REGISTRY)
    unknown = sorted(set(ops) - set(REGISTRY))
    if unknown:
        raise SystemExit(f"bench: unknown op(s) {unknown}; registered: {sorted(REGISTRY)}")
    providers = provider_factory(args.framework)
    lead = providers[0]
    ceilings = lead.ceilings()
    versions = {}
    for p in providers:
        versions.update(p.versions())
    command = "tile-kernels bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    today = datetime.date.today().isoformat()
    meta = results.Meta(gpu=lead.device_name(), date=today, versions=versions, ceilings=ceilings, command=command)
    print(f"bench: {meta.gpu}; copy {ceilings.copy_gbs:.0f} GB/s, GEMM {ceilings.gemm_tflops:.0f} TFLOP/s",
          file=sys.stderr, flush=True)  # fmt: skip
    widths, dtypes = args.width or results.WIDTHS, args.dtype or ("bfloat16",)
    total = sum(len(results.shapes(op, widths, args.elements)) * len(dtypes) for op in ops)
    recs, started = [], time.perf_counter()
    for i, case in enumerate(results.cases(ops, widths, dtypes, args.elements), 1):
        timings = [t for p in providers for t in p.measure(case, args.impl)]
        recs += results.records(case, timings, ceilings)
        results.progress(i, total, started, results.summary_line(case, timings, ceilings))
        if args.out:
            results.write(args.out, meta, recs)  # after every case: a cut-short run keeps what it measured
    return meta, recs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tile-kernels bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--op", action="append", help="op to run (repeatable; default: every registered op)")
    p.add_argument("--width", action="append", type=int, help=f"row width (repeatable; default {results.WIDTHS})")
    p.add_argument("--dtype", action="append", choices=("bfloat16", "float16", "float32"), help="default bfloat16")
    p.add_argument("--elements", type=int, default=results.ELEMENTS, help="elements per large tensor (default 2^26)")
    p.add_argument("--framework", action="append", choices=("torch", "jax"), help="providers (default both)")
    p.add_argument(
        "--impl",
        action="append",
        help="only implementations whose name contains this (repeatable; with --megakernel: the megakernel and these)",
    )
    p.add_argument("--out", help="directory for results.json/.csv/.md and <op>.png")
    p.add_argument("--render", metavar="JSON", action="append",
                   help="re-render the tables and plots of results.json files (repeatable, merged: a later "
                   "file's row replaces an earlier one's of the same op, shape, dtype, direction, impl)")  # fmt: skip
    p.add_argument("--megakernel", action="store_true",
                   help="time the persistent decode-step kernel (tile_kernels.megakernel) against torch eager, CUDA "
                   "graph and CUDA graph + PDL instead of the ops; writes megakernel.json/.md under --out")  # fmt: skip
    p.add_argument("--shape", action="append", help="with --megakernel: llama-3.2-1b, llama-3-8b (default both)")
    p.add_argument("--layers", type=int, help="with --megakernel: layers of each stack (default: the model's)")
    p.add_argument("--context", type=int, action="append",
                   help="with --megakernel: cached positions a step reads (repeatable; default 1024)")  # fmt: skip
    return p


def bench(argv=None) -> int:
    """tile-kernels bench ARGS."""
    args = parser().parse_args(argv)
    if args.megakernel:  # its own harness: whole decode steps, not registered ops
        from tile_kernels.megakernel import bench as megakernel_bench

        print(
            megakernel_bench.markdown(megakernel_bench.run(args.out, args.shape, args.layers, args.context, args.impl))
        )
        return 0
    if args.render:
        runs = [results.load(path) for path in args.render]
        meta = runs[0][0]
        meta.command = "; ".join(m.command for m, _ in runs)
        meta.date = " and ".join(dict.fromkeys(m.date for m, _ in runs))
        rows = {}  # a later file's row replaces an earlier one's in place (a partial re-run updates a table)
        for _, more in runs:
            rows |= {(r.op, r.shape, r.dtype, r.direction, r.impl): r for r in more}
        recs = list(rows.values())
        if args.out:
            results.write(args.out, meta, recs)
        print(results.markdown(meta, recs))
        return 0
    args.framework = args.framework or ["torch", "jax"]
    if math.prod(args.width or [1]) <= 0 or args.elements <= 0:
        raise SystemExit("bench: --width and --elements must be positive")
    meta, recs = run(args)
    print(results.markdown(meta, recs))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser: tile-kernels bench --help
        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="tile-kernels", description="tile-kernels tools")
    commands = parser.add_subparsers(dest="command", required=True)
    aot = commands.add_parser(
        "aot",
        help="compile every kernel configuration for NVIDIA and AMD targets, without a GPU",
        description="Compiles every launch configuration of every registered op for each target (default: all of "
        "cuda:80, cuda:90, cuda:100, hip:gfx90a, hip:gfx942, hip:gfx950) and fails naming the kernel, the "
        "configuration and the target of any that does not compile. TileLang kernels join cuda:80, cuda:90 (nvcc "
        "builds) and hip:gfx942 (source only). --out writes the binaries and a manifest.",
    )
    aot.add_argument("--target", action="append", help="e.g. cuda:90 or hip:gfx942 (repeatable; default: all)")
    aot.add_argument("--op", action="append", help="only these ops (repeatable; default: all registered)")
    aot.add_argument("--skip", action="append", help="leave these ops out (repeatable)")
    aot.add_argument("--out", help="write cubin/hsaco files and manifest.json under this folder")
    aot.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: all cores)")
    aot.add_argument(
        "--per-kernel",
        type=int,
        metavar="N",
        help="at most N configurations of each kernel, spread over its list (a quick check)",
    )
    aot.add_argument("--list", action="store_true", help="list the configurations instead of compiling")
    aot.add_argument("--quiet", action="store_true", help="no progress bar")
    aot.add_argument("--report", action="store_true", help="print each Triton kernel's registers, spills, occupancy")
    aot.add_argument("--no-spills", action="store_true", help="fail any Triton kernel that spills registers")
    commands.add_parser(
        "bench", add_help=False, help="benchmark every op against the measured ceilings and its peers (GPU)"
    )
    args = parser.parse_args(argv)
    return {"aot": _aot}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
