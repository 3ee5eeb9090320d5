"""The persistent Triton kernel that will run a checked schedule in one launch. Written so far: `run_tasks`, the task
bodies of NORM, QKV, OPROJ (with the attention-split combine), GATEUP and DOWN in one @triton.jit dispatcher, run by a
single program over a list of task ids (grid=(1,), Triton's interpreter on CPU in the tests). Not written yet: ROPE,
ATTN, the per-SM queues with counters and spinning, prefetch, the watchdog, and any GPU run; build_decode_step
(backend="triton") says so. The design of the rest follows.

Launch. grid = (num_sms,), one CTA per SM, launched with Triton's `launch_cooperative_grid=True`, so that a grid larger
than what can be co-resident fails at launch instead of spinning forever on a CTA that never starts. The schedule's
deadlock-freedom (check.py, rule 5) assumes every queue runs concurrently; the cooperative launch guarantees that.

Task encoding. schedule.encode gives int32 tables, copied to the GPU once per build: `tasks` (num_tasks, 8) =
(kind, layer, lo, hi, split, wait_begin, wait_end, signal), `waits` (num_waits, 2) = (counter, threshold), and the
queues in CSR form (`queue_ptr`, `queue_tasks`). Buffer addresses are not in the table: each kind derives them from
(layer, lo, hi, split) and per-layer base pointers (one int64 pointer table per buffer kind: weights, scratch, KV
cache), as interpret._run_task does with names. CTA `pid` loops over queue_tasks[queue_ptr[pid]:queue_ptr[pid + 1]] and
dispatches on `kind` with an if-chain of @triton.jit device functions whose tile shapes are constexpr (BLOCK_N >= the
largest tile of Tiling; rows >= hi masked), so one compiled kernel serves every task.

Counter protocol. `counters` is an int32 array, zeroed once at allocation and never reset: launch e (e = 1, 2, ...)
waits for `epoch * threshold`, so no memset sits between steps (the host zeroes it again before int32 would wrap).
  producer: the tile's global stores -> CTA barrier (tl.debug_barrier: every warp's stores issued) -> one thread does
    `atom.add.release.gpu` (tl.atomic_add(counter, 1, sem="release", scope="gpu") on a scalar) -> next task.
  consumer: for each wait, spin on an acquire load, `ld.acquire.gpu.global.b32` through tl.inline_asm_elementwise
    (a scalar tl.atomic_add(..., sem="acquire") in a loop emits a bar.sync per iteration, triton#7125), with
    `nanosleep.u32 64..1024` backoff between polls; then a CTA barrier so no warp reads before the value is seen.
  Every buffer is written once per launch (graph.py), so there are only read-after-write edges: no WAR counters.

Prefetch. Weights never depend on counters. Before spinning on task i's waits the CTA issues task i's first weight
tile loads (register/shared destination, consumed after the wait) and an L2 prefetch (`cp.async.bulk.prefetch.L2` /
`prefetch.global.L2::evict_last` via inline asm) of task i + 1's weight rows, so HBM stays busy while a CTA waits: the
step is bandwidth-bound (Llama-3.2-1B: ~1.9 GB of bf16 weights, floor ~460 us on an H200).

Task bodies (batch 1, fp32 accumulation, activations fp32 scratch, weights and KV cache in the model dtype):
  NORM   one CTA reduces sum(x^2) over `hidden` and writes n = x * rsqrt(mean + eps) * w;
  QKV / OPROJ / GATEUP / DOWN  GEMV tiles: rows [lo, hi) of W times a vector, K streamed in BLOCK_K chunks; OPROJ
         first combines the attention partials of all splits, DOWN and OPROJ add the residual rows;
  ROPE   rotates the group's q heads and k_g with cos/sin computed from `position` in-kernel, writes the KV cache row;
  ATTN   split s of positions 0..position of KV group g for its G q heads: (m, l, o) partials into `att`.

Watchdog (debug=True). Each spin reads `globaltimer` (triton.language.extra.cuda.globaltimer) and, past a timeout
(default 1 s), writes (pid, task id, counter, value seen, expected) to an error record, sets an abort flag that every
other spinning CTA also polls, and returns. The host synchronizes, finds the record set, and raises a RuntimeError
naming the stuck task and counter with the labels of graph.tasks / graph.counters (the format of check.describe_stuck).

Testing plan. On CPU, the same kernel with grid=(1,) in Triton's interpreter runs one queue holding the tasks in
the order check.run_queues yields (a legal interleaving: no spinning needed) against interpret.interpret; on the H200,
against reference.decode_step at bf16 tolerance for several steps with a growing context, then timed against eager,
CUDA graph and CUDA graph + PDL.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .graph import Kind, TaskGraph
from .schedule import TASK_FIELDS, Schedule, encode

# buffer kinds of the arena: row b of the offset table holds each layer's offset of buffer BUFFERS[b]
BUFFERS = (
    "x",
    "h",
    "n1",
    "n2",
    "att",
    "act",
    "w_attn_norm",
    "w_mlp_norm",
    "wqkv",
    "qkv",
    "wo",
    "wgate",
    "wup",
    "wdown",
)
SUPPORTED = (Kind.NORM, Kind.QKV, Kind.OPROJ, Kind.GATEUP, Kind.DOWN)


@triton.jit
def _base(ARENA, OFFS, buf, layer, NL):
    return ARENA + tl.load(OFFS + buf * NL + layer)


@triton.jit
def _gemv(W, X, lo, hi, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """rows [lo, hi) of the row-major (., K) matrix W times the vector X: fp32 (BLOCK_N,), masked past hi."""
    rows = lo + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < hi) & (cols[None, :] < K), other=0.0)
        x = tl.load(X + cols, mask=cols < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def run_tasks_kernel(
    ARENA,
    OFFS,
    TASKS,
    ORDER,
    n,
    NL,
    H,
    INTER,
    QD,
    HQ,
    S,
    eps,
    B_X: tl.constexpr,
    B_H: tl.constexpr,
    B_N1: tl.constexpr,
    B_N2: tl.constexpr,
    B_ATT: tl.constexpr,
    B_ACT: tl.constexpr,
    B_WAN: tl.constexpr,
    B_WMN: tl.constexpr,
    B_WQKV: tl.constexpr,
    B_QKV: tl.constexpr,
    B_WO: tl.constexpr,
    B_WG: tl.constexpr,
    B_WU: tl.constexpr,
    B_WD: tl.constexpr,
    NF: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Runs tasks ORDER[0:n] one after the other (the caller orders them legally). Task row: TASK_FIELDS."""
    rows_h = tl.arange(0, BLOCK_H)
    for i in range(n):
        t = tl.load(ORDER + i)
        kind = tl.load(TASKS + t * NF)
        layer = tl.load(TASKS + t * NF + 1)
        lo = tl.load(TASKS + t * NF + 2)
        hi = tl.load(TASKS + t * NF + 3)
        rows = lo + tl.arange(0, BLOCK_N)
        if kind == 0:  # NORM: y = x * rsqrt(mean(x^2) + eps) * w (tile 0: attention norm, tile 1: MLP norm)
            first = lo == 0
            x = tl.load(_base(ARENA, OFFS, tl.where(first, B_X, B_H), layer, NL) + rows_h, mask=rows_h < H, other=0.0)
            w = tl.load(_base(ARENA, OFFS, tl.where(first, B_WAN, B_WMN), layer, NL) + rows_h, mask=rows_h < H)
            r = tl.rsqrt(tl.sum(x * x) / H + eps)
            tl.store(_base(ARENA, OFFS, tl.where(first, B_N1, B_N2), layer, NL) + rows_h, x * r * w, mask=rows_h < H)
        elif kind == 1:  # QKV: qkv[lo:hi] = Wqkv[lo:hi] n1
            acc = _gemv(
                _base(ARENA, OFFS, B_WQKV, layer, NL), _base(ARENA, OFFS, B_N1, layer, NL), lo, hi, H, BLOCK_N, BLOCK_K
            )
            tl.store(_base(ARENA, OFFS, B_QKV, layer, NL) + rows, acc, mask=rows < hi)
        elif kind == 4:  # OPROJ: combine the splits' (o, m, l), then h[lo:hi] = x[lo:hi] + Wo[lo:hi] a
            att = _base(ARENA, OFFS, B_ATT, layer, NL)
            s = tl.arange(0, BLOCK_S)[:, None, None]
            hq = tl.arange(0, BLOCK_HQ)[None, :, None]
            d = tl.arange(0, BLOCK_D)[None, None, :]
            sh = (s < S) & (hq < HQ)
            rec = att + (s * HQ + hq) * (D + 2)
            # padded splits: m = -inf (weight 0); padded heads: m = 0, l = 1, o = 0 (a = 0, no 0 / 0)
            m = tl.load(rec + D, mask=sh, other=float("-inf"))  # (S, HQ, 1)
            m = tl.where(hq < HQ, m, 0.0)
            ell = tl.load(rec + D + 1, mask=sh, other=0.0)
            ell = tl.where(hq < HQ, ell, 1.0)
            o = tl.load(rec + d, mask=sh & (d < D), other=0.0)
            scale = tl.exp(m - tl.max(m, axis=0)[None, :, :])
            a = tl.sum(scale * o, axis=0) / tl.sum(scale * ell, axis=0)  # (HQ, D)
            # Wo[lo:hi] is (rows, HQ * D): contract over heads and dims
            r3 = rows[:, None, None]
            wmask = (r3 < hi) & (hq < HQ) & (d < D)
            w = tl.load(_base(ARENA, OFFS, B_WO, layer, NL) + r3 * QD + hq * D + d, mask=wmask, other=0.0)
            acc = tl.sum(tl.sum(w * a[None, :, :], axis=2), axis=1)
            res = tl.load(_base(ARENA, OFFS, B_X, layer, NL) + rows, mask=rows < hi, other=0.0)
            tl.store(_base(ARENA, OFFS, B_H, layer, NL) + rows, res + acc, mask=rows < hi)
        elif kind == 5:  # GATEUP: act[lo:hi] = silu(Wg[lo:hi] n2) * (Wu[lo:hi] n2)
            n2 = _base(ARENA, OFFS, B_N2, layer, NL)
            g = _gemv(_base(ARENA, OFFS, B_WG, layer, NL), n2, lo, hi, H, BLOCK_N, BLOCK_K)
            u = _gemv(_base(ARENA, OFFS, B_WU, layer, NL), n2, lo, hi, H, BLOCK_N, BLOCK_K)
            tl.store(_base(ARENA, OFFS, B_ACT, layer, NL) + rows, g * tl.sigmoid(g) * u, mask=rows < hi)
        elif kind == 6:  # DOWN: x[l + 1][lo:hi] = h[lo:hi] + Wd[lo:hi] act
            acc = _gemv(
                _base(ARENA, OFFS, B_WD, layer, NL),
                _base(ARENA, OFFS, B_ACT, layer, NL),
                lo,
                hi,
                INTER,
                BLOCK_N,
                BLOCK_K,
            )
            res = tl.load(_base(ARENA, OFFS, B_H, layer, NL) + rows, mask=rows < hi, other=0.0)
            tl.store(_base(ARENA, OFFS, B_X, layer + 1, NL) + rows, res + acc, mask=rows < hi)


