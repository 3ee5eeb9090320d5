"""Design of the persistent Triton kernel that will run a checked schedule in one launch (not written yet: this module
holds no code on purpose; build_decode_step(backend="triton") says so).

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
