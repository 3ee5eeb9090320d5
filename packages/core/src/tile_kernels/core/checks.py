"""Input validation shared by every op: clear errors naming the op, the argument, the expected and the received value.

Arrays are anything with `.shape` and `.dtype` (torch tensors, JAX arrays, NumPy arrays)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from .plan import FLOAT_DTYPES, dtype_name


def check_array(op: str, name: str, array: Any) -> None:
    """Something with a shape and a dtype (a tensor or an array), not None, a list or a number."""
    if not (hasattr(array, "shape") and hasattr(array, "dtype")):
        raise TypeError(f"{op}: {name} must be a tensor or array, got {type(array).__name__}")


def check_float(op: str, name: str, array: Any) -> str:
    check_array(op, name, array)
    dtype = dtype_name(array.dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must have dtype float32, float16 or bfloat16, got {dtype}")
    return dtype


def check_min_ndim(op: str, name: str, array: Any, ndim: int) -> None:
    check_array(op, name, array)
    if len(array.shape) < ndim:
        raise ValueError(f"{op}: {name} must have at least {ndim} dimension(s), got shape {tuple(array.shape)}")


def check_shape(op: str, name: str, array: Any, expected: tuple[int, ...], what: str) -> None:
    check_array(op, name, array)
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {tuple(expected)} ({what}), got {tuple(array.shape)}")


def check_same_dtype(op: str, name: str, array: Any, dtype: str, what: str) -> None:
    check_array(op, name, array)
    got = dtype_name(array.dtype)
    if got != dtype:
        raise TypeError(f"{op}: {name} must have dtype {dtype} ({what}), got {got}")


def check_block_table(op: str, block_table: Any, batch: int, owner: str, cache_name: str, cache: Any, layout: str):
    """A paged cache's block table: int32 (batch, max_pages), batch = that of `owner`; the cache (num_blocks,
    page_size, ...) with a page size of at least 1 (`layout` names its dims in the message)."""
    check_same_dtype(op, "block_table", block_table, "int32", "page indices")
    if len(block_table.shape) != 2 or block_table.shape[0] != batch:
        raise ValueError(f"{op}: block_table must have shape (batch, max_pages) with batch {batch} ({owner}'s), got "
                         f"{tuple(block_table.shape)}")  # fmt: skip
    if cache.shape[1] == 0:
        raise ValueError(f"{op}: a paged {cache_name} {layout} needs a page_size of at least 1, got shape "
                         f"{tuple(cache.shape)}")  # fmt: skip


def check_positive(op: str, name: str, value: Any) -> float:
    """A finite real number > 0, as a float."""
    number = check_real(op, name, value, "a finite number > 0")
    if not number > 0:
        raise ValueError(f"{op}: {name} must be a finite number > 0, got {value!r}")
    return number


def check_int(op: str, name: str, value: Any, what: str = "an int") -> int:
    """A Python or NumPy integer (not a bool), as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be {what}, got {value!r}")
    return int(value)


def check_real(op: str, name: str, value: Any, what: str = "a finite number") -> float:
    """A finite Python or NumPy real number (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be {what}, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}")
    return number


def normalize_dim(op: str, dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or not -max(ndim, 1) <= dim < max(ndim, 1):
        raise ValueError(f"{op}: dim must be an int in [{-ndim}, {ndim - 1}] for a {ndim}-d input, got {dim!r}")
    return dim % max(ndim, 1)
