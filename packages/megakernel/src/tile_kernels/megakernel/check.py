"""Schedule checker: every property the persistent kernel relies on to finish and to read only finished data.

1. every task is scheduled exactly once; counters and task ids are in range;
2. each wait's threshold equals the number of tasks that signal its counter (and that number is > 0);
3. the task graph (producer -> consumer through counters) is acyclic;
4. no queue waits on a counter that a task at the same or a later position of the same queue signals;
5. the queues together finish: a simulation that runs any queue head whose waits are met empties every queue
   (this catches cross-queue cycles that 3 and 4 miss); stuck heads are reported with their waits;
6. no data race: writes are disjoint, every element a task reads (outside the step's inputs) is written by some task,
   and every writer of a region a task reads is an ancestor of that task."""

from __future__ import annotations

import bisect
from collections import deque

from .graph import TaskGraph
from .schedule import Schedule


class ScheduleError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        super().__init__(f"invalid schedule ({len(problems)} problems):\n  {shown}")


def check_schedule(graph: TaskGraph, sched: Schedule) -> None:
    """Raises ScheduleError listing every problem found."""
    problems = find_problems(graph, sched)
    if problems:
        raise ScheduleError(problems)


def run_queues(graph: TaskGraph, queues, pick=None) -> tuple[list[int], list[tuple[int, int]]]:
    """Executes the queues abstractly: repeatedly runs a head whose waits are met (`pick(runnable queue ids)` chooses,
    default the lowest). Returns (the order in which tasks ran, [(queue, stuck head task id)] when it could not
    finish). Shared by the checker and the interpreter."""
    value = [0] * len(graph.counters)
    pos = [0] * len(queues)
    blocked: dict[int, list[int]] = {}  # counter -> queues whose head waits on it
    runnable = set()

    def park(q: int) -> None:
        if pos[q] == len(queues[q]):
            return
        for cid, threshold in graph.tasks[queues[q][pos[q]]].waits:
            if value[cid] < threshold:
                blocked.setdefault(cid, []).append(q)
                return
        runnable.add(q)

    for q in range(len(queues)):
        park(q)
    order = []
    while runnable:
        q = pick(sorted(runnable)) if pick else min(runnable)
        runnable.discard(q)
        task = graph.tasks[queues[q][pos[q]]]
        order.append(task.id)
        pos[q] += 1
        value[task.signal] += 1
        for waiter in blocked.pop(task.signal, []):
            park(waiter)
        park(q)
    stuck = [(q, queues[q][pos[q]]) for q in range(len(queues)) if pos[q] < len(queues[q])]
    return order, stuck


def describe_stuck(graph: TaskGraph, order: list[int], stuck: list[tuple[int, int]]) -> list[str]:
    value = [0] * len(graph.counters)
    for tid in order:
        value[graph.tasks[tid].signal] += 1
    out = []
    for q, tid in stuck:
        task = graph.tasks[tid]
        waits = ", ".join(f"{graph.counters[c]} = {value[c]} < {th}" for c, th in task.waits if value[c] < th)
        out.append(f"queue {q} stuck at {task.label} waiting for {waits}")
    return out


