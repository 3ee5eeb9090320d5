"""Framework-neutral launch plans.

An op's forward or backward is a `Plan`: the buffers it allocates and an ordered list of steps over named buffers:
Triton kernel launches, and `Gemm` steps that each executor runs with its framework's matmul (vendor BLAS; the AOT
matrix skips them). The torch adapter, the JAX adapter (jax-triton) and the host interpreter each execute the same
plan; no kernel logic lives in the adapters.

Kernel parameter order (the jax-triton convention, which the others accept too): the buffers the launch reads and the
scalars, in any order, then the buffers it writes, then the constexprs. A buffer that no step writes (an empty
problem) must be `zeroed`. An absent optional pointer is `None`; the kernel must not touch it (a constexpr flag says
so); executors pass another buffer of the launch in its place.

Buffer references are names (the whole buffer) or `Rows` (a leading-dim range of it: a view in torch and NumPy, a
slice in JAX). A step that writes a reference writes all of it; later steps may write a buffer again (a chunk loop
reuses one buffer), and a launch that reads and writes the same reference updates it in place (each element read by
the program that then writes it). A step may also write a plan input: the executor updates it in place (torch; the
op declares the mutation), aliases it (jax-triton) or copies it first (host).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float64": 8, "int32": 4, "int64": 8}
# the dtypes kernels read and write, by Triton's names for their pointers' element types
TRITON_TYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8e4nv", "int32": "i32",
               "int64": "i64"}  # fmt: skip


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, jnp.float32, np.dtype('float32') and 'float32' alike. (No cache: torch.compile
    traces this, and a cache filled while it traces fails the guard it just made.)"""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Target:
    """What a plan needs to know about the device: warp (wavefront) width, multiprocessor count and, on NVIDIA GPUs,
    the compute capability as major * 10 + minor (0 elsewhere: AMD, the interpreter)."""

    warp_size: int = 32
    num_sms: int = 4
    cuda_arch: int = 0

    def __hash__(self) -> int:  # the dataclass's own hash rebuilds a tuple on every plan-cache lookup
        return self._hash

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.warp_size, self.num_sms, self.cuda_arch)))


@dataclass(frozen=True)
class BufferSpec:
    shape: tuple[int, ...]
    dtype: str
    zeroed: bool = False  # the executor must zero it before the first launch

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) of a buffer's leading dimension."""

    name: str
    start: int
    stop: int


def rows(name: str, start: int, stop: int, total: int) -> str | Rows:
    """A reference to rows [start, stop) of a buffer of `total` rows: the plain name when that is all of it."""
    return name if (start, stop) == (0, total) else Rows(name, start, stop)


def is_ref(value: Any) -> bool:
    return isinstance(value, (str, Rows))


def ref_name(ref: str | Rows) -> str:
    return ref.name if isinstance(ref, Rows) else ref


def resolve(bufs: Mapping[str, Any], ref: str | Rows) -> Any:
    """The array a reference names; Python slicing makes the view (torch, NumPy) or slice (JAX) of a `Rows`."""
    return bufs[ref.name][ref.start : ref.stop] if isinstance(ref, Rows) else bufs[ref]


@dataclass(frozen=True)
class Launch:
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    reads: tuple  # buffer names (str), python scalars, or None (absent pointer)
    writes: tuple  # buffer names or None
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    # programmatic dependent launch where the launcher has it (torch's eager launches on CUDA sm_90+): the launch may
    # start while the previous launch of its stream runs, once all of that one's programs have called
    # gdc_launch_dependents (or exited); its kernel calls gdc_wait before it touches the previous launch's outputs.
    # A plain launch elsewhere (JAX, torch.compile, the interpreter), where both calls are no-ops.
    pdl: bool = False

    def arguments(self, bufs: Mapping[str, Any], with_writes: bool = True) -> list:
        """Positional kernel arguments: buffers looked up in `bufs`; an absent pointer gets the launch's first buffer
        (any valid pointer: the kernel never dereferences it). jax-triton appends the written buffers itself."""
        anchor = next(resolve(bufs, a) for a in self.reads if is_ref(a))
        names = self.reads + (self.writes if with_writes else ())
        return [resolve(bufs, a) if is_ref(a) else anchor if a is None else a for a in names]


