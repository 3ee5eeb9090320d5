"""The `tile-kernels` command.

tile-kernels aot [--target cuda:90 --target hip:gfx942 ...] [--op rms_norm] [--out DIR] [--jobs N] [--list]
                 [--report] [--no-spills]
tile-kernels bench [--op rms_norm] [--width 4096] [--dtype bfloat16] [--out DIR] [--render JSON]   (see bench --help)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _progress(done: int, total: int, target: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} compiled ({target})")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _aot(args) -> int:
    from . import aot
    from .registry import REGISTRY

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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser: tile-kernels bench --help
        from . import bench

        return bench.main(argv[1:])
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
