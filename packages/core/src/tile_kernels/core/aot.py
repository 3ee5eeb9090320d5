"""Ahead-of-time compile matrix: every launch configuration of every registered op, for NVIDIA and AMD targets.

The configurations come from the ops' own plan builders (`OpInfo.plans(target)`), run with the target's warp width,
so the matrix holds exactly what the heuristics can choose on that target. Each one is compiled with
`triton.compile(ASTSource(...), target=GPUTarget(...))` — no GPU needed — with its pointers marked 16-byte aligned
(the vectorized build that runs) and checked against the target's shared memory. `resources` reads back what the
compiler allotted each Triton kernel (registers, spilled bytes, shared memory, occupancy; `tile-kernels aot --report`
prints them, `--no-spills` fails a kernel that spills). The ops' TileLang kernels
(backend="tilelang", backends.py) join the matrix for TILELANG_TARGETS: lowered by TileLang for the target and built
with nvcc on CUDA targets; HIP targets are lowered to source only (no hipcc on the build machines). Failures name the
kernel, the configuration and the target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from . import backends
from .host import interpreting
from .plan import FLOAT_DTYPES, TRITON_TYPE, Launch, Plan, Target, dtype_of, is_ref, ref_name
from .registry import REGISTRY


@dataclass(frozen=True)
class TargetSpec:
    backend: str  # "cuda" | "hip"
    arch: int | str  # 90 | "gfx942"
    warp_size: int
    num_sms: int  # representative; only sizes persistent grids
    shared_bytes: int  # per-block shared memory (LDS) limit

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.arch}"

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS = {
    t.name: t
    for t in (
        TargetSpec("cuda", 80, 32, 108, 163 * 1024),
        TargetSpec("cuda", 90, 32, 132, 227 * 1024),
        TargetSpec("cuda", 100, 32, 148, 227 * 1024),
        TargetSpec("hip", "gfx90a", 64, 110, 64 * 1024),
        TargetSpec("hip", "gfx942", 64, 304, 64 * 1024),
        TargetSpec("hip", "gfx950", 64, 256, 160 * 1024),
    )
}


@dataclass(frozen=True)
class KernelConfig:
    op: str
    kernel: object  # the @triton.jit function
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr")
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int

    @property
    def kernel_name(self) -> str:
        return self.kernel.fn.__name__

    def describe(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        types = ",".join(t for _, t in self.signature if t != "constexpr")
        return f"{self.op}/{self.kernel_name}[{consts}; num_warps={self.num_warps}; ({types})]"


def _config(op: str, plan: Plan, launch: Launch) -> KernelConfig:
    params = launch.kernel.arg_names
    signature, constexprs = {}, dict(launch.constexprs)
    for name, value in zip(params, launch.reads + launch.writes, strict=False):
        if is_ref(value):
            signature[name] = "*" + TRITON_TYPE[dtype_of(plan, ref_name(value))]
        elif value is None:  # absent pointer: the executors pass another buffer of the launch
            first = next(v for v in launch.reads if is_ref(v))
            signature[name] = "*" + TRITON_TYPE[dtype_of(plan, ref_name(first))]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:  # Triton's launcher specializes integer 1 into a constant
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    for name in constexprs:
        signature[name] = "constexpr"
    ordered = tuple((p, signature[p]) for p in params)
    return KernelConfig(op, launch.kernel, ordered, tuple(sorted(constexprs.items())), launch.num_warps,
                        launch.num_stages)  # fmt: skip


def configs(
    target: TargetSpec, ops: Iterable[str] | None = None, per_kernel: int | None = None
) -> list[KernelConfig | TileLangConfig]:
    """The distinct kernel configurations of the registered ops on `target`, in a stable order: the Triton ones, then
    the TileLang ones. With `per_kernel`, at most that many of each op's kernel, spread evenly over its list (the
    first and the last among them): every kernel's code compiled for the target in minutes, not hours."""
    seen: dict = {}
    cuda_arch = target.arch if target.backend == "cuda" else 0
    plan_target = Target(warp_size=target.warp_size, num_sms=target.num_sms, cuda_arch=cuda_arch)
    for op in sorted(ops or REGISTRY):
        for plan in REGISTRY[op].plans(plan_target):
            for launch in plan.launches:
                if not isinstance(launch, Launch):  # Gemm steps run on the frameworks' BLAS: nothing to compile
                    continue
                cfg = _config(op, plan, launch)
                seen.setdefault((cfg.kernel, cfg.signature, cfg.constexprs, cfg.num_warps, cfg.num_stages), cfg)
    found = list(seen.values()) + tilelang_configs(target, ops)
    return found if per_kernel is None else _spread(found, per_kernel)


