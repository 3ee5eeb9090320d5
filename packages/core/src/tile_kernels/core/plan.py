"""Framework-neutral launch plans.

An op's forward or backward is a `Plan`: the buffers it allocates and an ordered list of Triton kernel launches over
named buffers. The torch adapter, the JAX adapter (jax-triton) and the host interpreter each execute the same plan; no
kernel logic lives in the adapters.

Kernel parameter order (the jax-triton convention, which the others accept too): the buffers the launch reads and the
scalars, in any order, then the buffers it writes, then the constexprs. A buffer is written by at most one launch; one
that no launch writes (an empty problem) must be `zeroed`. An absent optional pointer is `None`; the kernel must not
touch it (a constexpr flag says so); executors pass another buffer of the launch in its place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, jnp.float32, np.dtype('float32') and 'float32' alike."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Target:
    """What a plan needs to know about the device: warp (wavefront) width and multiprocessor count."""

    warp_size: int = 32
    num_sms: int = 4


@dataclass(frozen=True)
class BufferSpec:
    shape: tuple[int, ...]
    dtype: str
    zeroed: bool = False  # the executor must zero it before the first launch

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Launch:
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    reads: tuple  # buffer names (str), python scalars, or None (absent pointer)
    writes: tuple  # buffer names or None
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def arguments(self, bufs: Mapping[str, Any], with_writes: bool = True) -> list:
        """Positional kernel arguments: buffers looked up in `bufs`; an absent pointer gets the launch's first buffer
        (any valid pointer: the kernel never dereferences it). jax-triton appends the written buffers itself."""
        anchor = next(bufs[a] for a in self.reads if isinstance(a, str))
        names = self.reads + (self.writes if with_writes else ())
        return [bufs[a] if isinstance(a, str) else anchor if a is None else a for a in names]


@dataclass(frozen=True)
class Plan:
    inputs: Mapping[str, str]  # name -> dtype of the arrays the caller binds, in this order
    buffers: Mapping[str, BufferSpec]  # allocated by the executor
    launches: tuple[Launch, ...]
    outputs: tuple[str, ...]  # names returned, in this order

    def __post_init__(self):
        written = [w for launch in self.launches for w in launch.writes if w is not None]
        if len(written) != len(set(written)) or not set(written) <= set(self.buffers):
            raise AssertionError(f"a buffer is written by more than one launch or is unknown: {written}")
        unwritten = [n for n, spec in self.buffers.items() if n not in written and not spec.zeroed]
        if unwritten:
            raise AssertionError(f"buffers {unwritten} are never written and not zeroed")
        known = set(self.inputs) | set(self.buffers)
        for launch in self.launches:
            for name in launch.reads:
                if isinstance(name, str) and name not in known:
                    raise AssertionError(f"{launch.kernel} reads unknown buffer {name!r}")


def dtype_of(plan: Plan, name: str) -> str:
    return plan.inputs[name] if name in plan.inputs else plan.buffers[name].dtype


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
