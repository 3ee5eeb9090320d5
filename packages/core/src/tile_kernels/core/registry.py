"""The op registry: what the adapters, the property tests, the AOT matrix and the benchmark iterate over.

Each op module in `tile_kernels.core` describes itself with one `OpInfo` and registers it here. The test suite draws
inputs with `sample`, runs them through every framework adapter and compares against `reference` / `reference_vjp`
(float64 NumPy), so adding an op to the registry adds it to the suite."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Cost:
    """Algorithmic minimum traffic and arithmetic of one call (drives the benchmark's roofline column)."""

    bytes: int
    flops: int


@dataclass(frozen=True)
class BadInput:
    """An invalid call: `changes` overrides sampled arguments; the call must raise `error` matching `match`."""

    changes: Mapping[str, Any]
    error: type
    match: str


def gemm_dims(shape) -> tuple[int, int | None, int]:
    """(M, K, N) of a GEMM op's sample: a benchmark's shape (M, K, N) as it is (K >= 256); else M = the product of the
    leading dims (1 without), K None (the op draws it), N = the last dim (up to 512; wider ones folded to 256 ..
    512)."""
    shape = tuple(shape)
    if len(shape) == 3 and shape[1] >= 256:
        return shape
    n = shape[-1]
    return math.prod(shape[:-1]), None, n if n <= 512 else 256 + n % 257


def not_arrays(op: str, *names: str) -> list[BadInput]:
    """None and a list in place of each required array argument: a TypeError naming it."""
    return [BadInput({name: bad}, TypeError, f"{op}: {name} must be a tensor or array, got {type(bad).__name__}")
            for name in names for bad in (None, [1.0, 2.0])]  # fmt: skip


@dataclass(frozen=True)
class OpInfo:
    name: str
    # sample(rng, shape, dtype, **options) -> dict of keyword arguments (NumPy arrays in `dtype`, plus attributes)
    sample: Callable[..., dict]
    # choices the tests draw for sample's options, e.g. {"residual": (False, True)}
    options: Mapping[str, tuple]
    # reference(**kwargs) -> tuple of the outputs in float64 (intermediates the op returns rounded as it stores them)
    reference: Callable[..., tuple]
    # reference_vjp(kwargs, cotangents) -> {argument name: float64 gradient} for the names in grad_args
    reference_vjp: Callable[[dict, tuple], dict]
    grad_args: tuple[str, ...]
    # cost(kwargs) -> (forward Cost, backward Cost) for the shapes and dtypes of kwargs
    cost: Callable[[dict], tuple[Cost, Cost]]
    # bad_inputs(kwargs) -> invalid variants of a valid call
    bad_inputs: Callable[[dict], list[BadInput]]
    # plans(target) -> every launch configuration the op can choose on that target (the AOT compile matrix)
    plans: Callable[[Any], Iterable[Any]]
    # slack(kwargs) -> per output, the elementwise error the hardware may add beyond rounding the result to the output
    # dtype (fp8_matmul: tensor cores sum e4m3 products at reduced precision); None: rounding only
    slack: Callable[[dict], tuple] | None = None


REGISTRY: dict[str, OpInfo] = {}


def register(info: OpInfo) -> OpInfo:
    if info.name in REGISTRY:
        raise ValueError(f"op {info.name!r} is already registered")
    REGISTRY[info.name] = info
    return info


_BFLOAT16_ROUNDING = ["nearest"]


def set_bfloat16_rounding(mode: str) -> None:
    """How references round the bfloat16 intermediates an op returns (e.g. rms_norm's h), to model the device:
    'nearest' (even), as GPUs do, or 'truncate', as Triton's interpreter converts float32 to bfloat16."""
    if mode not in ("nearest", "truncate"):
        raise ValueError(f"bfloat16 rounding must be 'nearest' or 'truncate', got {mode!r}")
    _BFLOAT16_ROUNDING[0] = mode


def round_to(array: np.ndarray, dtype: str) -> np.ndarray:
    """Round a float array to `dtype` ('float32', 'float16', 'bfloat16', 'float8_e4m3fn'), as the op's stored
    tensors are."""
    if dtype == "float8_e4m3fn":
        import ml_dtypes

        return np.asarray(array).astype(ml_dtypes.float8_e4m3fn)
    if dtype == "bfloat16":
        import ml_dtypes

        if _BFLOAT16_ROUNDING[0] == "truncate":
            bits = np.asarray(array, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
            return bits.view(np.float32).astype(ml_dtypes.bfloat16)
        return np.asarray(array).astype(ml_dtypes.bfloat16)
    return np.asarray(array).astype(dtype)