def run_tasks(graph: TaskGraph, buffers: dict, order: list[int]) -> None:
    """Runs the tasks `order` (kinds in SUPPORTED, a legal order) with grid=(1,) on `buffers` (graph buffer name ->
    1-D float32 torch tensor, as interpret(..., buffers=) fills them), writing their outputs in place."""
    import torch

    c, t = graph.config, graph.tiling
    bad = [graph.tasks[i].label for i in order if graph.tasks[i].kind not in SUPPORTED]
    if bad:
        raise ValueError(f"run_tasks: task kinds not written yet in the kernel: {bad[:3]}")
    nl = c.num_layers + 1
    names = [[f"{b}[{layer}]" for layer in range(nl)] for b in BUFFERS]
    present = [n for row in names for n in row if n in buffers]
    sizes = [buffers[n].numel() for n in present]
    arena = torch.cat([buffers[n].reshape(-1).to(torch.float32) for n in present])
    start = dict(zip(present, [0, *list(torch.tensor(sizes).cumsum(0)[:-1].tolist())]))
    offs = torch.tensor([[start.get(n, 0) for n in row] for row in names], dtype=torch.int64)
    enc = encode(graph, Schedule(()))
    block_n = triton.next_power_of_2(max(t.qkv, t.o, t.gateup, t.down))
    run_tasks_kernel[(1,)](
        arena,
        offs,
        torch.from_numpy(enc["tasks"]),
        torch.tensor(order, dtype=torch.int32),
        len(order),
        nl,
        c.hidden,
        c.intermediate,
        c.q_size,
        c.num_heads,
        t.kv_splits,
        c.rms_eps,
        *range(len(BUFFERS)),
        len(TASK_FIELDS),
        c.head_dim,
        BLOCK_H=triton.next_power_of_2(c.hidden),
        BLOCK_N=block_n,
        BLOCK_K=16,
        BLOCK_S=triton.next_power_of_2(t.kv_splits),
        BLOCK_HQ=triton.next_power_of_2(c.num_heads),
        BLOCK_D=triton.next_power_of_2(c.head_dim),
    )
    for n, size in zip(present, sizes):
        buffers[n].copy_(arena[start[n] : start[n] + size].to(buffers[n].dtype))