def find_problems(graph: TaskGraph, sched: Schedule) -> list[str]:
    tasks, ncounters, problems = graph.tasks, len(graph.counters), []
    # 1. coverage
    seen: dict[int, tuple[int, int]] = {}
    for q, queue in enumerate(sched.queues):
        for i, tid in enumerate(queue):
            if not 0 <= tid < len(tasks):
                problems.append(f"queue {q}[{i}]: unknown task id {tid}")
            elif tid in seen:
                problems.append(f"queue {q}[{i}]: {tasks[tid].label} already scheduled at queue {seen[tid][0]}")
            else:
                seen[tid] = (q, i)
    problems += [f"{t.label} is not scheduled" for t in tasks if t.id not in seen]
    for t in tasks:
        bad = [c for c, _ in t.waits if not 0 <= c < ncounters] + ([t.signal] if not 0 <= t.signal < ncounters else [])
        problems += [f"{t.label}: unknown counter {c}" for c in bad]
    if problems:
        return problems
    # 2. thresholds
    producers = graph.producers()
    for t in tasks:
        for c, threshold in t.waits:
            if threshold != len(producers[c]) or threshold < 1:
                problems.append(
                    f"{t.label} waits for {graph.counters[c]} >= {threshold}, but {len(producers[c])} tasks signal it"
                )
    # 3. acyclic (Kahn), which also yields a topological order for 6
    consumers: list[list[int]] = [[] for _ in range(ncounters)]
    indegree = [0] * len(tasks)
    for t in tasks:
        for c, _ in t.waits:
            consumers[c].append(t.id)
            indegree[t.id] += len(producers[c])
    ready = deque(t.id for t in tasks if indegree[t.id] == 0)
    topo = []
    while ready:
        tid = ready.popleft()
        topo.append(tid)
        for consumer in consumers[tasks[tid].signal]:
            indegree[consumer] -= 1
            if indegree[consumer] == 0:
                ready.append(consumer)
    if len(topo) < len(tasks):
        cyclic = [tasks[i].label for i in range(len(tasks)) if indegree[i] > 0]
        problems.append(f"the task graph has a cycle through {len(cyclic)} tasks, e.g. {cyclic[:5]}")
    # 4. queue order
    for q, queue in enumerate(sched.queues):
        for i, tid in enumerate(queue):
            for c, _ in tasks[tid].waits:
                for p in producers[c]:
                    pq, pi = seen[p]
                    if pq == q and pi >= i:
                        problems.append(
                            f"queue {q}[{i}]: {tasks[tid].label} waits for {graph.counters[c]}, which "
                            f"{tasks[p].label} signals later in the same queue (position {pi})"
                        )
    # 5. the queues finish
    order, stuck = run_queues(graph, sched.queues)
    if stuck:
        problems += ["deadlock: " + s for s in describe_stuck(graph, order, stuck)]
    if len(topo) == len(tasks):
        problems += _races(graph, producers, topo)
    return problems


def _races(graph: TaskGraph, producers: list[list[int]], topo: list[int]) -> list[str]:
    tasks, problems = graph.tasks, []
    writers: dict[str, list[tuple[int, int, int]]] = {}
    for t in tasks:
        for r in t.writes:
            if r.buffer in graph.inputs:
                problems.append(f"{t.label} writes {r.buffer}, an input of the step")
            writers.setdefault(r.buffer, []).append((r.lo, r.hi, t.id))
    for name, ranges in writers.items():
        ranges.sort()
        for (_, ahi, a), (blo, bhi, b) in zip(ranges, ranges[1:]):
            if blo < ahi:
                problems.append(f"{tasks[a].label} and {tasks[b].label} both write {name}[{blo}:{min(ahi, bhi)}]")
    ancestors = [0] * len(tasks)  # bitsets
    for tid in topo:
        bits = 0
        for c, _ in tasks[tid].waits:
            for p in producers[c]:
                bits |= ancestors[p] | (1 << p)
        ancestors[tid] = bits
    starts = {name: [lo for lo, _, _ in ranges] for name, ranges in writers.items()}
    for t in tasks:
        for r in t.reads:
            if r.buffer in graph.inputs:
                continue
            ranges, covered = writers.get(r.buffer, []), r.lo
            for lo, hi, w in ranges[: bisect.bisect_left(starts.get(r.buffer, []), r.hi)]:
                if lo < r.hi and r.lo < hi:
                    if lo > covered:
                        break
                    covered = max(covered, hi)
                    if not (ancestors[t.id] >> w) & 1:
                        problems.append(
                            f"race: {t.label} reads {r.buffer}[{max(lo, r.lo)}:{min(hi, r.hi)}], which "
                            f"{tasks[w].label} writes, without depending on it"
                        )
            if covered < r.hi:
                problems.append(f"{t.label} reads {r.buffer}[{covered}:{r.hi}], which no task writes")
    return problems
