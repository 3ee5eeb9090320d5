"""Executes core Plans on torch tensors: buffers from torch's allocator, kernels through `wrap_triton` so that
torch.compile sees them. On CPU tensors the kernels run in Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools
import math

import torch
from torch._functorch import config as functorch_config
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

from tile_kernels.core import Plan, Target
from tile_kernels.core.host import interpreting, poisoning
from tile_kernels.core.plan import Gemm, resolve

_LIBRARY = torch.library.Library("tile_kernels", "FRAGMENT")

if interpreting() and hasattr(functorch_config, "decompose_custom_triton_ops"):
    # AOTAutograd would trace the triton ops' bodies with fake tensors, on which the interpreter launches nothing
    # (run_plan returns the unwritten buffers): a compiled graph would return uninitialized memory. Kept as graph
    # nodes, the ops run the interpreted kernels when the graph runs.
    functorch_config.decompose_custom_triton_ops = False


def register_public_op(schema: str, fn) -> None:
    """torch.ops.tile_kernels.<name>: the public function as a composite op, differentiable through the _fwd op's
    registered autograd."""
    _LIBRARY.define(schema)
    _LIBRARY.impl(schema.split("(")[0], fn, "CompositeImplicitAutograd")


def check_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device, and that device can run the kernels. Returns the device."""
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {where}")
    device = devices.pop()
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{op}: got CPU tensors; the kernels run on CUDA/ROCm devices, or on the CPU in Triton's interpreter "
            "(set TRITON_INTERPRET=1 before importing tile_kernels)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors must be on a CUDA/ROCm device, got {device}")
    return device


@functools.cache
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    warp = getattr(props, "warp_size", 64 if torch.version.hip else 32)
    return Target(warp_size=warp, num_sms=props.multi_processor_count)


def target(device: torch.device) -> Target:
    if device.type == "cpu":
        return Target()
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def as_rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A (rows, n) view of t with unit column stride (copying only when no such view exists), and its row stride."""
    rows = t.reshape(math.prod(t.shape[:-1]), n)
    if n > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0) if rows.shape[0] > 1 else n


def run_plan(plan: Plan, *inputs: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    bufs = dict(zip(plan.inputs, inputs, strict=True))
    poison = poisoning()
    for name, spec in plan.buffers.items():
        dtype = getattr(torch, spec.dtype)
        if spec.zeroed:
            bufs[name] = torch.zeros(spec.shape, dtype=dtype, device=device)
        elif poison and dtype.is_floating_point:
            bufs[name] = torch.full(spec.shape, float("nan"), dtype=dtype, device=device)
        else:
            bufs[name] = torch.empty(spec.shape, dtype=dtype, device=device)
    if interpreting() and any(is_fake(t) for t in inputs):
        return tuple(bufs[name] for name in plan.outputs)  # tracing: shapes only; the interpreter cannot run on fakes
    for launch in plan.launches:
        if isinstance(launch, Gemm):
            _gemm(bufs, launch)
            continue
        wrap_triton(launch.kernel)[launch.grid](
            *launch.arguments(bufs), **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages
        )
    return tuple(bufs[name] for name in plan.outputs)


def _gemm(bufs: dict, step: Gemm) -> None:
    """torch's matmul (cuBLAS / hipBLAS: fp32 accumulation) into the plan's buffer; += through addmm's beta = 1."""
    a, b, out = (resolve(bufs, ref) for ref in (step.a, step.b, step.out))
    a, b = a.t() if step.trans_a else a, b.t() if step.trans_b else b
    if step.accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
