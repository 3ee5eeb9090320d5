"""The persistent Triton kernel that runs a checked schedule of the decode step in one launch (decode_kernel), its
host side (Megakernel: arenas and tables allocated once, the launch, the watchdog's error), and the same task bodies
launched one op at a time (the benchmark's CUDA graph + PDL baseline).

Status: the whole kernel runs in Triton's interpreter on CPU (tests/test_megakernel.py) and compiles for sm_90 with
triton 3.9 and 3.6 (the GPU path's PTX checked without a GPU); on an H200 (2026-11-29, triton 3.6) its GPU tests pass
and `tile-kernels bench --megakernel` timed it (benchmarks/results/h200/megakernel.md); on an H100 (2026-12-07,
this build) the GPU tests pass.

Launch. grid = (num_sms,), one CTA per SM, launched with Triton's `launch_cooperative_grid=True`, so that a grid larger
than what can be co-resident fails at launch instead of spinning forever on a CTA that never starts. The schedule's
deadlock-freedom (check.py, rule 5) assumes every queue runs concurrently; the cooperative launch guarantees that.

Task encoding. schedule.encode gives int32 tables, copied to the device once per build: `tasks` (num_tasks, 8) = (kind,
layer, lo, hi, split, wait_begin, wait_end, signal), `waits` (num_waits, 2) = (counter, threshold), and the queues
in CSR form (`queue_ptr`, `queue_tasks`). Buffer addresses are not in the table: each kind derives them from (layer, lo,
hi, split) and the constexpr layout OFFS ((base, stride) of each buffer kind: layer l at base + l stride) of two arenas,
W (weights, model dtype) and A (activations, float32), plus the KV cache tensor itself, as interpret._run_task does with
names. CTA `pid` loops over queue_tasks[queue_ptr[pid]:queue_ptr[pid + 1]] and dispatches on `kind` with an if-chain of
task bodies whose tile shapes are constexpr (per projection BN >= the tile's rows, rows >= hi masked), so one compiled
kernel serves every task. x[0] is read from the step's input and the last DOWN writes the step's output tensor directly.

Counter protocol. `counters` is an int32 array, zeroed once at allocation and never reset: launch e (e = 1, 2, ...)
waits for `epoch * threshold`, so no memset sits between steps (the host zeroes it again before int32 would wrap).
  producer: the tile's global stores -> CTA barrier (tl.debug_barrier: every warp's stores issued) -> one thread does
    `red.release.gpu.add` (tl.atomic_add(counter, 1, sem="release", scope="gpu") on a scalar) -> next task.
  consumer: for each wait, thread 0 spins on an acquire load, `ld.acquire.gpu.global.b32`, with `nanosleep.u32
    32..256` backoff between polls, a loop inside one tl.inline_asm_elementwise (Triton's own loops are CTA-uniform;
    a scalar tl.atomic_add(..., sem="acquire") in a loop emits a bar.sync per iteration, triton#7125), or
    (Megakernel's one_poller=False, and under the watchdog) every thread in a Triton loop; then a CTA barrier so no
    warp reads before the value is seen (acquire, then bar.sync: the pattern of a cooperative grid sync). Activations
    and KV rows written in this launch are loaded with .cg (L2, never a stale L1 line).
  Every buffer is written once per launch (graph.py), so there are only read-after-write edges: no WAR counters.

Prefetch. Weights never depend on counters. A bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`, sm_90+, PF_CHUNKS
chunks of PF_BYTES, one a thread) of a task's weight rows (contiguous in the row-major matrices; the first PF_CHUNKS x
PF_BYTES bytes of them) lets HBM stream them while the CTA waits (PREFETCH; the step is bandwidth-bound: Llama-3.2-1B's
~1.9 GB of bf16 weights take 475 us at the H200's measured copy speed); an ATTN task prefetches as many bytes of its
split's K rows and of its V rows (line prefetches). The GEMV's weight loads are marked L2 evict_first (Megakernel's
weights_evict_first; read once a step, they leave L2 before the prefetched lines, activations and KV rows). The L2
prefetch's default (Megakernel's prefetch_bytes) is the first PREFETCH_BYTES of each matrix: all of a task's rows
measured slower (132 CTAs' prefetches overrun the 50 MB L2), and so did whole KV splits at long contexts, the next
task's weights while one runs, an ATTN loop keeping its K / V window ahead of its loads, an L1 prefetch of the first
tiles' lines, and loading the first weight tile into registers before the waits measured no faster than after them
(benchmarks/results/h200/notes.md); the per-op launches prefetch whole weight tasks (an ATTN split: as many bytes of its
K and of its V rows as the largest weight task has).
Never in the interpreter, before sm_90, or where a row is not a multiple of 16 bytes.

Task bodies (batch 1, fp32 accumulation, activations fp32 scratch, weights and KV cache in the model dtype):
  QKV / OPROJ / GATEUP / DOWN  GEMV tiles: rows [lo, hi) of W times a vector, K streamed in (BN, BK) weight tiles of
         tile_budget elements, each reduced at once into a (BN,) fp32 accumulator, two tiles in flight in registers
         (_gemv gives the design). QKV and GATEUP normalize their input on the fly (r = rsqrt(mean(v^2) + eps)
         from one pass over the hidden vector, then each chunk times r and the norm weight: no NORM task, no hop;
         QKV adds its rows' biases, zeros for a model without them). OPROJ multiplies the combined attention output
         ao. DOWN and OPROJ add the residual rows; GATEUP streams its two matrices in one loop.
  ATTN   group g, split s: rotates the group's q heads and k_g (the two rotary halves kept apart, cos/sin read from a
         (max_seq, D/2) table computed in float64 at build: fp32 angles lose ~1e-2 rad at position 1e5); split 0
         writes the new KV cache row and starts its online softmax from the new token in registers (rounded to the
         cache dtype, as the eager step re-reads it), then every split streams its BLOCK_T-position blocks of the
         cached rows 0..position-1 (q K^T and p V as tl.dot: the G heads padded to 16 rows, q and p rounded to the
         cache dtype, so 16-bit caches run on tensor cores and the loop's loads are pipelined) and writes its
         (o, m, l) partial into `att`; an empty split writes -inf, 0, 0.
  COMBINE group g: its heads' partials of every split, a = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s (one exp a
         split and head) -> ao.

Watchdog (debug=True). Each spin reads `%globaltimer` and the error record's flag; a thread leaves on the target, its
timeout (`timeout_s`) or the flag, then one thread's acquire RMW of the counter, broadcast to the CTA, decides
uniformly (no barrier under divergent control flow): still short, the program records (program, task id, counter,
value seen, expected) with a compare-and-swap on the record (first one wins; its flag aborts every other spinning
program) and leaves its queue. The host synchronizes after the launch, finds the record set, zeroes the counters
(epoch 0) and raises a RuntimeError naming the stuck task and counter with the labels of graph.tasks / graph.counters.

Trace (TRACING, DecodeStep.trace). Each task stores %globaltimer before its waits, after them and after its body's
stores (int64 TRACE[task] = (wait, run, end, program)); trace.py turns that into a Chrome trace, a table per task kind
and an SM x time plot. Off (constexpr) in every other launch.

Interpreter (TRITON_INTERPRET=1, CPU tensors). Programs run one after another, so the launcher gives one program
(grid=(1,)) one queue holding every task in a legal interleaving of the schedule's queues (check.run_queues); each
wait is a plain load that must already be met, and one that is not is recorded like the watchdog's (the host raises
at once). The interpreter thus checks the task bodies and the counter bookkeeping (thresholds, epochs, signals); the
spinning, prefetch, memory ordering and cooperative launch are GPU-only (constexpr INTERPRET prunes that PTX).

Staged launches (MODE=STAGED, the benchmark's per-op baseline). One launch per stage (an op of a layer), a program
per task, KIND constexpr (one body compiled per kind), no counters; with launch_pdl each program prefetches its
weights, then `griddepcontrol.wait`s for the previous launch and lets the next one
launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .graph import TaskGraph
from .schedule import TASK_FIELDS, Schedule, encode

# the buffer kinds of the layout OFFS: scratch buffers in the float32 arena A, weights in the arena W
SCRATCH = ("x", "h", "qkv", "att", "act", "ao")
WEIGHTS = ("w_attn_norm", "w_mlp_norm", "wqkv", "wo", "wgate", "wup", "wdown", "wqkv_bias")
BUFFERS = SCRATCH + WEIGHTS
B_X, B_H, B_QKV, B_ATT, B_ACT, B_AO = (tl.constexpr(i) for i in range(len(SCRATCH)))
B_WAN, B_WMN, B_WQKV, B_WO, B_WG, B_WU, B_WD, B_BQKV = (tl.constexpr(len(SCRATCH) + i) for i in range(len(WEIGHTS)))
NF = tl.constexpr(len(TASK_FIELDS))
ALIGN = tl.constexpr(64)  # elements: every buffer's offset in its arena (128-byte lines for 16-bit weights)
ERR_FIELDS = ("flag", "program", "task", "counter", "value", "expected")
PERSISTENT, STAGED = 0, 1  # MODE: one program per SM walking its queue / one program per task of one stage
ATTN_BLOCK_T = 64  # cached positions an ATTN task's loop step reads (K and V: 2 x 64 x D elements; 32, 128 slower)
TILE_BUDGET = 16384  # elements of a weight tile (Megakernel's tile_budget): 32 KB of bf16, two in flight (_gemv)
# bytes of each weight matrix of a task prefetched to L2 before its waits (Megakernel's prefetch_bytes). H100, context
# 1024, us a step, none / 32 KB / 128 KB / whole tasks: Llama-3.2-1B 1217 / 1198 / 1242 / 1276 and 1090 / 1061 (a
# second run), Llama-3-8B 6297 / 6254; an ATTN task as many bytes of its split's K and of its V rows
PREFETCH_BYTES = 32768


# ------------------------------------------------------------------------------------- PTX helpers (GPU path only)


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _nanosleep(ns):
    tl.inline_asm_elementwise("nanosleep.u32 $1;\nmov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_one_thread(ptr, target, SLEEP_NS: tl.constexpr):
    """Thread 0 of the CTA polls *ptr with acquire loads (nanosleep backoff 32..SLEEP_NS ns; 0: none) until it is
    >= target; the other threads return at once and meet it at the caller's CTA barrier (one poller an SM: the polls
    of a counter that 132 SMs wait on stay off its L2 slice's queue). A loop inside the asm: Triton's loops are
    CTA-uniform."""
    return tl.inline_asm_elementwise(
        """{
.reg .pred p;
.reg .b32 tid, v, ns;
mov.u32 $0, 0;
mov.u32 tid, %tid.x;
setp.ne.u32 p, tid, 0;
@p bra SPIN_DONE${:uid};
min.u32 ns, $3, 32;
SPIN_LOOP${:uid}:
ld.acquire.gpu.global.b32 v, [$1];
setp.ge.s32 p, v, $2;
@p bra SPIN_DONE${:uid};
setp.ne.u32 p, ns, 0;
@p nanosleep.u32 ns;
shl.b32 ns, ns, 1;
min.u32 ns, ns, $3;
bra SPIN_LOOP${:uid};
SPIN_DONE${:uid}:
}""",
        "=r,l,r,r",
        [ptr, target, target * 0 + SLEEP_NS],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptr, nbytes, PF_CHUNKS: tl.constexpr, PF_BYTES: tl.constexpr):
    """Bulk L2 prefetch of nbytes (a multiple of 16, 16-byte aligned) from ptr: PF_CHUNKS chunks of PF_BYTES, one a
    thread; chunks past the end are predicated off."""
    c = tl.arange(0, PF_CHUNKS)
    addr = ptr.to(tl.pointer_type(tl.int8), bitcast=True) + c.to(tl.int64) * PF_BYTES
    size = tl.minimum(nbytes - c.to(tl.int64) * PF_BYTES, PF_BYTES).to(tl.int32)
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# ------------------------------------------------------------------------------------------------------ task bodies


@triton.jit
def _ptr(ARENA, OFFS: tl.constexpr, buf: tl.constexpr, layer):
    """Base of buffer `buf` of `layer` in ARENA: OFFS[buf] = (base, stride), the layers of a buffer one after another
    (Megakernel.layout), so the address is arithmetic, with no table load after a wait. Offsets are multiples of ALIGN
    elements: without the hint the loads compile to one 2-byte load per element instead of 16-byte vectors."""
    off = tl.full([], OFFS[buf][0], tl.int64) + tl.full([], OFFS[buf][1], tl.int64) * layer
    return ARENA + tl.multiple_of(off, ALIGN)


@triton.jit
def _vec(XIN, A, OFFS: tl.constexpr, buf: tl.constexpr, layer, idx, mask):
    """Elements idx of the float32 activation vector `buf` of `layer`: x[0] is the step's input, the rest scratch
    written in this launch, loaded with .cg (from L2, never a stale L1 line)."""
    if buf == B_X:
        if layer == 0:
            v = tl.load(XIN + idx, mask=mask, other=0.0).to(tl.float32)
        else:
            v = tl.load(_ptr(A, OFFS, buf, layer) + idx, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        v = tl.load(_ptr(A, OFFS, buf, layer) + idx, mask=mask, other=0.0, cache_modifier=".cg")
    return v


@triton.jit
def _rms_scale(XIN, A, OFFS: tl.constexpr, buf: tl.constexpr, layer, H, eps, BLOCK_H: tl.constexpr):
    """1 / sqrt(mean(v^2) + eps) of the activation vector `buf` (H elements, one BLOCK_H tile)."""
    cols = tl.arange(0, BLOCK_H)
    v = _vec(XIN, A, OFFS, buf, layer, cols, cols < H)
    return tl.rsqrt(tl.sum(v * v) / H + eps)


@triton.jit
def _wtile(W, rows, hi, K, k0, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of rows `rows` (< hi) of the row-major (., K) matrix W; nothing is read past K.
    EVICT: the loads' L2 eviction policy ("" normal; "evict_first": the weights are read once a step)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < hi) & (cols[None, :] < K)
    return tl.load(W + rows[:, None] * K + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT)


@triton.jit
def _norm_chunk(XIN, A, OFFS: tl.constexpr, buf: tl.constexpr, layer, wn, H, k0, BLOCK_K: tl.constexpr):
    """Elements [k0, k0 + BLOCK_K) of the activation vector `buf` and of the norm weight wn, as loaded (QKV and
    GATEUP multiply them by r when they use them, a tile later)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return _vec(XIN, A, OFFS, buf, layer, cols, cols < H), tl.load(wn + cols, mask=cols < H, other=0.0)


