"""A decode step's timeline: when each task of the persistent kernel waited, ran and ended, on which program (SM).

    hidden, trace = step.trace(token_hidden, kv_cache, position)   # one traced step (DecodeStep.trace)
    trace.save("step.json")     # Chrome trace: open in Perfetto or chrome://tracing, a row per SM
    print(trace.table())        # time per task kind beside its bytes
    trace.plot("step.png")      # SM x time, colored by kind (needs matplotlib)

The kernel (decode_kernel with TRACING) writes, per task, %globaltimer at three points: before its waits, after them
(the CTA barrier passed), and after its body's stores are issued (before the release). Times are ns from the step's
first timestamp. Under Triton's interpreter the clock is logical (queue order, kernel._now): the format and the
bookkeeping, not time. A traced step runs the same code as an untraced one plus four global stores a task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .graph import Kind, TaskGraph

FIELDS = ("wait", "run", "end", "program")


@dataclass(frozen=True)
class Trace:
    """`times` (num_tasks, 4) int64: per task (wait start, run start, end, program), times in ns from the first
    timestamp of the step (-1 for a task that did not run: an aborted step)."""

    graph: TaskGraph
    times: np.ndarray
    clock: str  # "globaltimer ns" or "logical (interpreter)"

    @classmethod
    def from_raw(cls, graph: TaskGraph, raw, interpreted: bool) -> Trace:
        times = np.asarray(raw, dtype=np.int64).reshape(len(graph.tasks), len(FIELDS)).copy()
        stamps = times[:, :3]
        ran = stamps >= 0
        if ran.any():
            stamps[ran] -= stamps[ran].min()
        return cls(graph, times, "logical (interpreter)" if interpreted else "globaltimer ns")

    @property
    def span_ns(self) -> int:
        """From the first task's wait to the last task's end."""
        return int(self.times[:, 2].max()) if len(self.times) else 0

    def costs_ns(self) -> list[float]:
        """Each task's run time (ns; the step's median for a task that did not run): schedule(..., costs_ns=...) and
        build_decode_step(..., task_costs=...) balance the queues by it instead of by estimated bytes."""
        runs = (self.times[:, 2] - self.times[:, 1]).astype(float)
        ran = self.times[:, 2] >= 0
        fill = float(np.median(runs[ran])) if ran.any() else 0.0
        return np.where(ran, runs, fill).tolist()

    def events(self) -> list[dict]:
        """One dict a task: label, kind, layer, program, wait / run / end (ns), estimated bytes."""
        out = []
        for task, (wait, run, end, program) in zip(self.graph.tasks, self.times.tolist(), strict=True):
            out.append(dict(task=task.label, kind=Kind(task.kind).name, layer=task.layer, program=program,
                            wait=wait, run=run, end=end, bytes=task.bytes))  # fmt: skip
        return out

    def chrome(self) -> dict:
        """The Chrome trace-event format: a complete ("X") event per task body and per wait longer than 0, on a
        thread per program; timestamps in us."""
        trace_events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "decode step"}}]
        for e in self.events():
            if e["end"] < 0:
                continue
            args = {"layer": e["layer"], "bytes": e["bytes"]}
            if e["run"] > e["wait"]:
                trace_events.append(dict(name="wait", cat="wait", ph="X", pid=0, tid=e["program"], ts=e["wait"] / 1e3,
                                         dur=(e["run"] - e["wait"]) / 1e3, args={"before": e["task"]}))  # fmt: skip
            trace_events.append(dict(name=e["task"], cat=e["kind"], ph="X", pid=0, tid=e["program"],
                                     ts=e["run"] / 1e3, dur=(e["end"] - e["run"]) / 1e3, args=args))  # fmt: skip
        return {"traceEvents": trace_events, "displayTimeUnit": "ns", "otherData": {"clock": self.clock}}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome(), f)

    def table(self) -> str:
        """Markdown: per task kind, the tasks, their summed run and wait time, the estimated bytes and the bandwidth
        one SM got while running them (bytes / run time), and the kind's share of the SMs' busy time."""
        runs = self.times[:, 2] - self.times[:, 1]
        waits = self.times[:, 1] - self.times[:, 0]
        busy = max(1, int(runs[self.times[:, 2] >= 0].sum()))
        lines = [
            f"step {self.span_ns / 1e3:.1f} us ({self.clock}), {len(set(self.times[:, 3].tolist()))} programs",
            "",
            "| kind | tasks | run us (sum) | wait us (sum) | MB (estimated) | GB/s an SM running | share of busy |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind in Kind:
            rows = [i for i, t in enumerate(self.graph.tasks) if t.kind == kind and self.times[i, 2] >= 0]
            if not rows:
                continue
            run, wait = int(runs[rows].sum()), int(waits[rows].sum())
            nbytes = sum(self.graph.tasks[i].bytes for i in rows)
            gbs = f"{nbytes / run:.1f}" if run else ""
            lines.append(f"| {kind.name} | {len(rows)} | {run / 1e3:.1f} | {wait / 1e3:.1f} | {nbytes / 1e6:.2f} | "
                         f"{gbs} | {100 * run / busy:.0f}% |")  # fmt: skip
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """SM (program) x time, a bar per task body colored by kind, waits in grey."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("Trace.plot needs matplotlib (pip install matplotlib)") from e
        programs = int(self.times[:, 3].max()) + 1 if len(self.times) else 1
        fig, ax = plt.subplots(figsize=(14, max(3, programs * 0.06)))
        colors = dict(zip(Kind, plt.get_cmap("tab10").colors, strict=False))
        bars = {}  # (program, kind or None for a wait) -> its (start, width) ranges: one artist each, not one a task
        for task, (wait, run, end, program) in zip(self.graph.tasks, self.times.tolist(), strict=True):
            if end >= 0:
                bars.setdefault((program, None), []).append((wait / 1e3, (run - wait) / 1e3))
                bars.setdefault((program, Kind(task.kind)), []).append((run / 1e3, (end - run) / 1e3))
        for (program, kind), ranges in bars.items():
            ax.broken_barh(ranges, (program, 0.9), color="0.85" if kind is None else colors[kind])
        ax.set_xlabel("us" if self.clock.startswith("globaltimer") else "logical ticks / 1000")
        ax.set_ylabel("program (SM)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=k.name) for k, c in colors.items()]
        handles.append(plt.Rectangle((0, 0), 1, 1, color="0.85", label="wait"))
        ax.legend(handles=handles, loc="upper right", fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
