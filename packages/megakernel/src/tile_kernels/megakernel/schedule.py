"""Static assignment of the graph's tasks to per-SM queues.

List scheduling in the graph's topological order: each task goes to the SM where it can start first, its start being
max(the SM's estimated finish, the latest estimated finish of its producers), its cost `overhead_ns + bytes /
sm_bandwidth`, or its measured run time (a Trace's `costs_ns`: what the bytes do not say, e.g. attention tasks
bound by latency). Each queue is a subsequence of one global topological order, so with every SM resident at once
(cooperative launch) the queues cannot deadlock; check.py verifies that instead of trusting it."""

from __future__ import annotations

from dataclasses import dataclass

from .graph import TaskGraph


@dataclass(frozen=True)
class Schedule:
    queues: tuple[tuple[int, ...], ...]  # SM -> task ids in execution order
    est_finish_ns: float = 0.0  # the list scheduler's makespan estimate

    @property
    def num_sms(self) -> int:
        return len(self.queues)


def schedule(
    graph: TaskGraph,
    num_sms: int,
    sm_bandwidth: float = 4.8e12 / 132,
    overhead_ns: float = 300.0,
    costs_ns=None,
) -> Schedule:
    """`sm_bandwidth` (bytes/s one SM streams; default: an H200's HBM shared by 132 SMs) and `overhead_ns` (per task:
    launch of the tile, waits, signal) only shape the balance; `costs_ns` (one number a task, by id, e.g.
    Trace.costs_ns() of a traced step of the same graph) replaces the bytes model with measured run times."""
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"schedule: num_sms must be an int >= 1, got {num_sms!r}")
    if costs_ns is not None:
        costs_ns = [float(c) for c in costs_ns]
        if len(costs_ns) != len(graph.tasks) or min(costs_ns, default=0.0) < 0:
            raise ValueError(f"schedule: costs_ns must hold a number >= 0 for each of the graph's {len(graph.tasks)} "
                             f"tasks, got {len(costs_ns)} (min {min(costs_ns, default=0.0)})")  # fmt: skip
    producers = graph.producers()
    counter_ready = [0.0] * len(graph.counters)
    free = [0.0] * num_sms
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    done = [0] * len(graph.counters)
    for task in graph.tasks:
        for cid, _ in task.waits:
            if done[cid] != len(producers[cid]):
                raise ValueError(f"schedule: the graph is not in topological order at {task.label}")
        ready = max((counter_ready[cid] for cid, _ in task.waits), default=0.0)
        sm = min(range(num_sms), key=lambda i: (max(free[i], ready), free[i]))
        cost = costs_ns[task.id] if costs_ns is not None else overhead_ns + task.bytes / sm_bandwidth * 1e9
        free[sm] = max(free[sm], ready) + cost
        queues[sm].append(task.id)
        counter_ready[task.signal] = max(counter_ready[task.signal], free[sm])
        done[task.signal] += 1
    return Schedule(queues=tuple(tuple(q) for q in queues), est_finish_ns=max(free))


TASK_FIELDS = ("kind", "layer", "lo", "hi", "split", "wait_begin", "wait_end", "signal")


def encode(graph: TaskGraph, sched: Schedule) -> dict:
    """The int32 tables the persistent kernel reads (NumPy; the launcher copies them to the GPU once per build):
    tasks (num_tasks, 8) with columns TASK_FIELDS, waits (num_waits, 2) = (counter, threshold) rows
    tasks[:, 5]:tasks[:, 6] of each task, queue_ptr (num_sms + 1,) and queue_tasks: SM i runs
    queue_tasks[queue_ptr[i]:queue_ptr[i + 1]] in order."""
    import numpy as np

    tasks = np.zeros((len(graph.tasks), len(TASK_FIELDS)), np.int32)
    waits = []
    for t in graph.tasks:
        tasks[t.id] = (int(t.kind), t.layer, t.lo, t.hi, t.split, len(waits), len(waits) + len(t.waits), t.signal)
        waits += t.waits
    lengths = [len(q) for q in sched.queues]
    return {
        "tasks": tasks,
        "waits": np.asarray(waits, np.int32).reshape(-1, 2),
        "queue_ptr": np.cumsum([0, *lengths], dtype=np.int64).astype(np.int32),
        "queue_tasks": np.asarray([t for q in sched.queues for t in q], np.int32),
        "num_counters": len(graph.counters),
    }
