"""What the torch adapters ask about a call's device: its platform and compute capability, and the backend that runs
it (tile_kernels.core.backends.resolve, cached)."""

from __future__ import annotations

import functools

import torch

from tile_kernels.core import backends


def platform(device: torch.device) -> str:
    """'cpu', 'cuda' or 'rocm': what tile_kernels.core.backends.resolve needs to know about the device."""
    if device.type == "cpu":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def cuda_arch(device: torch.device) -> int:
    """Compute capability as an int (90 for 9.0): the architecture the kernels are compiled for."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> int:  # torch.cuda.get_device_capability costs microseconds a call: once a device
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


@functools.lru_cache(maxsize=256)
def _resolve_eager(op: str, backend: str | None, platform_name: str, preferred: str | None) -> str:
    return backends.resolve(op, backend, platform_name, preferred=preferred)


# resolved while tracing too: torch.compile takes the result as a constant
_resolve_traced = torch.compiler.assume_constant_result(backends.resolve)


def resolve_backend(op: str, backend: str | None, device: torch.device, preferred_backend=None, *dims) -> str:
    """backends.resolve for a call on `device`, cached outside torch.compile (toolchains do not come and go within a
    process). backend=None on CUDA takes preferred_backend(compute capability, *dims): the op's core function that
    names its fastest measured backend for the call's inputs."""
    preferred = None
    if backend is None and preferred_backend is not None and device.type == "cuda":
        preferred = preferred_backend(cuda_arch(device), *dims)
    cacheable = backend is None or type(backend) is str
    if cacheable and not torch.compiler.is_compiling():
        return _resolve_eager(op, backend, platform(device), preferred)
    return _resolve_traced(op, backend, platform(device), (), preferred)
