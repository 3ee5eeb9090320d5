"""Kernel backends: which implementations an op has, which of them can run on a platform, which one runs by default.

    triton    Triton kernels, as launch Plans (plan.py): CUDA, ROCm, and the CPU through Triton's interpreter
    tilelang  TileLang kernels, compiled on first use by TileLang (nvcc) for the device's architecture
    cuda      CUDA C++ kernels, compiled on first use by nvcc through TVM-FFI's build helper

TileLang and CUDA C++ kernels have no interpreter: asked for on the CPU they raise, as they do on ROCm (their run-time
builds here are NVIDIA-only; TileLang's HIP output is lowered ahead of time only, see aot.py). Both are called through
the TVM-FFI convention: a `Call` runs `function(*reads, *writes, *attrs)` on the caller's stream; torch passes its
tensors in directly (DLPack), JAX registers the function as an XLA FFI target. A Plan of Calls is built like a Triton
plan (named buffers, allocated by the executor), so the adapters' wiring (reshapes, autograd, vmap) is the same.
An unavailable backend is an error, never a silent substitution.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("triton", "tilelang", "cuda")
PLATFORMS = ("cpu", "cuda", "rocm")  # cpu = Triton's interpreter

# The default backend of an op on a platform: the fastest one measured there. One entry per op and platform; an op or
# platform without one runs "triton". rms_norm on CUDA: Triton, measured fastest on the H200 (2026-11-29, bf16,
# 16384x4096, 1024x65536, 256x262144; benchmarks/results/h200/results.md): forward 3315-4092 GB/s against TileLang's
# 889-3371 and CUDA C++'s 1744-1758, backward 2303-2775 against 465-893 and 1027-1263. Re-measure (and change this
# entry) when those kernels improve. An op whose fastest backend depends on its inputs (INPUT_AWARE) names it per call
# instead (`resolve`'s `preferred`: flash_attention.preferred_backend, mla_decode.preferred_backend,
# matmul.preferred_backend, grouped_matmul.preferred_backend, fp8_matmul.preferred_backend; the torch adapters ask for
# it, JAX's take the platform default except the GEMMs').
DEFAULTS: dict[tuple[str, str], str] = {("rms_norm", "cuda"): "triton"}
INPUT_AWARE = ("flash_attention", "mla_decode", "matmul", "grouped_matmul", "fp8_matmul")

# op -> {backend: module that builds its Plans of Calls, imported on first use; None: the op's own Triton plans}
_IMPLEMENTATIONS: dict[str, dict[str, str | None]] = {}


class BackendUnavailable(ValueError):
    """A backend the op has but that cannot run here (platform or toolchain)."""


def register(op: str, implementations: Mapping[str, str | None]) -> None:
    unknown = set(implementations) - set(BACKENDS)
    if unknown or "triton" not in implementations:
        raise ValueError(f"{op}: backends must include 'triton' and be among {BACKENDS}, got {sorted(implementations)}")
    _IMPLEMENTATIONS[op] = dict(implementations)


def backends_of(op: str) -> tuple[str, ...]:
    """The backends `op` has, in BACKENDS order ("triton" only for an op that registered none)."""
    implemented = _IMPLEMENTATIONS.get(op, {"triton": None})
    return tuple(b for b in BACKENDS if b in implemented)


def module(op: str, backend: str):
    """The module that builds `op`'s Plans of Calls for a TileLang or CUDA C++ backend."""
    return importlib.import_module(_IMPLEMENTATIONS[op][backend])


def unsupported_inputs(op: str, backend: str, kwargs: Mapping[str, Any]) -> str | None:
    """Why `op`'s `backend` cannot run a call with these arguments (its module's `unsupported_inputs`), or None: for
    a backend that covers less than the op (flash_attention's TileLang forward: float16 / bfloat16 only)."""
    check = getattr(module(op, backend), "unsupported_inputs", None) if backend != "triton" else None
    return check(kwargs) if check else None


