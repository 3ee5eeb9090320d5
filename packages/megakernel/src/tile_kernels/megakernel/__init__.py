"""tile_kernels.megakernel: one decode step of an HF-Llama-layout decoder stack as a graph of tile tasks, scheduled
statically onto per-SM queues for a persistent kernel.

    step = build_decode_step(config, weights)       # config: DecoderConfig or an HF config dict
    hidden = step(token_hidden, kv_cache, position)  # kv_cache (layers, 2, max_seq, kv_heads, head_dim), in place
    hidden, trace = step.trace(token_hidden, kv_cache, position)  # the same, timed task by task (trace.py)

backend="triton" is the persistent Triton kernel (kernel.py: one launch a step on a CUDA GPU; Triton's interpreter
on CPU tensors with TRITON_INTERPRET=1); backend="interpreter" runs the same graph and schedule task by task on CPU
tensors (interpret.py), the executable specification the kernel is tested against. reference.decode_step is the
eager torch ground truth."""

from __future__ import annotations

import random

from .check import ScheduleError, check_schedule, find_problems
from .config import DecoderConfig
from .graph import Kind, Region, Task, TaskGraph, Tiling, build_graph, pack_weights
from .interpret import DeadlockError, interpret
from .reference import decode_step
from .schedule import Schedule, schedule
from .trace import FIELDS, Trace
from .weights import layer_weights

__all__ = [
    "DeadlockError",
    "DecodeStep",
    "DecoderConfig",
    "Kind",
    "Region",
    "Schedule",
    "ScheduleError",
    "Task",
    "TaskGraph",
    "Tiling",
    "Trace",
    "build_decode_step",
    "build_graph",
    "check_schedule",
    "decode_step",
    "find_problems",
    "interpret",
    "pack_weights",
    "schedule",
]

BACKENDS = ("triton", "interpreter")


class DecodeStep:
    """A built decode step: `step(token_hidden, kv_cache, position) -> hidden`, plus its graph and schedule;
    `kernel` is the persistent kernel's launcher (kernel.Megakernel) for backend="triton"."""

    def __init__(self, config, graph, sched, packed, backend, seed, kernel=None):
        self.config, self.graph, self.schedule, self.backend, self.kernel = config, graph, sched, backend, kernel
        self._packed, self._rng = packed, random.Random(seed) if seed is not None else None

    def __call__(self, token_hidden, kv_cache, position: int):
        if self.kernel is not None:
            return self.kernel(token_hidden, kv_cache, position)
        return interpret(self.graph, self.schedule, self._packed, token_hidden, kv_cache, position, rng=self._rng)

    def trace(self, token_hidden, kv_cache, position: int) -> tuple:
        """One step as `step(...)` (kv_cache updated in place), timed task by task inside the kernel: returns
        (hidden, Trace); Trace.save writes a Chrome trace, .table() the time per task kind, .plot() a PNG."""
        if self.kernel is None:
            raise ValueError(
                "DecodeStep.trace: needs backend='triton' (the persistent kernel times its own tasks), got "
                f"backend={self.backend!r}"
            )
        import torch

        raw = torch.full((len(self.graph.tasks), len(FIELDS)), -1, dtype=torch.int64, device=self.kernel.device)
        hidden = self.kernel(token_hidden, kv_cache, position, trace=raw)
        return hidden, Trace.from_raw(self.graph, raw.cpu().numpy(), self.kernel.interpret)


def build_decode_step(
    config,
    weights: dict,
    *,
    backend: str = "triton",
    num_sms: int | None = None,
    tiling: Tiling | None = None,
    context_hint: int | None = None,
    seed: int | None = None,
    debug: bool = False,
    timeout_s: float = 1.0,
    tile_budget: int | None = None,
    task_costs=None,
) -> DecodeStep:
    """Builds the task graph, schedules it on `num_sms` queues (default: the GPU's SM count, or 132 on a CPU), checks
    the schedule, and returns the step. `tiling` defaults to Tiling.auto; `context_hint` (default max_seq) only
    balances the schedule; `seed` picks a random legal interleaving of the queues (per call for the interpreter
    backend, once for the Triton kernel on a CPU).

    backend="triton": the persistent kernel, one launch a step; weights on a CUDA GPU (grid = num_sms, cooperative
    launch), or on the CPU with TRITON_INTERPRET=1 (Triton's interpreter, grid=(1,), one queue holding every task in
    a legal order). debug=True arms the watchdog: a wait longer than `timeout_s` aborts the step and the call raises a
    RuntimeError naming the stuck task and counter (each call then synchronizes). `tile_budget` (default
    kernel.TILE_BUDGET) is the elements of a GEMV weight tile (Megakernel).
    `task_costs`: a Trace of a step built with the same arguments (or its costs_ns()): the queues balanced by measured
    run times instead of estimated bytes.
    backend="interpreter": the reference interpreter of the same graph and schedule (CPU tensors)."""
    if backend not in BACKENDS:
        raise ValueError(f"build_decode_step: backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(config, dict):
        config = DecoderConfig.from_hf(config)
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"build_decode_step: config must be a DecoderConfig or an HF config dict, got {type(config)}")
    layers = layer_weights(config, weights)
    device = layers[0]["q"].device
    if backend == "triton":
        import torch

        from tile_kernels.core.host import interpreting

        if device.type == "cpu" and not interpreting():
            raise RuntimeError(
                "build_decode_step(backend='triton') needs a CUDA GPU and weights on it, or TRITON_INTERPRET=1 set "
                f"before importing triton to run the kernel on the CPU; got weights on {device} (CUDA available: "
                f"{torch.cuda.is_available()}); backend='interpreter' runs the same task graph on CPU"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"build_decode_step(backend='triton'): needs weights on cuda or cpu, got {device}")
        if num_sms is None and device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    elif device.type != "cpu":
        raise ValueError(f"build_decode_step(backend='interpreter'): needs weights on cpu, got {device}")
    num_sms = 132 if num_sms is None else num_sms
    tiling = tiling or Tiling.auto(config, num_sms)
    graph = build_graph(config, tiling, context_hint, weight_bytes=layers[0]["q"].element_size())
    if isinstance(task_costs, Trace):
        if [t.label for t in task_costs.graph.tasks] != [t.label for t in graph.tasks]:
            raise ValueError("build_decode_step: task_costs is the trace of another graph (other config or tiling)")
        task_costs = task_costs.costs_ns()
    sched = schedule(graph, num_sms, costs_ns=task_costs)
    check_schedule(graph, sched)
    packed = pack_weights(config, layers)
    kernel = None
    if backend == "triton":
        from .kernel import TILE_BUDGET, Megakernel

        budget = TILE_BUDGET if tile_budget is None else tile_budget
        kernel = Megakernel(graph, sched, packed, device, debug=debug, timeout_s=timeout_s, seed=seed,
                            tile_budget=budget)  # fmt: skip
        packed = None  # the kernel holds its own copy (the weight arena)
    return DecodeStep(config, graph, sched, packed, backend, seed, kernel)