ALIGN = 16  # elements: Triton's divisibility unit for int arguments


def in_units(launch: Launch, *names: str, units: tuple[int, ...] = (ALIGN,)) -> Launch:
    """`launch` with its int arguments `names` (the row widths and strides its addresses are built from) passed in
    units of ALIGN elements and the constexpr UNIT = ALIGN when every one is a multiple of ALIGN; else unchanged with
    UNIT = 1. The kernel multiplies them back by UNIT first: the products are then known multiples of 16, so its rows
    start 16-byte aligned and its loads and stores vectorize whatever the launcher specializes. Triton's own launcher
    (torch) marks int arguments divisible by 16 itself; jax-triton (0.3) does not, and a hint on an argument
    (tl.multiple_of, tl.assume) is lost: without the units its builds load and store element by element.
    `units` lists the units to try, largest first: (16, 8) also vectorizes rows of 8k half-precision elements (16
    bytes) when they are not multiples of 16 (head dims 40, 72, ...)."""
    params = launch.kernel.arg_names
    positions = [params.index(name) for name in names]
    values = [launch.reads[i] for i in positions]
    if any(isinstance(v, (bool, float)) or not hasattr(v, "__index__") for v in values):  # ints or torch SymInts
        raise TypeError(f"{launch.kernel.__name__}: {names} must be int arguments, got {values}")
    # a value that would pass as i64 stays as it is: its quotient could pass as i32 and overflow when multiplied back
    unit = next((u for u in units if all(v % u == 0 and abs(v) < 2**31 for v in values)), 1)
    reads = list(launch.reads)
    for i in positions:
        reads[i] //= unit
    return dataclasses.replace(launch, reads=tuple(reads), constexprs={**launch.constexprs, "UNIT": unit})


@dataclass(frozen=True)
class Gemm:
    """out = op(a) @ op(b), or out += op(a) @ op(b) when `accumulate`; op(x) = x.T when trans_*. Operands are 2-D
    references in one float dtype; products accumulate in fp32 and the result is rounded once to out's dtype (as a
    BLAS GEMM with beta = 0 or 1). Executors run it with their framework's matmul: vendor BLAS speed on a GPU."""

    out: str | Rows
    a: str | Rows
    b: str | Rows
    trans_a: bool = False
    trans_b: bool = False
    accumulate: bool = False

    @property
    def reads(self) -> tuple:
        return (self.a, self.b) + ((self.out,) if self.accumulate else ())

    @property
    def writes(self) -> tuple:
        return (self.out,)


@dataclass(frozen=True)
class Plan:
    inputs: Mapping[str, str]  # name -> dtype of the arrays the caller binds, in this order
    buffers: Mapping[str, BufferSpec]  # allocated by the executor
    launches: tuple[Launch | Gemm, ...]  # the steps, in order
    outputs: tuple[str, ...]  # names returned, in this order (buffers, or inputs written in place)

    def __post_init__(self):
        known = set(self.inputs) | set(self.buffers)
        written = {ref_name(w) for step in self.launches for w in step.writes if w is not None}
        if not written <= known:
            raise AssertionError(f"steps write unknown buffers: {sorted(written - known)}")
        unwritten = [n for n, spec in self.buffers.items() if n not in written and not spec.zeroed]
        if unwritten:
            raise AssertionError(f"buffers {unwritten} are never written and not zeroed")
        for step in self.launches:
            for ref in step.reads:
                if is_ref(ref) and ref_name(ref) not in known:
                    raise AssertionError(f"{step} reads unknown buffer {ref_name(ref)!r}")
        if not set(self.outputs) <= known:
            raise AssertionError(f"unknown outputs: {sorted(set(self.outputs) - known)}")


def written_inputs(plan: Plan) -> set[str]:
    """The plan inputs that its steps update in place."""
    return {ref_name(w) for step in plan.launches for w in step.writes if w is not None} & set(plan.inputs)


def dtype_of(plan: Plan, name: str) -> str:
    return plan.inputs[name] if name in plan.inputs else plan.buffers[name].dtype


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