@triton.jit
def _gemv(W, X, lo, hi, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    """rows [lo, hi) of the row-major (., K) matrix W times the float32 vector X: fp32 (BLOCK_N,), masked past hi.

    Design (QKV and GATEUP run the same loop inline). Batch 1 is bandwidth-bound with one CTA an SM, so what matters is
    the weight bytes in flight per SM (Little's law: ~32 GB/s an SM at ~1 us loaded latency needs 32 KB+ in flight at
    all times). The next (BLOCK_N, BLOCK_K) tile is loaded into registers, as 16-byte vectors, before the current one is
    multiplied: two tiles of Megakernel's tile_budget elements in flight, and the vector's next chunk with its tile (an
    L2 round trip for it at each iteration would bound the iteration where the weights come from L2); the first tile
    loads after the task's waits (before them measured no faster). Each product tile is reduced at once into a
    (BLOCK_N,) accumulator (in-thread adds, warp shuffles, a shared-memory step where BLOCK_K spans several warps), so
    the registers hold the two weight tiles and no tile-shaped fp32 accumulator: budget / (32 x num_warps) a thread for
    16-bit weights (64 at 16384 elements and 8 warps).
    Limits: the whole kernel's registers (255 at 16384, the max over every body plus what is hoisted out of the queue
    loop) spill at 32768, and with a second tile loaded ahead of the loop (it then multiplies tile k before it loads
    tile k + 2, and ptxas hoists that load: three tiles live); tasks of few rows make BLOCK_K long, so the per-tile
    reduction crosses warps; a K not a multiple of BLOCK_K masks part of the last tile."""
    rows = lo + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    w = _wtile(W, rows, hi, K, 0, BLOCK_K, EVICT)
    x = tl.load(X + cols, mask=cols < K, other=0.0, cache_modifier=".cg")
    for k0 in range(0, K, BLOCK_K):
        w_next = _wtile(W, rows, hi, K, k0 + BLOCK_K, BLOCK_K, EVICT)
        x_next = tl.load(X + k0 + BLOCK_K + cols, mask=k0 + BLOCK_K + cols < K, other=0.0, cache_modifier=".cg")
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        w = w_next
        x = x_next
    return acc


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """a @ b, fp32 accumulation: 16-bit operands on tensor cores; fp32 / fp64 ones (the cache's dtype), and 16-bit
    ones in Triton's interpreter (whose tl.dot multiplies raw bfloat16 patterns, upcast first), at full precision."""
    if INTERPRET or a.dtype.primitive_bitwidth >= 32:
        if a.dtype.primitive_bitwidth < 32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _split_range(position, S, split):
    """Positions [a, e) of split `split`: the cached positions 0..position-1 cut in S ranges of ceil(position / S)."""
    chunk = (position + S - 1) // S
    a = tl.minimum(position, split * chunk)
    return a, tl.minimum(position, a + chunk)


@triton.jit
def _kv_bases(KV, layer, g, MAXSEQ, HK, D: tl.constexpr):
    """K and V of group g, position 0, in the cache (layers, 2, max_seq, HK, D); the int32 products stay < 2^31 up to
    max_seq x HK x D = 2^27 (no .to() on scalar arguments: Triton makes an argument equal to 1 a constexpr)."""
    kbase = KV + (layer.to(tl.int64) * 2 * MAXSEQ) * HK * D + g * D
    return kbase, kbase + MAXSEQ * HK * D


@triton.jit
def _prefetch_lines(ptrs, mask):
    """L2 prefetch (kept: evict_last) of the lines holding ptrs where mask."""
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p prefetch.global.L2::evict_last [$1];\nmov.u32 $0, 0;\n}",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _task(
    kind,
    layer,
    lo,
    hi,
    split,
    W,
    A,
    KV,
    XIN,
    OUT,
    OFFS: tl.constexpr,
    ROPE,
    position,
    NL,
    H,
    INTER,
    HK,
    MAXSEQ,
    S,
    eps,
    sm_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BN_QKV: tl.constexpr,
    BK_QKV: tl.constexpr,
    BN_O: tl.constexpr,
    BK_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BK_GU: tl.constexpr,
    BN_D: tl.constexpr,
    BK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GC: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    EVICT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One task (graph.py's table of kinds), run once what it waits for is done (_arrive); `kind` is a constexpr in
    staged launches (one body compiled)."""
    HQ = HK * G
    QD = HQ * D
    if kind == 0:  # QKV: qkv[lo:hi] = Wqkv[lo:hi] (x r w_attn), r = rsqrt(mean(x^2) + eps), x = x[l]
        wqkv = _ptr(W, OFFS, B_WQKV, layer)
        rows = lo + tl.arange(0, BN_QKV)
        w = _wtile(wqkv, rows, hi, H, 0, BK_QKV, EVICT)
        r = _rms_scale(XIN, A, OFFS, B_X, layer, H, eps, BLOCK_H)
        wn = _ptr(W, OFFS, B_WAN, layer)
        acc = tl.zeros((BN_QKV,), tl.float32)
        v, g = _norm_chunk(XIN, A, OFFS, B_X, layer, wn, H, 0, BK_QKV)
        for k0 in range(0, H, BK_QKV):  # as _gemv, the input normalized chunk by chunk
            w_next = _wtile(wqkv, rows, hi, H, k0 + BK_QKV, BK_QKV, EVICT)
            v_next, g_next = _norm_chunk(XIN, A, OFFS, B_X, layer, wn, H, k0 + BK_QKV, BK_QKV)
            acc += tl.sum(w.to(tl.float32) * (v * r * g.to(tl.float32))[None, :], axis=1)
            w = w_next
            v = v_next
            g = g_next
        acc += tl.load(_ptr(W, OFFS, B_BQKV, layer) + rows, mask=rows < hi, other=0.0).to(tl.float32)
        tl.store(_ptr(A, OFFS, B_QKV, layer) + rows, acc, mask=rows < hi)
    elif kind == 1:  # ATTN of group g = lo, split s (graph.py): rope, the new KV row, (o, m, l) over the split
        i = tl.arange(0, BLOCK_DH)  # the two rotary halves are kept apart: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        im = i < D // 2
        jg = tl.arange(0, BLOCK_G)
        qm = (jg < G)[:, None] & im[None, :]
        seg = _ptr(A, OFFS, B_QKV, layer) + lo * (G + 2) * D  # G q heads, k_g, v_g
        c = tl.load(ROPE + position * (D // 2) + i, mask=im, other=1.0)
        s = tl.load(ROPE + (MAXSEQ + position) * (D // 2) + i, mask=im, other=0.0)
        x1 = tl.load(seg + jg[:, None] * D + i[None, :], mask=qm, other=0.0, cache_modifier=".cg")
        x2 = tl.load(seg + jg[:, None] * D + D // 2 + i[None, :], mask=qm, other=0.0, cache_modifier=".cg")
        q1 = (x1 * c - x2 * s) * sm_scale
        q2 = (x2 * c + x1 * s) * sm_scale
        k1 = tl.load(seg + G * D + i, mask=im, other=0.0, cache_modifier=".cg")
        k2 = tl.load(seg + G * D + D // 2 + i, mask=im, other=0.0, cache_modifier=".cg")
        kn1 = (k1 * c - k2 * s).to(KV.dtype.element_ty)
        kn2 = (k2 * c + k1 * s).to(KV.dtype.element_ty)
        vn1 = tl.load(seg + (G + 1) * D + i, mask=im, other=0.0, cache_modifier=".cg")
        vn2 = tl.load(seg + (G + 1) * D + D // 2 + i, mask=im, other=0.0, cache_modifier=".cg")
        vn1, vn2 = vn1.to(KV.dtype.element_ty), vn2.to(KV.dtype.element_ty)
        kbase, vbase = _kv_bases(KV, layer, lo, MAXSEQ, HK, D)
        first = split == 0
        if first:  # the new token's KV row (nobody reads it in this launch: split 0 keeps it in registers)
            row = position * HK * D
            tl.store(kbase + row + i, kn1, mask=im)
            tl.store(kbase + row + D // 2 + i, kn2, mask=im)
            tl.store(vbase + row + i, vn1, mask=im)
            tl.store(vbase + row + D // 2 + i, vn2, mask=im)
        # split 0 starts from the new token (m = its score, l = 1, o = v), the others from nothing
        sn = tl.sum(q1 * kn1.to(tl.float32)[None, :] + q2 * kn2.to(tl.float32)[None, :], axis=1)
        m_i = tl.where(first, sn, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0) + tl.zeros((BLOCK_G,), tl.float32)
        zero = tl.zeros((BLOCK_G, BLOCK_DH), tl.float32)
        o1 = tl.where(first, vn1.to(tl.float32)[None, :] + zero, zero)
        o2 = tl.where(first, vn2.to(tl.float32)[None, :] + zero, zero)
        qa = q1.to(KV.dtype.element_ty)  # the cached blocks' dots on tensor cores, q in the cache dtype
        qb = q2.to(KV.dtype.element_ty)
        a, e = _split_range(position, S, split)
        for t0 in range(a, e, BLOCK_T):
            tt = t0 + tl.arange(0, BLOCK_T)
            tm = tt < e
            km = tm[:, None] & im[None, :]
            off = tt[:, None] * (HK * D) + i[None, :]
            kt = tt[None, :] * (HK * D) + i[:, None]  # K transposed, (DH, T)
            ktm = tm[None, :] & im[:, None]
            ka = tl.load(kbase + kt, mask=ktm, other=0.0, cache_modifier=".cg")
            kb = tl.load(kbase + kt + D // 2, mask=ktm, other=0.0, cache_modifier=".cg")
            va = tl.load(vbase + off, mask=km, other=0.0, cache_modifier=".cg")
            vb = tl.load(vbase + off + D // 2, mask=km, other=0.0, cache_modifier=".cg")
            sc = _dot(qa, ka, INTERPRET) + _dot(qb, kb, INTERPRET)
            sc = tl.where(tm[None, :], sc, float("-inf"))  # (G, T)
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # finite: every block holds a position
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            o1 = o1 * alpha[:, None] + _dot(p.to(KV.dtype.element_ty), va, INTERPRET)
            o2 = o2 * alpha[:, None] + _dot(p.to(KV.dtype.element_ty), vb, INTERPRET)
            m_i = m_new
        rec = _ptr(A, OFFS, B_ATT, layer) + (split * HQ + lo * G + jg) * (D + 2)  # (split, head, [o, m, l])
        tl.store(rec[:, None] + i[None, :], o1, mask=qm)
        tl.store(rec[:, None] + D // 2 + i[None, :], o2, mask=qm)
        tl.store(rec + D, m_i, mask=jg < G)
        tl.store(rec + D + 1, l_i, mask=jg < G)
    elif kind == 2:  # OPROJ: h[lo:hi] = x[lo:hi] + Wo[lo:hi] ao
        rows = lo + tl.arange(0, BN_O)
        wo = _ptr(W, OFFS, B_WO, layer)
        acc = _gemv(wo, _ptr(A, OFFS, B_AO, layer), lo, hi, QD, BN_O, BK_O, EVICT)
        res = _vec(XIN, A, OFFS, B_X, layer, rows, rows < hi)
        tl.store(_ptr(A, OFFS, B_H, layer) + rows, res + acc, mask=rows < hi)
    elif kind == 3:  # GATEUP: act[lo:hi] = silu(Wg[lo:hi] m) * (Wu[lo:hi] m), m = h r w_mlp, r = rsqrt(mean(h^2) + eps)
        wg = _ptr(W, OFFS, B_WG, layer)
        wu = _ptr(W, OFFS, B_WU, layer)
        rows = lo + tl.arange(0, BN_GU)
        tg, tu = _wtile(wg, rows, hi, H, 0, BK_GU, EVICT), _wtile(wu, rows, hi, H, 0, BK_GU, EVICT)
        r = _rms_scale(XIN, A, OFFS, B_H, layer, H, eps, BLOCK_H)
        wn = _ptr(W, OFFS, B_WMN, layer)
        acc_g = tl.zeros((BN_GU,), tl.float32)
        acc_u = tl.zeros((BN_GU,), tl.float32)
        v, g = _norm_chunk(XIN, A, OFFS, B_H, layer, wn, H, 0, BK_GU)
        for k0 in range(0, H, BK_GU):  # as _gemv, both matrices in one loop, the input normalized chunk by chunk
            tg_next = _wtile(wg, rows, hi, H, k0 + BK_GU, BK_GU, EVICT)
            tu_next = _wtile(wu, rows, hi, H, k0 + BK_GU, BK_GU, EVICT)
            v_next, g_next = _norm_chunk(XIN, A, OFFS, B_H, layer, wn, H, k0 + BK_GU, BK_GU)
            n = v * r * g.to(tl.float32)
            acc_g += tl.sum(tg.to(tl.float32) * n[None, :], axis=1)
            acc_u += tl.sum(tu.to(tl.float32) * n[None, :], axis=1)
            tg = tg_next
            tu = tu_next
            v = v_next
            g = g_next
        tl.store(_ptr(A, OFFS, B_ACT, layer) + rows, acc_g * tl.sigmoid(acc_g) * acc_u, mask=rows < hi)
    elif kind == 4:  # DOWN: x[l + 1][lo:hi] = h[lo:hi] + Wd[lo:hi] act (the last layer writes the step's output)
        rows = lo + tl.arange(0, BN_D)
        wd = _ptr(W, OFFS, B_WD, layer)
        acc = _gemv(wd, _ptr(A, OFFS, B_ACT, layer), lo, hi, INTER, BN_D, BK_D, EVICT)
        y = tl.load(_ptr(A, OFFS, B_H, layer) + rows, mask=rows < hi, other=0.0, cache_modifier=".cg") + acc
        if layer + 1 == NL:
            tl.store(OUT + rows, y.to(OUT.dtype.element_ty), mask=rows < hi)
        else:
            tl.store(_ptr(A, OFFS, B_X, layer + 1) + rows, y, mask=rows < hi)
    else:  # COMBINE of group g = lo
        _combine(A, OFFS, layer, lo, S, HQ, G, D, BLOCK_S, BLOCK_GC, BLOCK_DH)


@triton.jit
def _combine(A, OFFS: tl.constexpr, layer, lo, S, HQ, G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
             BLOCK_GC: tl.constexpr, BLOCK_DH: tl.constexpr):  # fmt: skip
    """COMBINE of group g = lo: ao[heads of g] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s."""
    sp = tl.arange(0, BLOCK_S)[:, None, None]
    jg = tl.arange(0, BLOCK_GC)[None, :, None]
    d = tl.arange(0, 2 * BLOCK_DH)[None, None, :]
    head = lo * G + jg
    ao = _ptr(A, OFFS, B_AO, layer)
    rec = _ptr(A, OFFS, B_ATT, layer) + (sp * HQ + head) * (D + 2)  # (S, G, 1): (split, head, [o, m, l])
    sm = (sp < S) & (jg < G)
    # padded splits: m = -inf (weight 0); padded heads: m = 0, l = 1, o = 0 (no NaN); split 0 is never empty
    m = tl.where(jg < G, tl.load(rec + D, mask=sm, other=float("-inf"), cache_modifier=".cg"), 0.0)
    ell = tl.where(jg < G, tl.load(rec + D + 1, mask=sm, other=0.0, cache_modifier=".cg"), 1.0)
    o = tl.load(rec + d, mask=sm & (d < D), other=0.0, cache_modifier=".cg")
    scale = tl.exp(m - tl.max(m, axis=0)[None, :, :])
    a = tl.sum(scale * o, axis=0) / tl.sum(scale * ell, axis=0)  # (G, 2 BLOCK_DH)
    dd = tl.arange(0, 2 * BLOCK_DH)[None, :]
    jj = tl.arange(0, BLOCK_GC)[:, None]
    tl.store(ao + (lo * G + jj) * D + dd, a, mask=(jj < G) & (dd < D))


@triton.jit
def _prefetch_weights(Wm, lo, hi, K, PF_CHUNKS: tl.constexpr, PF_BYTES: tl.constexpr):
    """Prefetch of rows [lo, hi) of the row-major (., K) matrix Wm into L2: their first PF_CHUNKS x PF_BYTES bytes
    (bulk prefetches: the first rows whole)."""
    es = Wm.dtype.element_ty.primitive_bitwidth // 8
    _prefetch_l2(Wm + lo * K, (hi - lo) * K * es, PF_CHUNKS, PF_BYTES)


@triton.jit
def _prefetch_task(kind, layer, lo, hi, split, W, KV, OFFS: tl.constexpr, position, H, INTER, QD, HK, MAXSEQ, S,
                   D: tl.constexpr, PF_CHUNKS: tl.constexpr, PF_BYTES: tl.constexpr):  # fmt: skip
    """Prefetch of what the task reads from HBM and no task writes: the first PF_CHUNKS x PF_BYTES bytes of each of
    its weight matrices' rows [lo, hi) (_prefetch_weights), or for ATTN of its split's cached K and of its V rows, into
    L2 (a line prefetch each half). Whole splits overran L2 at long contexts (16384: 33-67 MB a layer)."""
    if kind == 1:
        a, e = _split_range(position, S, split)
        e = tl.minimum(e, a + PF_CHUNKS * PF_BYTES // (D * (KV.dtype.element_ty.primitive_bitwidth // 8)))
        kbase, vbase = _kv_bases(KV, layer, lo, MAXSEQ, HK, D)
        for p0 in range(a, e, PF_CHUNKS):
            p = p0 + tl.arange(0, PF_CHUNKS)
            for half in tl.static_range(2):
                _prefetch_lines(kbase + p * (HK * D) + half * (D // 2), p < e)
                _prefetch_lines(vbase + p * (HK * D) + half * (D // 2), p < e)
    elif kind == 0:
        _prefetch_weights(_ptr(W, OFFS, B_WQKV, layer), lo, hi, H, PF_CHUNKS, PF_BYTES)
    elif kind == 2:
        _prefetch_weights(_ptr(W, OFFS, B_WO, layer), lo, hi, QD, PF_CHUNKS, PF_BYTES)
    elif kind == 3:
        _prefetch_weights(_ptr(W, OFFS, B_WG, layer), lo, hi, H, PF_CHUNKS, PF_BYTES)
        _prefetch_weights(_ptr(W, OFFS, B_WU, layer), lo, hi, H, PF_CHUNKS, PF_BYTES)
    elif kind == 4:
        _prefetch_weights(_ptr(W, OFFS, B_WD, layer), lo, hi, INTER, PF_CHUNKS, PF_BYTES)


@triton.jit
def _now(i, phase: tl.constexpr, INTERPRET: tl.constexpr):
    """A trace timestamp: %globaltimer (ns) on the GPU; in the interpreter a logical clock, 3 ticks a queue entry in
    order (wait, run, end), which checks the trace's bookkeeping and format, not time."""
    if INTERPRET:
        return tl.full([], 3 * i + phase, tl.int64)
    else:
        return _globaltimer()


@triton.jit
def _report(ERR, pid, t, cid, v, target):
    """The first stuck program records (flag, program, task, counter, value seen, expected); the flag also aborts."""
    if tl.atomic_cas(ERR, 0, 1, sem="relaxed", scope="gpu") == 0:
        tl.store(ERR + 1, pid)
        tl.store(ERR + 2, t)
        tl.store(ERR + 3, cid)
        tl.store(ERR + 4, v)
        tl.store(ERR + 5, target)


@triton.jit
def _wait(ptr, target, alive, ERR, pid, t, cid, timeout_ns, INTERPRET: tl.constexpr, DEBUG: tl.constexpr,
          ONE_POLLER: tl.constexpr, SLEEP_NS: tl.constexpr):  # fmt: skip
    """Returns alive once counter *ptr >= target, or alive * 0 when the step aborts (watchdog / interpreter).

    On the GPU every thread spins on its own acquire loads (no barrier in the loop), so threads leave at different
    moments; without the watchdog each leaves only once it has seen the target (monotonic counters), a uniform
    outcome. With it a thread may also leave on its timeout or the abort flag, so one thread's acquire RMW, broadcast
    to the CTA (Triton's scalar atomics), decides uniformly whether the task runs or the program aborts. ONE_POLLER
    (no watchdog): thread 0 alone spins; the others wait for it at the caller's CTA barrier."""
    if INTERPRET:  # programs run one after another: a wait not met now never will be
        v = tl.load(ptr)
        if v < target:
            _report(ERR, pid, t, cid, v, target)
            alive = alive * 0
    elif ONE_POLLER and not DEBUG:
        _spin_one_thread(ptr, target, SLEEP_NS)
    else:
        v = _ld_acquire(ptr)
        ns = pid * 0 + (32 if SLEEP_NS >= 32 else SLEEP_NS)
        if DEBUG:
            start = _globaltimer()
            go = v < target
            while go:
                _nanosleep(ns)
                ns = tl.minimum(ns * 2, SLEEP_NS)
                v = _ld_acquire(ptr)
                go = (v < target) & (_ld_acquire(ERR) == 0) & (_globaltimer() - start <= timeout_ns)
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            if v < target:  # timed out here, or another program's watchdog fired
                _report(ERR, pid, t, cid, v, target)
                alive = alive * 0
        else:
            while v < target:
                _nanosleep(ns)
                ns = tl.minimum(ns * 2, SLEEP_NS)
                v = _ld_acquire(ptr)
    return alive


@triton.jit
def _arrive(WAITS, wait_lo, wait_hi, COUNTERS, epoch, ERR, pid, t, qi, timeout_ns, TRACE, INTERPRET: tl.constexpr,
            DEBUG: tl.constexpr, ONE_POLLER: tl.constexpr, SLEEP_NS: tl.constexpr, PDL: tl.constexpr,
            TRACING: tl.constexpr):  # fmt: skip
    """What a task waits for before it reads what others write: each wait (counter >= epoch x threshold) of
    WAITS[wait_lo:wait_hi], then a CTA barrier (no warp reads before every warp has seen the counters) and, TRACING,
    the task's run start (qi: its queue entry, the interpreter's clock); in a staged launch with PDL the previous
    launch instead. Returns 1, or 0 when the step was aborted (watchdog / interpreter)."""
    alive = pid * 0 + 1
    if PDL and not INTERPRET:  # (the interpreter runs launches one after another anyway)
        tl.extra.cuda.gdc_wait()  # the previous launch has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the next launch may start its prologue (weight prefetch)
    for w in range(wait_lo, wait_hi):
        if alive != 0:
            cid = tl.load(WAITS + 2 * w)
            target = tl.load(WAITS + 2 * w + 1) * epoch
            alive = _wait(COUNTERS + cid, target, alive, ERR, pid, t, cid, timeout_ns, INTERPRET, DEBUG, ONE_POLLER,
                          SLEEP_NS)  # fmt: skip
    if alive != 0:
        tl.debug_barrier()
        if TRACING:
            tl.store(TRACE + 4 * t + 1, _now(qi, 1, INTERPRET))
    return alive


@triton.jit(do_not_specialize=["epoch", "position", "task0"])  # one compile for every step
def decode_kernel(
    W,
    A,
    KV,
    XIN,
    OUT,
    ROPE,
    TASKS,
    WAITS,
    QPTR,
    QTASKS,
    COUNTERS,
    ERR,
    TRACE,
    epoch,
    position,
    task0,
    NL,
    H,
    INTER,
    HK,
    MAXSEQ,
    S,
    eps,
    sm_scale,
    timeout_ns,
    OFFS: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BN_QKV: tl.constexpr,
    BK_QKV: tl.constexpr,
    BN_O: tl.constexpr,
    BK_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BK_GU: tl.constexpr,
    BN_D: tl.constexpr,
    BK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GC: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    PF_CHUNKS: tl.constexpr,
    PF_BYTES: tl.constexpr,
    EVICT: tl.constexpr,
    ONE_POLLER: tl.constexpr,
    SLEEP_NS: tl.constexpr,
    MODE: tl.constexpr,
    KIND: tl.constexpr,
    INTERPRET: tl.constexpr,
    DEBUG: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    TRACING: tl.constexpr,
):
    """PERSISTENT: program pid runs QTASKS[QPTR[pid]:QPTR[pid + 1]], each after its waits (counter >= epoch x
    threshold), then signals its counter; with TRACING, TRACE[t] (int64 x 4) gets task t's (wait start, run start,
    end, program). STAGED: program pid runs task task0 + pid of kind KIND, no counters (the launch order is the
    dependency; with PDL, griddepcontrol waits for the previous launch)."""
    pid = tl.program_id(0)
    QD = HK * G * D
    if MODE == 1:
        t = task0 + pid
        layer = tl.load(TASKS + t * NF + 1)
        lo = tl.load(TASKS + t * NF + 2)
        hi = tl.load(TASKS + t * NF + 3)
        split = tl.load(TASKS + t * NF + 4)
        if PREFETCH:
            _prefetch_task(KIND, layer, lo, hi, split, W, KV, OFFS, position, H, INTER, QD, HK, MAXSEQ, S, D,
                           PF_CHUNKS, PF_BYTES)  # fmt: skip
        _arrive(WAITS, 0, 0, COUNTERS, epoch, ERR, pid, t, 0, timeout_ns, TRACE, INTERPRET, DEBUG, ONE_POLLER,
                SLEEP_NS, PDL, False)  # fmt: skip
        _task(KIND, layer, lo, hi, split, W, A, KV, XIN, OUT, OFFS, ROPE, position, NL, H, INTER, HK, MAXSEQ, S,
              eps, sm_scale, G, D, BLOCK_H, BN_QKV, BK_QKV, BN_O, BK_O, BN_GU, BK_GU, BN_D, BK_D, BLOCK_S, BLOCK_T,
              BLOCK_G, BLOCK_GC, BLOCK_DH, EVICT, INTERPRET)  # fmt: skip
    else:
        alive = pid * 0 + 1
        q0, q1 = tl.load(QPTR + pid), tl.load(QPTR + pid + 1)
        for i in range(q0, q1):
            if alive != 0:
                t = tl.load(QTASKS + i)
                kind = tl.load(TASKS + t * NF)
                layer = tl.load(TASKS + t * NF + 1)
                lo = tl.load(TASKS + t * NF + 2)
                hi = tl.load(TASKS + t * NF + 3)
                split = tl.load(TASKS + t * NF + 4)
                if TRACING:
                    tl.store(TRACE + 4 * t, _now(i, 0, INTERPRET))
                    tl.store(TRACE + 4 * t + 3, pid.to(tl.int64))
                if PREFETCH:  # weights never wait: streamed to L2 before spinning
                    _prefetch_task(kind, layer, lo, hi, split, W, KV, OFFS, position, H, INTER, QD, HK, MAXSEQ, S, D,
                                   PF_CHUNKS, PF_BYTES)  # fmt: skip
                alive = _arrive(WAITS, tl.load(TASKS + t * NF + 5), tl.load(TASKS + t * NF + 6), COUNTERS, epoch,
                                ERR, pid, t, i, timeout_ns, TRACE, INTERPRET, DEBUG, ONE_POLLER, SLEEP_NS, False,
                                TRACING)  # fmt: skip
                if alive != 0:
                    _task(kind, layer, lo, hi, split, W, A, KV, XIN, OUT, OFFS, ROPE, position, NL, H, INTER, HK,
                          MAXSEQ, S, eps, sm_scale, G, D, BLOCK_H, BN_QKV, BK_QKV, BN_O, BK_O, BN_GU, BK_GU, BN_D,
                          BK_D, BLOCK_S, BLOCK_T, BLOCK_G, BLOCK_GC, BLOCK_DH, EVICT, INTERPRET)  # fmt: skip
                    tl.debug_barrier()  # every warp's stores issued before the release
                    if TRACING:
                        tl.store(TRACE + 4 * t + 2, _now(i, 2, INTERPRET))
                    tl.atomic_add(COUNTERS + tl.load(TASKS + t * NF + 7), 1, sem="release", scope="gpu")


# ------------------------------------------------------------------------------------------------------------- host


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


class Megakernel:
    """The arenas, tables and launches of decode_kernel for one graph and schedule on one device, allocated once.

    Weights live in one arena W of their dtype (each buffer 64-element aligned), activations in one float32 arena A
    (NaN-filled at allocation), the RoPE table (cos, sin of position x inv_freq for every position, float64 -> float32)
    beside; x[0] is read from the step's input and the last layer's DOWN writes the step's output. On a CPU tensor
    device (TRITON_INTERPRET=1) the kernel runs in Triton's interpreter with grid=(1,) over one queue holding every
    task in a legal interleaving of the schedule's queues: the waits are then plain loads that must already be met
    (a wait that is not records the stuck task like the watchdog), so the interpreter checks the task bodies and the
    counter bookkeeping, not the spinning, prefetch and memory ordering, which only the GPU runs.

    Launch options: `num_warps` a CTA; `prefetch` the persistent kernel's L2 prefetch of a task's weights (ATTN: its
    split's K / V rows) before its waits (sm_90+; True, the default, or None); `weights_evict_first` (default True)
    marks the GEMV weight loads L2 evict_first; `one_poller` (default True) has thread 0 of a CTA alone poll a counter
    (the others wait at a barrier; False: every thread polls); `poll_sleep_ns` the ceiling of the polls' nanosleep
    backoff (32 ns doubling; 0: none, sensible with one_poller only); `prefetch_bytes` what is prefetched of each weight
    matrix of a task, and of an ATTN split's K and of its V rows (default PREFETCH_BYTES; None: all of a weight task, as
    many bytes of a split); `tile_budget` (a power of two) the elements of a GEMV weight tile, which set the BLOCK_K of
    every projection: _gemv keeps two tiles in flight."""

    def __init__(
        self,
        graph: TaskGraph,
        sched: Schedule,
        packed: dict,
        device,
        *,
        debug: bool = False,
        timeout_s: float = 1.0,
        num_warps: int = 8,
        prefetch: bool | None = True,
        prefetch_bytes: int | None = PREFETCH_BYTES,
        tile_budget: int = TILE_BUDGET,
        weights_evict_first: bool = True,
        one_poller: bool = True,
        poll_sleep_ns: int = 256,
        seed: int | None = None,
    ):
        import random

        import torch

        from tile_kernels.core.host import interpreting

        from .check import run_queues

        c, t = graph.config, graph.tiling
        self.graph, self.schedule, self.debug, self.num_warps = graph, sched, debug, num_warps
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:N, never "cuda"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.interpret = self.device.type == "cpu"
        if self.interpret != interpreting():
            raise RuntimeError(
                f"megakernel: tensors on {self.device} need TRITON_INTERPRET "
                + ("=1 set before importing triton (CPU: Triton's interpreter)" if self.interpret else "unset (GPU)")
            )
        if not self.interpret and (torch.version.hip or torch.cuda.get_device_capability(self.device) < (7, 0)):
            raise RuntimeError(
                "megakernel: the persistent kernel's waits are NVIDIA PTX (acquire loads, nanosleep: sm_70+; the bulk "
                f"L2 prefetch sm_90+), got {torch.cuda.get_device_name(self.device)}"
                + (" (ROCm)" if torch.version.hip else "")
            )
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"megakernel: timeout_s must be a number > 0, got {timeout_s!r}")
        if type(tile_budget) is not int or tile_budget < 1 or tile_budget & (tile_budget - 1):
            raise ValueError(f"megakernel: tile_budget must be a power of two (elements), got {tile_budget!r}")
        self.tile_budget = tile_budget
        if prefetch not in (None, False, True):
            raise ValueError(f"megakernel: prefetch must be True or None, got {prefetch!r}")
        if type(poll_sleep_ns) is not int or not 0 <= poll_sleep_ns <= 1_000_000:
            raise ValueError(f"megakernel: poll_sleep_ns must be an int in [0, 1000000], got {poll_sleep_ns!r}")
        flags = (("weights_evict_first", weights_evict_first), ("one_poller", one_poller))
        for name, flag in flags:
            if type(flag) is not bool:
                raise TypeError(f"megakernel: {name} must be a bool, got {flag!r}")
        if prefetch_bytes is not None and (type(prefetch_bytes) is not int or prefetch_bytes < 16):
            raise ValueError(f"megakernel: prefetch_bytes must be None or an int >= 16, got {prefetch_bytes!r}")
        weights = [packed[f"{b}[{layer}]"] for b in WEIGHTS for layer in range(c.num_layers)]
        self.dtype = weights[0].dtype
        align = ALIGN.value
        # each buffer's layers one after another at a stride of its aligned size (x[0], the step's input, keeps an
        # unused slot; x[L] is the step's output tensor): (base, stride) a buffer, in its arena
        layout, size = [], {"A": 0, "W": 0}
        for b in BUFFERS:
            sizes = {graph.buffers[n] for n in (f"{b}[{layer}]" for layer in range(c.num_layers)) if n in graph.buffers}
            if len(sizes) != 1:
                raise ValueError(f"megakernel: buffer {b} must have one size in every layer, got {sorted(sizes)}")
            arena, stride = "W" if b in WEIGHTS else "A", -(-sizes.pop() // align) * align
            layout.append((size[arena], stride))
            size[arena] += c.num_layers * stride
        self.layout = tuple(layout)
        self.W = torch.empty(max(size["W"], 1), dtype=self.dtype, device=self.device)
        for b in WEIGHTS:
            for layer in range(c.num_layers):
                w, start = packed[f"{b}[{layer}]"], self._offset(b, layer)
                self.W[start : start + w.numel()].copy_(w.reshape(-1))
        self.A = torch.full((max(size["A"], 1),), float("nan"), dtype=torch.float32, device=self.device)
        angle = torch.arange(c.max_seq, dtype=torch.float64)[:, None] * torch.tensor(c.rope_inv_freq())[None, :]
        self.rope = torch.stack([angle.cos(), angle.sin()]).to(torch.float32).reshape(-1).to(self.device)
        if self.interpret:  # one queue: a legal interleaving, then whatever could not run (the kernel reports it)
            pick = random.Random(seed).choice if seed is not None else None
            order, stuck = run_queues(graph, sched.queues, pick=pick)
            done = set(order)
            rest = [tid for q, _ in stuck for tid in sched.queues[q] if tid not in done]
            queues = Schedule((tuple(order + rest),))
        else:
            queues = sched
        enc = encode(graph, queues)
        self.grid = (len(queues.queues),)
        tables = {k: torch.from_numpy(enc[k]).to(self.device) for k in ("tasks", "waits", "queue_ptr", "queue_tasks")}
        self.tasks, self.waits, self.queue_ptr, self.queue_tasks = (tables[k] for k in tables)
        if self.waits.numel() == 0:
            self.waits = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.counters = torch.zeros(max(1, len(graph.counters)), dtype=torch.int32, device=self.device)
        self.err = torch.zeros(len(ERR_FIELDS), dtype=torch.int32, device=self.device)
        self.max_threshold = max((th for task in graph.tasks for _, th in task.waits), default=1)
        self.epoch = 0
        # stages for the staged (per-op launch) baseline: runs of consecutive tasks of one kind and layer
        self.stages: list[tuple[int, int, int]] = []
        for task in graph.tasks:
            last = self.stages[-1] if self.stages else None
            if last and last[0] == task.kind and graph.tasks[last[1]].layer == task.layer:
                self.stages[-1] = (last[0], last[1], last[2] + 1)
            else:
                self.stages.append((int(task.kind), task.id, 1))
        es = self.W.element_size()
        ks = (c.hidden, c.intermediate, c.q_size)
        budget = tile_budget

        def bk(bn: int, k: int) -> int:
            return max(16, min(_pow2(k), budget // bn))

        nqkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        rows = {"qkv": (t.qkv, nqkv), "o": (t.o, c.hidden), "gu": (t.gateup, c.intermediate), "d": (t.down, c.hidden)}
        bn = {k: _pow2(min(r, n)) for k, (r, n) in rows.items()}
        max_bytes = max(
            min(t.qkv, nqkv) * c.hidden, min(t.o, c.hidden) * c.q_size, min(t.gateup, c.intermediate) * c.hidden,
            min(t.down, c.hidden) * c.intermediate,
        ) * es  # fmt: skip
        # the bulk L2 prefetch needs sm_90+ and rows of whole 16-byte chunks. The per-op launches (staged, the CUDA
        # graph baselines) always prefetch whole weight tasks where they can: with PDL it is what runs before the wait
        capable = (not self.interpret and torch.cuda.get_device_capability(self.device) >= (9, 0)
                   and all(k * es % 16 == 0 for k in ks))  # fmt: skip
        self.prefetch = int(bool(prefetch) and capable)
        pf_chunks = 32 * num_warps  # one chunk a thread

        def pf_bytes(nbytes: int) -> int:  # a chunk's bytes: nbytes in pf_chunks chunks, a multiple of 16
            return max(16, -(-nbytes // (pf_chunks * 16)) * 16)

        self.staged_prefetch, self.staged_pf_bytes = capable, pf_bytes(max_bytes)
        self.meta = dict(
            OFFS=self.layout,
            G=c.group,
            D=c.head_dim,
            BLOCK_H=_pow2(c.hidden),
            BN_QKV=bn["qkv"],
            BK_QKV=bk(bn["qkv"], c.hidden),
            BN_O=bn["o"],
            BK_O=bk(bn["o"], c.q_size),
            BN_GU=bn["gu"],
            BK_GU=bk(2 * bn["gu"], c.hidden),
            BN_D=bn["d"],
            BK_D=bk(bn["d"], c.intermediate),
            BLOCK_S=_pow2(t.kv_splits),
            BLOCK_T=ATTN_BLOCK_T,
            BLOCK_G=max(16, _pow2(c.group)),  # tl.dot's operands: >= 16 along every dimension
            BLOCK_GC=_pow2(c.group),  # COMBINE's heads (no dot: no padding to 16)
            BLOCK_DH=max(16, _pow2(c.head_dim // 2)),
            PF_CHUNKS=pf_chunks,
            PF_BYTES=pf_bytes(max_bytes if prefetch_bytes is None else min(max_bytes, prefetch_bytes)),
            EVICT="evict_first" if weights_evict_first else "",
            ONE_POLLER=one_poller,
            SLEEP_NS=poll_sleep_ns,
            INTERPRET=self.interpret,
            DEBUG=bool(debug),
            PREFETCH=self.prefetch,
        )
        self.timeout_ns = int(timeout_s * 1e9)
        self.scalars = (c.num_layers, c.hidden, c.intermediate, c.num_kv_heads, c.max_seq, t.kv_splits, c.rms_eps,
                        c.head_dim**-0.5)  # fmt: skip

    def scratch(self, name: str):
        """The float32 arena's view of the graph buffer `name` (e.g. "qkv[0]"), for tests and debugging."""
        b, layer = name[: name.index("[")], int(name[name.index("[") + 1 : -1])
        if b not in SCRATCH or name not in self.graph.buffers or name in self.graph.inputs or name == self.graph.output:
            raise ValueError(f"megakernel: {name!r} is not a scratch buffer of the arena")
        start = self._offset(b, layer)
        return self.A[start : start + self.graph.buffers[name]]

    def _offset(self, buffer: str, layer: int) -> int:
        """Element offset of `buffer`'s layer in its arena: the layout _ptr reads in the kernel."""
        base, stride = self.layout[BUFFERS.index(buffer)]
        return base + layer * stride

    def _check(self, hidden, kv_cache, position):
        from .reference import check_step_inputs

        check_step_inputs(self.graph.config, hidden, kv_cache, position)
        if hidden.device != self.device or kv_cache.device != self.device:
            raise ValueError(
                f"megakernel: hidden and kv_cache must be on {self.device}, got {hidden.device} and {kv_cache.device}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("megakernel: kv_cache must be contiguous (it is updated in place), got a strided view")
        x = hidden.reshape(-1).contiguous()
        return x, x.new_empty(x.shape)

    def _launch(self, grid, x, out, kv_cache, position, epoch, task0, mode, kind=-1, pdl=False, trace=None):
        extra = {} if self.interpret else {"num_warps": self.num_warps}
        if mode == PERSISTENT and not self.interpret:
            extra["launch_cooperative_grid"] = True  # an over-sized grid fails at launch instead of hanging
        if pdl:
            extra["launch_pdl"] = True
        if mode == STAGED:
            extra["PREFETCH"], extra["PF_BYTES"] = int(self.staged_prefetch), self.staged_pf_bytes
        import contextlib

        import torch

        with contextlib.nullcontext() if self.interpret else torch.cuda.device(self.device):  # its stream
            decode_kernel[grid](
                self.W, self.A, kv_cache, x, out, self.rope, self.tasks, self.waits, self.queue_ptr,
                self.queue_tasks, self.counters, self.err, self.err if trace is None else trace, epoch, position,
                task0, *self.scalars, self.timeout_ns, MODE=mode, KIND=kind, PDL=pdl, TRACING=trace is not None,
                **{**self.meta, **extra},
            )  # fmt: skip

    def __call__(self, hidden, kv_cache, position: int, trace=None):
        """One decode step in one launch: writes kv_cache[:, :, position] in place, returns the new hidden. `trace`
        (an int64 (num_tasks, 4) tensor on the device) receives each task's (wait start, run start, end, program):
        see trace.py."""
        x, out = self._check(hidden, kv_cache, position)
        self.epoch += 1
        if self.epoch * self.max_threshold > 2**31 - 1:  # before int32 wraps: the only reset of the counters
            self.counters.zero_()
            self.epoch = 1
        self._launch(self.grid, x, out, kv_cache, position, self.epoch, 0, PERSISTENT, trace=trace)
        if self.interpret or self.debug:
            self.raise_if_stuck()
        return out.reshape(hidden.shape)

    def raise_if_stuck(self) -> None:
        """After a launch (synchronizes): raises RuntimeError naming the stuck task and counter when a wait was not
        met (the debug watchdog on a GPU, at once in the interpreter); the counters restart at epoch 0 then."""
        flag, pid, tid, cid, value, expected = self.err.tolist()
        if not flag:
            return
        self.err.zero_()
        self.counters.zero_()
        self.epoch = 0
        g = self.graph
        task = g.tasks[tid] if 0 <= tid < len(g.tasks) else None
        raise RuntimeError(
            f"megakernel: program {pid} stuck at {task.label if task else f'task {tid}'} waiting for "
            f"{g.counters[cid] if 0 <= cid < len(g.counters) else f'counter {cid}'} = {value} < {expected}"
            + (" (the watchdog's timeout ran out; the step was aborted)" if not self.interpret else "")
        )

    def staged(self, hidden, kv_cache, position: int, pdl: bool = False):
        """The same task bodies as one launch per stage (op of a layer), in order, no counters: the CUDA graph
        (+ PDL) baseline of the benchmark. With pdl, each launch prefetches its weights, then griddepcontrol-waits
        for the previous one (programmatic dependent launch)."""
        x, out = self._check(hidden, kv_cache, position)
        for kind, first, count in self.stages:
            self._launch((count,), x, out, kv_cache, position, 0, first, STAGED, kind, pdl)
        return out.reshape(hidden.shape)


def compile_ahead(meta: dict, weight_dtype: str = "bf16", kv_dtype: str = "bf16", arch: int = 90, **modes):
    """Compiles decode_kernel for an NVIDIA target without a GPU (TRITON_INTERPRET unset): the GPU path's PTX (the
    acquire loads, nanosleep, globaltimer, bulk L2 prefetch, griddepcontrol) through ptxas. `meta` is a
    Megakernel's meta (INTERPRET is overridden to False); `modes` sets MODE, KIND, DEBUG, PREFETCH, PDL, TRACING."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = dict(W=weight_dtype, A="fp32", KV=kv_dtype, XIN=weight_dtype, OUT=weight_dtype, ROPE="fp32")
    ptrs |= {k: "i32" for k in ("TASKS", "WAITS", "QPTR", "QTASKS", "COUNTERS", "ERR")} | {"TRACE": "i64"}
    ints = ("epoch", "position", "task0", "NL", "H", "INTER", "HK", "MAXSEQ", "S")
    const = {**meta, "INTERPRET": False, "MODE": PERSISTENT, "KIND": -1, "PDL": False, "TRACING": False, **modes}
    const["OFFS"] = tuple(tuple(pair) for pair in const["OFFS"])  # (from JSON: lists)
    signature = {k: "*" + v for k, v in ptrs.items()} | dict.fromkeys(ints, "i32")
    signature |= {"eps": "fp32", "sm_scale": "fp32", "timeout_ns": "i64"} | dict.fromkeys(const, "constexpr")
    # what a launch specializes: 16-byte aligned tensors, ints divisible by 16 (here the model's widths)
    aligned = [k for k in (*ptrs, "H", "INTER") if k not in const]
    attrs = {(decode_kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    source = ASTSource(decode_kernel, signature, constexprs=const, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
