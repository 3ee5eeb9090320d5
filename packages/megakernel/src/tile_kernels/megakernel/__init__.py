"""tile_kernels.megakernel: one decode step of an HF-Llama-layout decoder stack as a graph of tile tasks, scheduled
statically onto per-SM queues for a persistent kernel.

    step = build_decode_step(config, weights)       # config: DecoderConfig or an HF config dict
    hidden = step(token_hidden, kv_cache, position)  # kv_cache (layers, 2, max_seq, kv_heads, head_dim), in place

backend="triton" is the persistent GPU kernel (kernel.py describes it; not built yet: it raises a clear error);
backend="interpreter" runs the same graph and schedule task by task on CPU tensors (interpret.py), the executable
specification the GPU kernel is tested against. reference.decode_step is the eager torch ground truth."""

from __future__ import annotations

import random

from .check import ScheduleError, check_schedule, find_problems
from .config import DecoderConfig
from .graph import Kind, Region, Task, TaskGraph, Tiling, build_graph, pack_weights
from .interpret import DeadlockError, interpret
from .reference import decode_step
from .schedule import Schedule, schedule
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
    """A built decode step: `step(token_hidden, kv_cache, position) -> hidden`, plus its graph and schedule."""

    def __init__(self, config, graph, sched, packed, backend, seed):
        self.config, self.graph, self.schedule, self.backend = config, graph, sched, backend
        self._packed, self._rng = packed, random.Random(seed) if seed is not None else None

    def __call__(self, token_hidden, kv_cache, position: int):
        return interpret(self.graph, self.schedule, self._packed, token_hidden, kv_cache, position, rng=self._rng)


def build_decode_step(
    config,
    weights: dict,
    *,
    backend: str = "triton",
    num_sms: int | None = None,
    tiling: Tiling | None = None,
    context_hint: int | None = None,
    seed: int | None = None,
) -> DecodeStep:
    """Builds the task graph, schedules it on `num_sms` queues (default: the GPU's SM count, or 132 for the
    interpreter), checks the schedule, and returns the step. `tiling` defaults to Tiling.auto; `context_hint` (default
    max_seq) only balances the schedule; `seed` makes the interpreter pick a random legal interleaving per call."""
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

        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(
                f"build_decode_step(backend='triton') needs a CUDA GPU and weights on it, got weights on {device}"
                f" (CUDA available: {torch.cuda.is_available()}); backend='interpreter' runs the same task graph on CPU"
            )
        raise RuntimeError(
            "build_decode_step(backend='triton'): the persistent Triton kernel is not built yet (see "
            "tile_kernels/megakernel/kernel.py for its design); backend='interpreter' runs the task graph on CPU"
        )
    if device.type != "cpu":
        raise ValueError(f"build_decode_step(backend='interpreter'): needs weights on cpu, got {device}")
    num_sms = 132 if num_sms is None else num_sms
    tiling = tiling or Tiling.auto(config, num_sms)
    graph = build_graph(config, tiling, context_hint, weight_bytes=layers[0]["q"].element_size())
    sched = schedule(graph, num_sms)
    check_schedule(graph, sched)
    return DecodeStep(config, graph, sched, pack_weights(config, layers), backend, seed)