def find_cuda_home() -> str | None:
    """The CUDA toolkit (bin/nvcc, include/cuda_runtime.h): CUDA_HOME, CUDA_PATH, the one above nvcc on PATH, or
    /usr/local/cuda (where TileLang and TVM-FFI also look)."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    roots += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None, "/usr/local/cuda"]
    toolkit = ("bin/nvcc", "include/cuda_runtime.h")
    return next((r for r in roots if r and all(os.path.exists(os.path.join(r, f)) for f in toolkit)), None)


def _missing_modules(*names: str) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def missing_toolchain(backend: str, needs: tuple[str, ...] = ()) -> str | None:
    """Why `backend` cannot build kernels on this machine, or None. `needs`: modules the caller's framework adds
    (jax_tvm_ffi under JAX)."""
    if backend == "triton":
        return None
    absent = _missing_modules(*(("tilelang", "tvm_ffi") if backend == "tilelang" else ("tvm_ffi",)))
    if absent:
        return f"Python package(s) {', '.join(absent)} not installed (pip install tile-kernels[tilelang])"
    absent = _missing_modules(*needs)
    if absent:
        wheels = " ".join(name.replace("_", "-") for name in absent)
        return f"Python package(s) {', '.join(absent)} not installed (pip install {wheels})"
    if find_cuda_home() is None:
        return "no CUDA toolkit found (nvcc and headers under CUDA_HOME, CUDA_PATH, above nvcc or /usr/local/cuda)"
    if backend == "cuda" and not shutil.which("ninja"):
        return "ninja not found on PATH (TVM-FFI's build helper runs it)"
    return None


def unavailable(backend: str, platform: str, needs: tuple[str, ...] = ()) -> str | None:
    """Why `backend` cannot run on `platform` here (a clause that follows the backend's name), or None."""
    if backend == "triton":
        return None
    if platform == "cpu":
        return (
            "cannot run on the CPU: TileLang and CUDA C++ kernels have no interpreter (they run on NVIDIA GPUs); "
            "on the CPU use backend='triton' (Triton's interpreter, TRITON_INTERPRET=1)"
        )
    if platform != "cuda":
        return f"cannot run on a {platform} device: its kernels are built for NVIDIA GPUs only"
    missing = missing_toolchain(backend, needs)
    return f"cannot build its kernels here: {missing}" if missing else None


def available(op: str, platform: str) -> tuple[str, ...]:
    return tuple(b for b in backends_of(op) if unavailable(b, platform) is None)


def default(op: str, platform: str) -> str:
    return DEFAULTS.get((op, platform), "triton")


def resolve(
    op: str, backend: str | None, platform: str, needs: tuple[str, ...] = (), preferred: str | None = None
) -> str:
    """The backend that runs `op` on `platform` ('cpu', 'cuda' or 'rocm') when the caller asks for `backend`
    (None: `preferred`, the op's measured fastest for the call's inputs, where it can run here, else the platform's
    default); `needs` names modules the caller's framework adds for the compiled backends. Raises ValueError naming
    the op, the backend and why it cannot run."""
    if platform not in PLATFORMS:
        raise ValueError(f"{op}: platform must be one of {PLATFORMS}, got {platform!r}")
    if backend is None:
        usable = preferred in backends_of(op) and unavailable(preferred, platform, needs) is None
        backend = preferred if usable else default(op, platform)
    elif not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {', '.join(map(repr, BACKENDS))} or None, got {backend!r}")
    if backend not in backends_of(op):
        raise ValueError(f"{op}: backend {backend!r} is not implemented; {op} has {', '.join(backends_of(op))}")
    why = unavailable(backend, platform, needs)
    if why:
        raise BackendUnavailable(f"{op}: backend {backend!r} {why}")
    return backend


# ------------------------------------------------------------------------------------------- TVM-FFI compiled calls


@dataclass(frozen=True)
class Call:
    """One call of a compiled TVM-FFI function: load()(*reads, *writes, *attrs.values()) on the current stream.

    `key` names the compiled function uniquely (kernel, variant, architecture): JAX registers it as an FFI target
    under that name. Reads and writes are buffer names of the Plan the call belongs to; attrs are scalars."""

    key: str
    load: Callable[[], Any]  # compiles or loads the function on first use (cached by the builder)
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    attrs: Mapping[str, float] = field(default_factory=dict)

    @property
    def kernel(self) -> str:  # Plan's checks name a launch's kernel
        return self.key


def sm_name(arch: int) -> str:
    """TileLang's architecture name for compute capability `arch` (90 for 9.0): the arch-specific 'a' variants on
    Hopper and Blackwell, which TileLang's nvcc build needs there."""
    return f"sm_{arch}a" if arch in (90, 100) else f"sm_{arch}"


def tilelang_target(arch: int) -> dict:
    """TileLang's CUDA target for compute capability `arch`."""
    return {"kind": "cuda", "arch": sm_name(arch)}


_TILELANG_LOCK = threading.Lock()  # TileLang's compiler is not re-entrant: one lowering or build at a time


def tilelang_lower(make_prim_func: Callable, target: dict):
    """TileLang's lowering (no build) of the prim_func that `make_prim_func()` returns: its device source is
    `.kernel_source`."""
    import tilelang
    from tilelang import tvm

    with _TILELANG_LOCK, tvm.target.Target(target):
        return tilelang.lower(make_prim_func(), target=target)


def tilelang_build(make_prim_func: Callable, target: dict, pass_configs: dict | None = None):
    """TileLang's full build (nvcc for CUDA targets): a JITKernel with the TVM-FFI calling convention."""
    import tilelang
    from tilelang import tvm

    with _TILELANG_LOCK, tvm.target.Target(target):
        return tilelang.compile(make_prim_func(), target=target, execution_backend="tvm_ffi", pass_configs=pass_configs)


WS_PRODUCER_REGISTERS = 24  # setmaxnreg of an explicit schedule's TMA warp group


def ws_warps(threads: int) -> int:
    """num_warps of an explicit warp-specialization schedule (T.WSSchedule) with `threads` consumer threads: theirs
    and a warp group for the TMA warp (setmaxnreg acts on whole warp groups)."""
    return threads // 32 + 4


def ws_roles(threads: int) -> list:
    """The roles of that schedule: "MMA", the consumer warps from warp 0, and "TMA", one warp after them. The
    consumers' setmaxnreg is their share of the 64 Ki registers beside the TMA warp group's: a multiple of 8, at most
    240 (two consumer warp groups: 240, three: 160)."""
    import tilelang.language as T

    warps = threads // 32
    registers = min(240, (65536 - 128 * WS_PRODUCER_REGISTERS) // threads // 8 * 8)
    return [T.WSRole("MMA", warps_lo=0, warps_hi=warps, max_nreg=registers),
            T.WSRole("TMA", warps_lo=warps, warps_hi=warps + 1, max_nreg=WS_PRODUCER_REGISTERS)]  # fmt: skip


def tilelang_function(compiled):
    """The TVM-FFI function of a TileLang build (`tilelang_build`'s JITKernel): its exported kernel entry."""
    return compiled.adapter.get_exportable_executable()[compiled.adapter.prim_func.attrs["global_symbol"]]


def tilelang_entry_points(prim_func: Callable, pass_configs: dict | None = None):
    """(lower, build, function) of a TileLang backend module, what the AOT matrix, the ops' compiled plans and the
    tests call, from its prim_func(kernel, dtype_a, dtype_b, tilelang_target, *extra) (the two dtypes as its
    `variants` name them; extra: the module's own build parameters, such as dequant_matmul's group size):
        lower(kernel, dtype_a, dtype_b, target, *extra)     TileLang's lowering, no build (its .kernel_source)
        build(kernel, dtype_a, dtype_b, target, *extra)     the nvcc build (TVM-FFI calling convention)
        function(kernel, dtype_a, dtype_b, arch, *extra)    the built kernel's TVM-FFI function, built once"""

    def lower(kernel: str, dtype_a: str, dtype_b: str, target: dict, *extra):
        return tilelang_lower(lambda: prim_func(kernel, dtype_a, dtype_b, target, *extra), target)

    def build(kernel: str, dtype_a: str, dtype_b: str, target: dict, *extra):
        return tilelang_build(lambda: prim_func(kernel, dtype_a, dtype_b, target, *extra), target, pass_configs)

    @functools.cache
    def function(kernel: str, dtype_a: str, dtype_b: str, arch: int, *extra):
        return tilelang_function(build(kernel, dtype_a, dtype_b, tilelang_target(arch), *extra))

    return lower, build, function