def _spread(cfgs: list, per_kernel: int) -> list:
    groups: dict[tuple[str, str], list[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault((cfg.op, cfg.kernel_name), []).append(i)
    keep = set()
    for indices in groups.values():
        n = min(per_kernel, len(indices))
        keep.update(indices[round(k * (len(indices) - 1) / max(n - 1, 1))] for k in range(n))
    return [cfgs[i] for i in sorted(keep)]


# The TileLang part of the matrix: target name -> (TileLang target, whether to build the lowered source with nvcc).
# Hopper needs TileLang's arch-specific sm_90a (its plain sm_90 build fails).
TILELANG_TARGETS = {
    "cuda:80": ({"kind": "cuda", "arch": "sm_80"}, True),
    "cuda:90": ({"kind": "cuda", "arch": "sm_90a"}, True),
    "hip:gfx942": ({"kind": "hip", "mcpu": "gfx942"}, False),
}


@dataclass(frozen=True)
class TileLangConfig:
    """One TileLang kernel of an op (its backend module's `variants`), built by the module's `lower` / `build`."""

    op: str
    kernel_name: str
    x_dtype: str
    weight_dtype: str

    def describe(self) -> str:
        return f"{self.op}/{self.kernel_name}[tilelang; x={self.x_dtype}, weight={self.weight_dtype}]"


def missing_tilelang() -> str | None:
    """Why the TileLang kernels are not in the matrix on this machine, or None."""
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang not installed (pip install tile-kernels[tilelang])"
    return None


def tilelang_configs(target: TargetSpec, ops: Iterable[str] | None = None) -> list[TileLangConfig]:
    if target.name not in TILELANG_TARGETS or missing_tilelang():
        return []
    ops = [op for op in sorted(ops or REGISTRY) if "tilelang" in backends.backends_of(op)]
    modules = {op: backends.module(op, "tilelang") for op in ops}
    # a module's AOT_TARGETS: the targets its kernels are written for (mla_decode's: sm_90a only); all when absent
    modules = {op: m for op, m in modules.items() if target.name in getattr(m, "AOT_TARGETS", TILELANG_TARGETS)}
    return [TileLangConfig(op, *v) for op, module in modules.items() for v in module.variants(FLOAT_DTYPES)]


class AotError(RuntimeError):
    pass


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _compile_tilelang(cfg: TileLangConfig, target: TargetSpec):
    """The JITKernel (nvcc build) or, for a source-only target, TileLang's lowered artifact."""
    tilelang_target, build = TILELANG_TARGETS[target.name]
    module = backends.module(cfg.op, "tilelang")
    if build and backends.find_cuda_home() is None:
        raise AotError(f"{target.name}: {cfg.describe()} cannot be built: no CUDA toolkit (nvcc) found")
    try:
        step = module.build if build else module.lower
        return step(cfg.kernel_name, cfg.x_dtype, cfg.weight_dtype, tilelang_target)
    except Exception as e:  # noqa: BLE001 - any lowering or nvcc failure is reported with its context
        what = "lower and build" if build else "lower"
        raise AotError(f"{target.name}: {cfg.describe()} failed to {what} ({tilelang_target}): {_first_line(e)}") from e


def compile_config(cfg: KernelConfig | TileLangConfig, target: TargetSpec):
    """Compiles one configuration for one target; raises AotError naming both."""
    import triton
    from triton.compiler import ASTSource

    if isinstance(cfg, TileLangConfig):
        return _compile_tilelang(cfg, target)
    if interpreting():
        raise AotError("ahead-of-time compiles need TRITON_INTERPRET unset: under it the kernels are interpreted")
    try:
        # pointers marked 16-byte aligned, as Triton's launcher marks the executors' buffers: the vectorized build
        # (16-byte loads, cp.async) that runs, not the element-wise one an unaligned view would get
        aligned = {(i,): [["tt.divisibility", 16]] for i, (_, ty) in enumerate(cfg.signature) if ty.startswith("*")}
        source = ASTSource(cfg.kernel, dict(cfg.signature), constexprs=dict(cfg.constexprs), attrs=aligned)
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        compiled = triton.compile(source, target=target.gpu_target(), options=options)
    except Exception as e:  # noqa: BLE001 - any compiler failure is reported with its context
        raise AotError(f"{target.name}: {cfg.describe()} failed to compile: {_first_line(e)}") from e
    if compiled.metadata.shared > target.shared_bytes:
        raise AotError(
            f"{target.name}: {cfg.describe()} needs {compiled.metadata.shared} bytes of shared memory, "
            f"the target has {target.shared_bytes}"
        )
    return compiled


@dataclass(frozen=True)
class Resources:
    """What the compiler allotted one Triton kernel: registers a thread (VGPRs on AMD), bytes a thread spills to
    local (scratch) memory, shared memory (LDS) a block, and occupancy: on CUDA the blocks an SM holds at once (the
    least of what its 64K registers, its shared memory, 2048 threads and 32 blocks allow), on AMD the waves a SIMD
    holds (the compiler's figure)."""

    registers: int
    spill_bytes: int
    shared_bytes: int
    occupancy: int
    occupancy_unit: str  # "blocks/SM" | "waves/SIMD"

    def describe(self) -> str:
        return (f"{self.registers} registers, {self.spill_bytes} B spilled, {self.shared_bytes} B shared, "
                f"{self.occupancy} {self.occupancy_unit}")  # fmt: skip


def _cuda_occupancy(registers: int, num_warps: int, shared: int, target: TargetSpec) -> int:
    """Blocks an SM holds (as CUDA's occupancy calculator counts on sm_80 - sm_100): registers are allocated per warp
    in units of 256 from four sub-partitions of 16K; shared memory in units of 128 bytes per block plus 1 KiB the
    driver reserves (an SM has the per-block limit + 1 KiB: 164 KiB on sm_80, 228 KiB on sm_90 / sm_100); at most
    2048 threads and 32 blocks."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (16384 // per_warp) * 4 // num_warps if per_warp else 32
    by_shared = (target.shared_bytes + 1024) // (-(-shared // 128) * 128 + 1024)
    return min(by_registers, by_shared, 2048 // (32 * num_warps), 32)


def resources(compiled, target: TargetSpec) -> Resources:
    """The compiler's resource report of a compiled Triton kernel (compile_config): CUDA's from cuobjdump
    --dump-resource-usage of its cubin (Triton's bundled cuobjdump), AMD's from the comments of its amdgcn."""
    shared = compiled.metadata.shared
    if target.backend == "hip":
        asm = compiled.asm["amdgcn"]

        def field(name: str) -> int:
            found = re.search(rf"; {name}: (\d+)", asm)
            if not found:
                raise AotError(f"{target.name}: no '{name}' in the amdgcn of {compiled.metadata.name}")
            return int(found.group(1))

        return Resources(field("TotalNumVgprs"), field("ScratchSize"), shared, field("Occupancy"), "waves/SIMD")
    import triton.knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        try:  # (the knob raises RuntimeError when Triton's cuobjdump is missing)
            report = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
                                    capture_output=True, text=True, check=True).stdout  # fmt: skip
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            raise AotError(f"{target.name}: cuobjdump could not read {compiled.metadata.name}'s cubin: {e}") from e
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    if not found:
        raise AotError(f"{target.name}: cuobjdump gave no resource usage for {compiled.metadata.name}: {report!r}")
    registers, stack, local = (int(g) for g in found.groups())
    occupancy = _cuda_occupancy(registers, compiled.metadata.num_warps, shared, target)
    # Triton inlines every call: a stack frame holds spilled registers only
    return Resources(registers, stack + local, shared, occupancy, "blocks/SM")


def _compile_slice(target_name: str, ops: tuple[str, ...] | None, per_kernel: int | None, indices: list[int],
                   out: str | None, with_resources: bool) -> list:  # fmt: skip
    """(index, error or None, manifest record) of the configurations `indices` of one target."""
    target = TARGETS[target_name]
    cfgs = configs(target, ops, per_kernel)
    done = []
    for i in indices:
        cfg = cfgs[i]
        try:
            compiled = compile_config(cfg, target)
            record = _write(out, target, cfg, compiled) if out else {"config": cfg.describe()}
            if with_resources and isinstance(cfg, KernelConfig):
                record["resources"] = resources(compiled, target)
        except AotError as e:
            done.append((i, str(e), None))
            continue
        done.append((i, None, record))
    return done


def _write(out: str, target: TargetSpec, cfg: KernelConfig | TileLangConfig, compiled) -> dict:
    digest = hashlib.sha256(cfg.describe().encode()).hexdigest()[:16]
    folder = os.path.join(out, target.name.replace(":", "-"))
    os.makedirs(folder, exist_ok=True)
    if isinstance(cfg, TileLangConfig):  # the device source, and the TVM-FFI library where it was built
        path = os.path.join(folder, f"{cfg.kernel_name}-{digest}.{'cu' if target.backend == 'cuda' else 'hip'}")
        built = TILELANG_TARGETS[target.name][1]
        with open(path, "w") as f:
            f.write(compiled.get_kernel_source() if built else compiled.kernel_source)
        record = {"config": cfg.describe(), "file": os.path.relpath(path, out)}
        if built:
            compiled.export_library(path[: -len(".cu")] + ".so")
            record["library"] = os.path.relpath(path[: -len(".cu")] + ".so", out)
        return record
    kind = "cubin" if target.backend == "cuda" else "hsaco"
    path = os.path.join(folder, f"{cfg.kernel_name}-{digest}.{kind}")
    with open(path, "wb") as f:
        f.write(compiled.asm[kind])
    return {"config": cfg.describe(), "file": os.path.relpath(path, out), "shared": compiled.metadata.shared,
            "name": compiled.metadata.name}  # fmt: skip


@dataclass
class MatrixResult:
    failures: list[str]  # one line a configuration that did not compile (empty when all compiled)
    manifest: dict[str, list[dict]]  # target -> a record a compiled configuration (config, files, resources), in order


def run_matrix(
    targets: Iterable[str], ops: Iterable[str] | None = None, out: str | None = None, jobs: int = 1,
    progress: Callable[[int, int, str], None] | None = None, with_resources: bool = False,
    per_kernel: int | None = None,
) -> MatrixResult:  # fmt: skip
    """Compiles every configuration (or `per_kernel` of each kernel, as `configs`) for every target; with `out`,
    writes the binaries and manifest.json; with `with_resources`, each Triton kernel's record holds its `resources`
    (a dict in the file)."""
    ops = tuple(ops) if ops else None
    work = [(name, list(range(len(configs(TARGETS[name], ops, per_kernel))))) for name in targets]
    total = sum(len(idx) for _, idx in work)
    failures, records, count = [], {}, 0
    chunks = [(name, idx[k :: max(jobs, 1) * 4]) for name, idx in work for k in range(max(jobs, 1) * 4)]
    chunks = [(name, idx) for name, idx in chunks if idx]
    with ProcessPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = [
            (name, pool.submit(_compile_slice, name, ops, per_kernel, idx, out, with_resources)) for name, idx in chunks
        ]
        for name, future in futures:
            for index, error, record in future.result():
                count += 1
                if error:
                    failures.append(error)
                if record:
                    records.setdefault(name, []).append((index, record))
            if progress:
                progress(count, total, name)
    manifest = {name: [record for _, record in sorted(done, key=lambda r: r[0])] for name, done in records.items()}
    if out:
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1, default=dataclasses.asdict)
    return MatrixResult(failures, manifest)
