"""Executes core Plans of TVM-FFI Calls (the TileLang and CUDA C++ backends, tile_kernels.core.backends) on torch
tensors: buffers from torch's allocator (NaN-poisoned under TILE_KERNELS_POISON=1), each compiled function given the
tensors directly (DLPack, no copies) and run on torch's current stream. torch.compile cannot trace these calls: the
ops that make them are custom ops with fake implementations."""

from __future__ import annotations

import functools

import torch

from tile_kernels.core import Plan, backends

from ._runtime import _LaunchStep, allocate


def platform(device: torch.device) -> str:
    """'cpu', 'cuda' or 'rocm': what tile_kernels.core.backends.resolve needs to know about the device."""
    if device.type == "cpu":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def cuda_arch(device: torch.device) -> int:
    """Compute capability as an int (90 for 9.0): the architecture the kernels are compiled for."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def run_calls(plan: Plan, *inputs: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Runs plan's Calls with `inputs` (compact tensors) bound to plan.inputs; returns plan.outputs. A Triton Launch
    among the Calls (mla_decode's combine) runs as the Triton executor runs it."""
    bufs = dict(zip(plan.inputs, inputs, strict=True))
    bufs |= {name: allocate(s.shape, getattr(torch, s.dtype), s.zeroed, device) for name, s in plan.buffers.items()}
    for step in plan.launches:
        if isinstance(step, backends.Call):
            step.load()(*(bufs[name] for name in step.reads + step.writes), *step.attrs.values())
        else:
            names = list(bufs)
            _LaunchStep(step, {n: i for i, n in enumerate(names)}).run([bufs[n] for n in names], device)
    return tuple(bufs[name] for name in plan.outputs)


@functools.lru_cache(maxsize=256)
def _resolve_eager(op: str, backend: str | None, platform_name: str, preferred: str | None) -> str:
    return backends.resolve(op, backend, platform_name, preferred=preferred)


# resolved while tracing too: torch.compile takes the result as a constant
_resolve_traced = torch.compiler.assume_constant_result(backends.resolve)


def resolve_backend(op: str, backend: str | None, device: torch.device, preferred: str | None = None) -> str:
    """backends.resolve for a call on `device` (`preferred`: the op's choice for the call's inputs), cached outside
    torch.compile (toolchains do not come and go within a process)."""
    cacheable = backend is None or type(backend) is str
    if cacheable and not torch.compiler.is_compiling():
        return _resolve_eager(op, backend, platform(device), preferred)
    return _resolve_traced(op, backend, platform(device), (), preferred)
