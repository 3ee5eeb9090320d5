"""The instruction mix of a plan's Triton kernels as they run on a GPU, read on a machine without one: each launch
compiled for a CUDA target with the specializations Triton's launcher makes at run time (pointers 16-byte aligned,
int arguments that are multiples of 16 marked divisible by 16, as the AOT matrix does not), then its registers,
spills and occupancy, and its SASS instructions by opcode: the whole kernel's, and each loop's (a backward branch
and its target). What an issue-bound kernel spends a loop step on, before and after a change.

    env -u TRITON_INTERPRET python benchmarks/sass_mix.py \\
        "dequant_matmul.forward(1, 28672, 8192, dtype='bfloat16', group_size=128, has_zeros=False)" [--target cuda:90]

The expression is a plan builder of tile_kernels.core called without its `target` (the GPU target's is passed).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
import tempfile

import triton
from triton.compiler import ASTSource

from tile_kernels.core import Target, aot
from tile_kernels.core.plan import Launch

OPCODE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:`\()?(?:0x)?([0-9a-f]+)")


def compile_as_launched(plan, launch: Launch, target: aot.TargetSpec):
    cfg = aot._config("sass_mix", plan, launch)
    values = dict(zip(launch.kernel.arg_names, launch.reads + launch.writes, strict=False))
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(cfg.signature)
             if ty.startswith("*") or (ty in ("i32", "i64") and values.get(name, 1) % 16 == 0)}  # fmt: skip
    source = ASTSource(cfg.kernel, dict(cfg.signature), constexprs=dict(cfg.constexprs), attrs=attrs)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return triton.compile(source, target=target.gpu_target(), options=options)


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (from a backward branch's target to the branch), innermost first."""
    lines = [m for m in (OPCODE.search(line) for line in sass.splitlines()) if m]
    addresses = [int(m.group(1), 16) for m in lines]
    found = []
    for line in sass.splitlines():
        if (b := BRANCH.search(line)) and int(b.group(2), 16) < int(b.group(1), 16):
            start, end = int(b.group(2), 16), int(b.group(1), 16)
            body = [m.group(2) for m, a in zip(lines, addresses, strict=True) if start <= a <= end]
            found.append(collections.Counter(body))
    return sorted(found, key=lambda c: sum(c.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="module.builder(args) of tile_kernels.core, without target=")
    p.add_argument("--target", default="cuda:90", choices=[t for t in aot.TARGETS if t.startswith("cuda")])
    args = p.parse_args()
    spec = aot.TARGETS[args.target]
    module_name, call = args.plan.split(".", 1)
    module = importlib.import_module(f"tile_kernels.core.{module_name}")
    target = Target(warp_size=spec.warp_size, num_sms=spec.num_sms, cuda_arch=spec.arch)
    plan = eval(f"module.{call[:-1]}, target=target)", {"module": module, "target": target})  # noqa: S307
    seen = set()
    for launch in plan.launches:
        key = isinstance(launch, Launch) and (launch.kernel, tuple(launch.constexprs.items()), launch.num_warps)
        if not key or key in seen:  # a chunk loop launches one kernel many times
            continue
        seen.add(key)
        compiled = compile_as_launched(plan, launch, spec)
        print(f"{launch.kernel.fn.__name__} grid {launch.grid} {dict(launch.constexprs)} warps {launch.num_warps} "
              f"stages {launch.num_stages}: {aot.resources(compiled, spec).describe()}")  # fmt: skip
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", cubin.name], capture_output=True,
                                  text=True, check=True).stdout  # fmt: skip
        whole = collections.Counter(m.group(2) for m in map(OPCODE.search, sass.splitlines()) if m)
        print(f"  kernel: {sum(whole.values())} instructions: "
              + ", ".join(f"{op} {n}" for op, n in whole.most_common(12)))  # fmt: skip
        for i, counts in enumerate(loops(sass)):
            print(f"  loop {i}: {sum(counts.values())} instructions: "
                  + ", ".join(f"{op} {n}" for op, n in counts.most_common()))  # fmt: skip


if __name__ == "__main__":
    main()
