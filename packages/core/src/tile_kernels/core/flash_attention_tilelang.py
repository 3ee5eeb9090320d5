"""flash_attention's TileLang forward (backend="tilelang"): the math of flash_attention.py, written in TileLang.

One program per (BLOCK_M queries, query head, batch entry); query head h reads key/value head h // (Hq / Hk). The
query tile stays in shared memory; the key/value tiles of the block's visible band stream through a T.Pipelined
loop of `stages` buffers. Per key block, in base-2 units (c = log2(e)):
    s = scale * c * q.k^T            (softcap: s = softcap * c * tanh(scale * q.k^T / softcap), tanh from exp2)
    s = -inf where key j is invisible to query i (only on blocks the band does not cover entirely, a runtime test)
    m' = max(m, rowmax(s)),  p = exp2(s - m'),  l = l * exp2(m - m') + rowsum(p),  acc = acc * exp2(m - m') + p V
then out = acc / l (0 where l = 0) and lse = m + log2(l) (+inf where l = 0): exactly the (out, lse) of the Triton
forward, so its backward (flash_attention.backward) gives the gradients. m starts at -1e30 (finite: no inf - inf;
scores never get that low), so a row that has seen no key keeps l = 0 and acc = 0.

Kernels: one per (dtype, head-dim bucket D in 64 / 128 / 256, EVEN: the head dim is D, SOFTCAP) and architecture.
Causal / windowed / full attention share one kernel: the band (left, right) is a pair of runtime ints as in the
Triton kernels (unbounded = Sq + Sk). Sizes B, Sq, Sk, Hq, Hk (and the head dim when not EVEN) are dynamic: no
recompiles per shape. EVEN kernels address the tiles as whole rows, so TileLang lowers the tile copies to TMA on
sm_90a (and cp.async on sm_80), its GEMMs to wgmma on sm_90a (mma.sync on sm_80, MFMA on gfx942) and, on sm_90a,
splits the loop into a TMA producer warp group and wgmma consumers (warp specialization); all of that is TileLang's
choice per target, no Hopper-only path is written here. A head dim below its bucket pads the tiles with zeros
(predicated copies; TMA off: its row strides need not be 16-byte multiples). Inputs are compact (B, S, H, D) in
float16 / bfloat16 (`unsupported` says why another input cannot run: float32 would run its products in TF32).

Design limits: sequence lengths below 2^31 (TMA coordinates and the band arithmetic are int32; the padded kernels'
offsets are int64); B and Hq up to 65535 (grid dims y, z of the forward; the backward's: Sk / BLOCK_N and Hk B / chunk);
TMA needs 16-byte aligned bases (torch / JAX allocations are).

Performance (H200, 2026-11-29, bf16 4x8192x32x128): 535 TFLOP/s forward (77% of the measured GEMM ceiling; causal
490), against the Triton forward's 488 and cuDNN's 590. What TileLang 0.1.15 generates for sm_90a (the .cu that
`tile-kernels aot --target cuda:90 --op flash_attention --out DIR` writes): a TMA producer warp group (registers
released to 24) and two wgmma consumer groups (240 each), K and V in 2 stages, and a `warpgroup_wait<0>` after each
GEMM: a group's softmax never overlaps its own GEMMs, only the other group's.
The OVERLAP configurations (CONFIGS) run another loop instead, FA3's intra-warpgroup order written as an explicit
warp-specialization schedule (T.WSSchedule: roles, full / empty barrier pipelines for q, k, v, per-role op order with
software-pipeline stages): at step t each consumer group issues S(t) = Q K(t)^T and O += P(t-1) V(t-1) without
waiting, waits for the first (wgmma groups complete in order), releases K(t) to the producer, computes P(t) while the
second runs, then waits, releases V(t-1) and rescales O. V's ops sit one stage behind K's, so the schedule unrolls a
prologue (S(0), P(0)) and an epilogue (the last P V); the output tile reuses q's shared memory.

Backward (sm_90a, head dims up to 128; elsewhere backend="tilelang" keeps the Triton backward:
backward_unsupported), FlashAttention-2/3 style, three kernels:
  * flash_bwd_pre: delta_i = sum_d dO_i * O_i, as the Triton preprocess, and a copy of lse, both (B, Hq, Sq rounded
    up to BLOCK_M) (+inf / 0 in the padding): rows the main kernel's TMA loads with 16-byte aligned strides.
  * flash_bwd: one program per (BLOCK_N keys, key/value head, batch entry). K and V stay in shared memory, dK and dV
    accumulate in registers (split by rows over the two consumer warp groups), and one T.Pipelined loop walks the
    (query head of the group, query block) pairs whose block sees some key of the program's (GQA: the Hq / Hk heads
    of the group in turn, so dK / dV need no atomics). Per pair, on transposed scores (keys x queries), c = log2(e):
        S^T = K Q^T,  dP^T = V dO^T                                  (wgmma, operands in shared memory)
        P^T = exp2(scale c S^T - lse)   (softcap: exp2(softcap c t - lse), t = tanh(scale S^T / softcap))
        dS^T = P^T (dP^T - delta) (* (1 - t^2) with softcap);  P^T = dS^T = 0 where the key is invisible
        dV += P^T dO,  dK += dS^T Q                                   (P^T, dS^T from registers)
        dQ_acc[b, h, rows] += dS K                                    (dS^T via shared memory; fp32 reduce-add)
    then dK = scale dK, dV: stored in q's dtype. lse is the forward's, in base 2 (+inf where a row sees no key: P = 0).
    The dQ accumulator is fp32 (B, Hq, Sq rounded up to BLOCK_M, bucket head dim), zeroed by the caller, updated in
    place (the kernel's DQ_IN and DQ_ACC parameters are that one buffer: the Call reads and writes it); on sm_90a
    each block's dS K tile goes out as one TMA reduce-add (cp.reduce.async.bulk), elsewhere as atomic adds.
  * flash_bwd_post: dQ = scale dQ_acc, in q's dtype and (B, Sq, Hq, D) layout.
The band is the forward's: (left, right) runtime ints, query blocks outside it are skipped, and blocks the band covers
entirely (inside Sq and Sk) skip the mask (a runtime test per block).
Backward design limits: as the forward's, plus head dims up to 128 (dK and dV of a 128-key block take 128 fp32
registers a thread at head dim 128; the 256 bucket would need 256), and dQ summed by fp32 atomics (not
bit-deterministic run to run). Configurations (BLOCK_M, BLOCK_N, stages, threads, SCHEDULE): BWD_CONFIGS, the first per
bucket the default, the others selected by a "_c<i>" suffix of the kernel name (the benchmark's sweep).
"""

from .backends import tilelang_entry_points, tilelang_target, ws_roles, ws_warps

LOG2E = 1.4426950408889634
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)  # the buckets; smaller head dims pad up to the next one
# nvcc --use_fast_math: exp2 / log2 as single MUFU instructions (ex2 / lg2.approx, relative error ~2^-22; exp2(-inf)
# is still 0), approximate divisions. It would also turn tanhf into tanh.approx (error ~2^-11, times softcap * log2(e)
# in the exponent): the softcap's tanh is written with exp2 instead.
FAST_MATH = {"tl.enable_fast_math": True}

# Forward (BLOCK_M, BLOCK_N, stages, threads, OVERLAP) per architecture family and head-dim bucket; the first is the
# default, the others selected by a "_c<i>" suffix of the kernel name (the sweep's candidates). sm_90a: 128 x 128
# tiles, two consumer warp groups (TileLang adds the producer); the 256 bucket halves BLOCK_N to fit 227 KiB of shared
# memory (q 64 KiB + 2 stages of k, v 32 KiB each; the output tile reuses q's). sm_80 (163 KiB) / gfx942 (64 KiB LDS):
# smaller. OVERLAP (sm_90a, head dims that fill their bucket; padded ones take the first synchronous configuration):
# FA3's intra-warpgroup
# order under an explicit warp-specialization schedule, 3 stages where they fit (q + 3 x (k + v)
# = 224 KiB at head dim 128), FA3's 128 x 176 tiles at head dim 128 (208 KiB) and 192 x 128 at 64 (three consumer
# warp groups at 160 registers). Built for sm_90a without spills. Head dim 128's default is OVERLAP in 3 stages:
# H100, 2026-12-06, bf16 4 x 8192 x 32 heads, 7.51 / 4.05 ms non-causal / causal against 8.05 / 4.60 for the
# synchronous 128 x 128 (benchmarks/results/h200/notes.md); at 64 none beat it (0.240-0.252 against 0.241 ms).
CONFIGS = {
    "sm90": {64: [(128, 128, 2, 256, False), (128, 128, 2, 256, True), (128, 128, 3, 256, True),
                  (192, 128, 2, 384, True)],
             128: [(128, 128, 3, 256, True), (128, 128, 2, 256, False), (128, 128, 2, 256, True),
                   (128, 176, 2, 256, True)],
             256: [(128, 64, 2, 256, False), (128, 64, 2, 256, True)]},
    "sm80": {64: [(128, 64, 2, 128, False)], 128: [(128, 64, 2, 256, False)], 256: [(64, 32, 2, 128, False)]},
    "hip": {64: [(64, 64, 1, 256, False)], 128: [(64, 32, 1, 256, False)], 256: [(32, 32, 1, 128, False)]},
}  # fmt: skip


# Backward (BLOCK_M queries per step, BLOCK_N keys per program, stages, threads, SCHEDULE) per family and bucket; the
# first is the default. sm_90a: two consumer warp groups of 64 key rows each (plus the producer); shared memory at head
# dim 128: K, V 32 KiB each, 2 stages of Q, dO 16 KiB each, dS^T 16 KiB, the dQ tile 32 KiB (fp32) ~ 177 KiB.
# SCHEDULE (kernels with softcap run "sync"; "ws" needs EVEN and sm_90a, else "async"):
#   "sync"   TileLang's automatic warp specialization, every wgmma waited for.
#   "async"  the same, with S^T's and dP^T's wgmmas issued together and P^T computed while dP^T's runs. On an H100
#            (causal, bf16, 2026-12-05, benchmarks/sweep_flash_attention_tilelang_bwd.py) 13.58 -> 13.22 ms at head
#            dim 128 (B 4, S 8192, 32 heads), 8.16 -> 7.74 at 64, 0.778 -> 0.755 at Llama-3.2-1B's B 4, S 2048, 32 / 8.
#   "ws"     an explicit warp-specialization schedule (T.WSSchedule), where a buffer goes back to the producer only
#            after the wgmmas reading it are waited for: per step S^T, dP^T issued; P^T once S^T is in; dV issued;
#            dS^T once dP^T is in (dV still running); dK and dQ issued; one wait for the three. The TMA warp adds each
#            dQ tile into the accumulator a step behind (a two-deep dQ pipeline), and dK, dV leave through K's and V's
#            tiles. Built for sm_90a without spills (the 128 x 128 tiles at head dim 64 spill 48 B). Head dim 128's
#            default: H100, 2026-12-06, bf16 4 x 8192 x 32 heads, 22.72 / 12.70 ms non-causal / causal against 24.17 /
#            13.17 for "async"; at 64 within 1% of "async" (0.761 against 0.766 ms), which stays.
# sm_80 / gfx942: one row split for all five GEMMs (4 warps of 16 key rows: the layouts of S^T and of dS^T as an
# operand agree), smaller tiles; lowered and built by the AOT matrix, not measured.
BWD_HEAD_DIMS = (64, 128)
BWD_CONFIGS = {
    "sm90": {64: [(128, 128, 2, 256, "async"), (128, 128, 2, 256, "sync"), (64, 128, 2, 256, "sync"),
                  (64, 128, 3, 256, "sync"), (128, 128, 2, 256, "ws"), (64, 128, 2, 256, "ws")],
             128: [(64, 128, 2, 256, "ws"), (64, 128, 2, 256, "async"), (64, 128, 2, 256, "sync"),
                   (64, 128, 3, 256, "sync")]},
    "sm80": {64: [(64, 64, 2, 128, "sync")], 128: [(32, 64, 2, 128, "sync")]},
    "hip": {64: [(32, 64, 1, 256, "sync")], 128: [(32, 64, 1, 256, "sync")]},
}  # fmt: skip
PRE_BLOCK = 64  # query rows per program of flash_bwd_pre / flash_bwd_post


def bucket(head_dim: int) -> int:
    return next(d for d in HEAD_DIMS if head_dim <= d)


def unsupported(dtype: str, head_dim: int) -> str | None:
    """Why the TileLang forward cannot run these inputs (a clause naming the feature), or None."""
    if dtype not in DTYPES:
        return f"supports q, k, v in {' / '.join(DTYPES)} only (its GEMMs would round float32 to TF32), got {dtype}"
    if head_dim > HEAD_DIMS[-1]:
        return f"supports head dims up to {HEAD_DIMS[-1]}, got {head_dim}"
    return None


def unsupported_inputs(kwargs) -> str | None:
    """`unsupported` for a call's arguments (backends.unsupported_inputs)."""
    return unsupported(str(kwargs["q"].dtype), kwargs["q"].shape[-1])


def backward_unsupported(dtype: str, head_dim: int, arch: int = 90) -> str | None:
    """Why the TileLang backward cannot run these inputs on compute capability `arch` (the Triton backward then runs),
    or None. sm_90a only: TileLang 0.1.15's sm_80 code generation fails on its pipelined loop (a non-constant
    `Downcast<IntImm>` in CUDA codegen), and it is measured nowhere else."""
    if unsupported(dtype, head_dim):
        return unsupported(dtype, head_dim)
    if head_dim > BWD_HEAD_DIMS[-1]:
        return f"backward supports head dims up to {BWD_HEAD_DIMS[-1]}, got {head_dim}"
    if arch != 90:
        return f"backward runs on sm_90a only, got sm_{arch}"
    return None


def kernel_name(head_dim: int, softcap: bool, direction: str = "fwd", config: int = 0) -> str:
    """The kernel that serves this head dim: flash_{direction}_d{bucket}[_pad][_softcap][_c{config}]; direction
    "fwd" (configuration `config` of CONFIGS; padded head dims: c0, built as the first synchronous one), "bwd" (the
    main backward kernel: configuration `config` of BWD_CONFIGS), "bwd_pre" or "bwd_post" (no softcap variants)."""
    d = bucket(head_dim)
    if direction in ("bwd_pre", "bwd_post"):
        return f"flash_{direction}_d{d}" + ("" if head_dim == d else "_pad")
    if direction == "fwd" and head_dim != d:
        config = 0  # one padded kernel: prim_func gives it the first synchronous configuration (OVERLAP loads by TMA)
    name = f"flash_{direction}_d{d}" + ("" if head_dim == d else "_pad") + ("_softcap" if softcap else "")
    return name + (f"_c{config}" if config else "")


def _parse(kernel: str) -> tuple[int, bool, bool, int]:
    """(bucket, EVEN, SOFTCAP, config) of a kernel_name."""
    parts = kernel.split("_d", 1)[1].split("_")
    config = next((int(p[1:]) for p in parts if p.startswith("c")), 0)
    return int(parts[0]), "pad" not in parts, "softcap" in parts, config


def family(arch: int) -> str:
    """The configuration family (CONFIGS, BWD_CONFIGS) of CUDA compute capability `arch` (90 for 9.0)."""
    return _family(tilelang_target(arch))


def _family(tilelang_target: dict) -> str:
    if tilelang_target["kind"] == "hip":
        return "hip"
    return "sm90" if int(tilelang_target["arch"].removeprefix("sm_").rstrip("a")) >= 90 else "sm80"


NO_KEYS_KERNEL = "flash_fwd_no_keys"  # Sk = 0: every row sees no key


def _no_keys(dtype: str):
    """OUT = 0, LSE = +inf; grid (cdiv(Sq, 128), Hq, B), a thread per query row."""
    import tilelang.language as T

    B, SQ, HQ, D = T.dynamic("B SQ HQ D")

    @T.prim_func
    def flash_fwd_no_keys(OUT: T.Tensor((B, SQ, HQ, D), dtype), LSE: T.Tensor((B, HQ, SQ), "float32")):
        with T.Kernel(T.ceildiv(SQ, 128), HQ, B, threads=128) as (mb, h, b):
            for i in T.Parallel(128):
                row = mb * 128 + i
                if row < SQ:
                    LSE[b, h, row] = T.infinity("float32")
                    for d in T.serial(D):
                        OUT[b, row, h, d] = T.cast(0, dtype)

    return flash_fwd_no_keys


def prim_func(kernel: str, dtype: str, _dtype: str, tilelang_target: dict):
    """The forward prim_func `kernel` (kernel_name) for one dtype and target. Parameters: Q, K, V (reads), OUT, LSE
    (writes), scale, softcap, left, right (scalars)."""
    import tilelang.language as T

    if kernel == NO_KEYS_KERNEL:
        return _no_keys(dtype)
    if kernel.startswith(("flash_bwd_pre_", "flash_bwd_post_")):
        return (_bwd_pre if kernel.startswith("flash_bwd_pre_") else _bwd_post)(*_parse(kernel)[:2], dtype)
    if kernel.startswith("flash_bwd_"):
        return _bwd(kernel, dtype, tilelang_target)
    d_pad, even, has_softcap, config = _parse(kernel)
    family = _family(tilelang_target)
    configs = CONFIGS[family][d_pad]
    # OVERLAP takes TMA-fed tiles only: padded head dims (kernel_name gives them c0) run the first synchronous one
    block_m, block_n, stages, threads, overlap = configs[config] if even else next(c for c in configs if not c[4])
    overlap = overlap and family == "sm90"
    f32 = "float32"
    B, SQ, SK, HQ, HK = T.dynamic("B SQ SK HQ HK")
    D = d_pad if even else T.dynamic("D")
    # padded head dims: no TMA (a row stride of H * D elements need not be a multiple of 16 bytes)
    hints = None if even else {"disable_tma": True}

    @T.macro
    def probabilities(s, m, m_prev, row_sum, l, n0, m0, scale, softcap, left, right):  # noqa: E741
        """A key block's scores s = q.k^T (keys n0...) -> p = exp2(s' - m) in s, s' the scaled (soft-capped,
        masked) scores in base 2; the running max m, the running sum l, and m_prev = exp2(m_old - m), the factor
        that rescales the accumulator."""
        shift = SK - SQ  # bottom-right alignment: query i sees keys [i + shift - left, i + shift + right]
        for i, j in T.Parallel(block_m, block_n):
            if has_softcap:
                # softcap * tanh(x) = softcap - 2 softcap / (exp(2x) + 1): saturates to +-softcap
                t = T.exp2(s[i, j] * (scale / softcap * 2 * LOG2E))
                s[i, j] = (softcap * LOG2E) - (2 * softcap * LOG2E) / (t + 1)
            else:
                s[i, j] = s[i, j] * (scale * LOG2E)
        # every row of the query block sees the keys [m0 + block_m - 1 + shift - left, m0 + shift + right + 1) (within
        # SK): a key block inside needs no mask
        if n0 < m0 + block_m - 1 + shift - left or n0 + block_n > T.min(m0 + shift + right + 1, SK):
            for i, j in T.Parallel(block_m, block_n):
                diag = m0 + i + shift
                key = n0 + j
                seen = (key < SK) & (key >= diag - left) & (key <= diag + right)
                s[i, j] = T.if_then_else(seen, s[i, j], -T.infinity(f32))
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)  # m = max(m_prev, rowmax(s))
        for i, j in T.Parallel(block_m, block_n):
            s[i, j] = T.exp2(s[i, j] - m[i])
        T.reduce_sum(s, row_sum, dim=1)
        for i in T.Parallel(block_m):
            m_prev[i] = T.exp2(m_prev[i] - m[i])  # the rescale factor of the running sums
            l[i] = l[i] * m_prev[i] + row_sum[i]

    @T.macro
    def finish(acc, l, m, o_tile, OUT, LSE, b, h, m0):  # noqa: E741, N803
        """out = acc / l (0 where l = 0), lse = m + log2(l) (+inf where l = 0)."""
        for i, j in T.Parallel(block_m, d_pad):
            acc[i, j] = acc[i, j] / T.if_then_else(l[i] == 0, T.float32(1), l[i])
        T.copy(acc, o_tile)
        T.copy(o_tile, OUT[b, m0 : m0 + block_m, h, 0:d_pad], annotations=hints)
        for i in T.Parallel(block_m):
            if m0 + i < SQ:
                LSE[b, h, m0 + i] = T.if_then_else(l[i] == 0, T.infinity(f32), m[i] + T.log2(l[i]))

    @T.prim_func
    def flash_fwd(
        Q: T.Tensor((B, SQ, HQ, D), dtype),
        K: T.Tensor((B, SK, HK, D), dtype),
        V: T.Tensor((B, SK, HK, D), dtype),
        OUT: T.Tensor((B, SQ, HQ, D), dtype),
        LSE: T.Tensor((B, HQ, SQ), f32),
        scale: T.float32,
        softcap: T.float32,
        left: T.int32,
        right: T.int32,
    ):
        with T.Kernel(T.ceildiv(SQ, block_m), HQ, B, threads=threads) as (bx, h, b):
            q_tile = T.alloc_shared((block_m, d_pad), dtype)
            k_tile = T.alloc_shared((block_n, d_pad), dtype)
            v_tile = T.alloc_shared((block_n, d_pad), dtype)
            s = T.alloc_fragment((block_m, block_n), f32)
            p = T.alloc_fragment((block_m, block_n), dtype)
            acc = T.alloc_fragment((block_m, d_pad), f32)
            m = T.alloc_fragment((block_m,), f32)
            m_prev = T.alloc_fragment((block_m,), f32)
            row_sum = T.alloc_fragment((block_m,), f32)
            l = T.alloc_fragment((block_m,), f32)  # noqa: E741 - the softmax denominator's usual name
            if overlap:
                T.annotate_ws_schedule(T.WSSchedule(
                    num_warps=ws_warps(threads),
                    roles=ws_roles(threads),
                    pipelines=[T.WSPipeline("q", [q_tile], depth=1), T.WSPipeline("k", [k_tile], depth=stages),
                               T.WSPipeline("v", [v_tile], depth=stages)],
                    scopes=[
                        # step t: S(t) = Q K(t)^T and O += P(t-1) V(t-1) issued together (V's stage 1: a step behind);
                        # P(t) computed while the second runs, then O rescaled by P(t)'s max
                        T.WSScope("loop", {
                            "TMA": [T.WSSync.producer_acquire("k", stage=0), "load_k",
                                    T.WSSync.producer_commit("k", stage=0), T.WSSync.producer_acquire("v", stage=0),
                                    "load_v", T.WSSync.producer_commit("v", stage=0)],
                            "MMA": [T.WSSync.consumer_wait("k", stage=0), "qk", T.WSSync.consumer_wait("v", stage=1),
                                    "pv", "wait_qk", T.WSSync.consumer_release("k", stage=0), "probabilities",
                                    "wait_pv", T.WSSync.consumer_release("v", stage=1), "rescale"],
                        }),
                        T.WSScope(T.WSScope.ROOT, {
                            "TMA": ["bounds", T.WSSync.producer_acquire("q", stage=0), "load_q",
                                    T.WSSync.producer_commit("q", stage=0), "loop"],
                            "MMA": ["bounds", "init", T.WSSync.consumer_wait("q", stage=0), "loop", "wait_last",
                                    "finish", T.WSSync.consumer_release("q", stage=0)],
                        }),
                    ],
                ))  # fmt: skip
                with T.ws_op("bounds"):
                    m0 = (T.ceildiv(SQ, block_m) - 1 - bx) * block_m  # the last query blocks first, as the default loop
                    hk = h // (HQ // HK)
                    first = T.max(m0 + SK - SQ - left, 0) // block_n
                    blocks = T.max(T.ceildiv(T.min(m0 + block_m + SK - SQ + right, SK), block_n), first + 1) - first
                T.copy(Q[b, m0 : m0 + block_m, h, 0:d_pad], q_tile, annotations={T.WSID: "load_q"})
                with T.ws_op("init"):
                    T.fill(acc, 0)
                    T.fill(l, 0)
                    T.fill(m, -1e30)
                    T.fill(p, 0)
                for t in T.Pipelined(blocks, num_stages=stages, annotations={T.WSID: "loop"}):
                    T.copy(K[b, (first + t) * block_n : (first + t + 1) * block_n, hk, 0:d_pad], k_tile,
                           annotations={T.WSID: "load_k"})  # fmt: skip
                    T.copy(V[b, (first + t) * block_n : (first + t + 1) * block_n, hk, 0:d_pad], v_tile,
                           annotations={T.WSID: "load_v"})  # fmt: skip
                    T.gemm(q_tile, k_tile, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True,
                           annotations={T.WSID: "qk", "wg_wait": -1})  # fmt: skip
                    T.gemm(p, v_tile, acc, policy=T.GemmWarpPolicy.FullRow, annotations={T.WSID: "pv", "wg_wait": -1})
                    with T.ws_op("wait_qk"):  # S(t) done; P(t-1) V(t-1) may still run (none at step 0)
                        if t == 0:
                            T.wait_wgmma(0)
                        else:
                            T.wait_wgmma(1)
                    with T.ws_op("probabilities"):
                        probabilities(s, m, m_prev, row_sum, l, (first + t) * block_n, m0, scale, softcap, left, right)
                    with T.ws_op("wait_pv"):
                        T.wait_wgmma(0)
                    with T.ws_op("rescale"):
                        for i, j in T.Parallel(block_m, d_pad):
                            acc[i, j] *= m_prev[i]
                        T.copy(s, p)
                with T.ws_op("wait_last"):  # the last block's P V, issued after the loop
                    T.wait_wgmma(0)
                with T.ws_op("finish"):
                    finish(acc, l, m, q_tile, OUT, LSE, b, h, m0)
            else:
                o_tile = T.alloc_shared((block_m, d_pad), dtype)
                mb = T.ceildiv(SQ, block_m) - 1 - bx  # the last query blocks (the longest causal bands) start first
                hk = h // (HQ // HK)
                m0 = mb * block_m
                # key blocks [first, last) hold every key a row of this block sees; at least one (the loop's first
                # iteration waits for the query tile; a block that sees no key then masks all of one block, l = 0)
                first = T.max(m0 + SK - SQ - left, 0) // block_n
                last = T.max(T.ceildiv(T.min(m0 + block_m + SK - SQ + right, SK), block_n), first + 1)

                T.copy(Q[b, m0 : m0 + block_m, h, 0:d_pad], q_tile, annotations=hints)
                T.fill(acc, 0)
                T.fill(l, 0)
                T.fill(m, -1e30)
                for kb in T.Pipelined(first, last, num_stages=stages):
                    n0 = kb * block_n
                    T.copy(K[b, n0 : n0 + block_n, hk, 0:d_pad], k_tile, annotations=hints)
                    T.gemm(q_tile, k_tile, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    probabilities(s, m, m_prev, row_sum, l, n0, m0, scale, softcap, left, right)
                    for i, j in T.Parallel(block_m, d_pad):
                        acc[i, j] *= m_prev[i]
                    T.copy(s, p)
                    T.copy(V[b, n0 : n0 + block_n, hk, 0:d_pad], v_tile, annotations=hints)
                    T.gemm(p, v_tile, acc, policy=T.GemmWarpPolicy.FullRow)
                finish(acc, l, m, o_tile, OUT, LSE, b, h, m0)

    return flash_fwd


def _bwd_pre(d_pad: int, even: bool, dtype: str):
    """Rows padded to SQP (a multiple of the main kernel's BLOCK_M, so that its TMA loads of these rows see 16-byte
    aligned strides): DELTA[b, h, i] = sum_d OUT[b, i, h, d] * DOUT[b, i, h, d] (0 past Sq) and LSE_PAD[b, h, i] =
    LSE[b, h, i] (+inf past Sq: P = 0 there); grid (cdiv(SQP, PRE_BLOCK), Hq, B). The head dim is static unless
    padded (`even` False): then its loads cannot be vectorized, the threads take a column each and every row's sum
    is a reduction over all of them; with it, 16-byte loads and a row's sum over the few threads holding it."""
    import tilelang.language as T

    B, SQ, SQP, HQ = T.dynamic("B SQ SQP HQ")
    D = d_pad if even else T.dynamic("D")
    f32 = "float32"

    @T.prim_func
    def flash_bwd_pre(
        OUT: T.Tensor((B, SQ, HQ, D), dtype),
        DOUT: T.Tensor((B, SQ, HQ, D), dtype),
        LSE: T.Tensor((B, HQ, SQ), f32),
        DELTA: T.Tensor((B, HQ, SQP), f32),
        LSE_PAD: T.Tensor((B, HQ, SQP), f32),
    ):
        with T.Kernel(T.ceildiv(SQP, PRE_BLOCK), HQ, B, threads=128) as (mb, h, b):
            o = T.alloc_fragment((PRE_BLOCK, d_pad), dtype)
            do = T.alloc_fragment((PRE_BLOCK, d_pad), dtype)
            prod = T.alloc_fragment((PRE_BLOCK, d_pad), f32)
            delta = T.alloc_fragment((PRE_BLOCK,), f32)
            m0 = mb * PRE_BLOCK
            T.copy(OUT[b, m0 : m0 + PRE_BLOCK, h, 0:d_pad], o)  # rows past Sq read as 0
            T.copy(DOUT[b, m0 : m0 + PRE_BLOCK, h, 0:d_pad], do)
            for i, j in T.Parallel(PRE_BLOCK, d_pad):
                prod[i, j] = T.cast(o[i, j], f32) * T.cast(do[i, j], f32)
            T.reduce_sum(prod, delta, dim=1)
            for i in T.Parallel(PRE_BLOCK):
                if m0 + i < SQP:
                    DELTA[b, h, m0 + i] = delta[i]
                    LSE_PAD[b, h, m0 + i] = T.if_then_else(m0 + i < SQ, LSE[b, h, T.min(m0 + i, SQ - 1)],
                                                           T.infinity(f32))  # fmt: skip

    return flash_bwd_pre


def _bwd_post(d_pad: int, even: bool, dtype: str):
    """DQ[b, i, h, :D] = scale * DQ_ACC[b, h, i, :D]; grid (cdiv(Sq, PRE_BLOCK), Hq, B); the head dim static unless
    padded (as _bwd_pre)."""
    import tilelang.language as T

    B, SQ, SQP, HQ = T.dynamic("B SQ SQP HQ")
    D = d_pad if even else T.dynamic("D")
    f32 = "float32"

    @T.prim_func
    def flash_bwd_post(
        DQ_ACC: T.Tensor((B, HQ, SQP, d_pad), f32), DQ: T.Tensor((B, SQ, HQ, D), dtype), scale: T.float32
    ):
        with T.Kernel(T.ceildiv(SQ, PRE_BLOCK), HQ, B, threads=128) as (mb, h, b):
            acc = T.alloc_fragment((PRE_BLOCK, d_pad), f32)
            m0 = mb * PRE_BLOCK
            T.copy(DQ_ACC[b, h, m0 : m0 + PRE_BLOCK, 0:d_pad], acc)
            for i, j in T.Parallel(PRE_BLOCK, d_pad):
                acc[i, j] = acc[i, j] * scale
            T.copy(acc, DQ[b, m0 : m0 + PRE_BLOCK, h, 0:d_pad])

    return flash_bwd_post


def _bwd(kernel: str, dtype: str, tilelang_target: dict):
    """The main backward kernel (see the module doc); grid (chunk, cdiv(Sk, BLOCK_N), Hk B / chunk). Parameters: Q,
    K, V, DOUT, LSE, DELTA (flash_bwd_pre's padded rows), DQ_IN (reads), DK, DV, DQ_ACC (writes; DQ_IN and DQ_ACC are
    one buffer, updated in place), scale, softcap, left, right, chunk (flash_attention.key_chunk)."""
    import tilelang.language as T

    d_pad, even, has_softcap, config = _parse(kernel)
    family = _family(tilelang_target)
    block_m, block_n, stages, threads, schedule = BWD_CONFIGS[family][d_pad][config]
    if schedule == "ws" and not (even and family == "sm90"):
        schedule = "async"  # "ws" pipelines TMA loads (sm_90a, EVEN) only
    if has_softcap:
        schedule = "sync"  # softcap's dS^T needs tanh(S^T) beside P^T
    overlap = schedule == "async"
    dq_tma = family == "sm90"  # one TMA reduce-add per dQ tile (cp.reduce.async.bulk.tensor); atomics elsewhere
    f32 = "float32"
    B, SQ, SQP, SK, HQ, HK = T.dynamic("B SQ SQP SK HQ HK")
    D = d_pad if even else T.dynamic("D")
    hints = None if even else {"disable_tma": True}
    # S^T's and dP^T's wgmmas issued without waiting (T.wait_wgmma(n): until n groups remain in flight). Only these
    # two: TileLang releases a pipelined buffer to the producer right after its last GEMM is issued, so an async dV or
    # dK GEMM would still read dO / Q while the producer's TMA refills them.
    issue = {"wg_wait": -1} if overlap else None

    @T.macro
    def probabilities_t(st, pt, lse, n0, m0, scale, left, right):
        """S^T (keys n0..., queries m0...) -> P^T = exp2(scale c S^T - lse) in st (fp32) and pt (q's dtype), 0 where
        the key is invisible to the query."""
        shift = SK - SQ
        # every (key, query) pair of the block visible, inside Sq and Sk: no mask
        partial = (
            (n0 + left < m0 + block_m - 1 + shift)
            | (n0 + block_n - 1 > m0 + shift + right)
            | (m0 + block_m > SQ)
            | (n0 + block_n > SK)
        )
        if partial:
            for i, j in T.Parallel(block_n, block_m):
                diag = m0 + j + shift
                seen = (m0 + j < SQ) & (n0 + i < SK) & (n0 + i >= diag - left) & (n0 + i <= diag + right)
                st[i, j] = T.if_then_else(seen, T.exp2(st[i, j] * (scale * LOG2E) - lse[j]), 0)
        else:
            for i, j in T.Parallel(block_n, block_m):
                st[i, j] = T.exp2(st[i, j] * (scale * LOG2E) - lse[j])
        T.copy(st, pt)

    @T.prim_func
    def flash_bwd(
        Q: T.Tensor((B, SQ, HQ, D), dtype),
        K: T.Tensor((B, SK, HK, D), dtype),
        V: T.Tensor((B, SK, HK, D), dtype),
        DOUT: T.Tensor((B, SQ, HQ, D), dtype),
        LSE: T.Tensor((B, HQ, SQP), f32),  # flash_bwd_pre's padded rows (+inf past Sq)
        DELTA: T.Tensor((B, HQ, SQP), f32),
        DQ_IN: T.Tensor((B, HQ, SQP, d_pad), f32),  # noqa: ARG001 - DQ_ACC's buffer, as the Call passes it
        DK: T.Tensor((B, SK, HK, D), dtype),
        DV: T.Tensor((B, SK, HK, D), dtype),
        DQ_ACC: T.Tensor((B, HQ, SQP, d_pad), f32),
        scale: T.float32,
        softcap: T.float32,
        left: T.int32,
        right: T.int32,
        chunk: T.int32,
    ):
        # program order (flash_attention.key_chunk): a chunk's groups at each key block from the first
        with T.Kernel(chunk, T.ceildiv(SK, block_n), HK * B // chunk, threads=threads) as (gx, nb, cz):
            k_tile = T.alloc_shared((block_n, d_pad), dtype)
            v_tile = T.alloc_shared((block_n, d_pad), dtype)
            q_tile = T.alloc_shared((block_m, d_pad), dtype)
            do_tile = T.alloc_shared((block_m, d_pad), dtype)
            lse = T.alloc_shared((block_m,), f32)
            delta = T.alloc_shared((block_m,), f32)
            ds_tile = T.alloc_shared((block_n, block_m), dtype)
            st = T.alloc_fragment((block_n, block_m), f32)  # S^T (then P^T, "async" / "ws")
            dpt = T.alloc_fragment((block_n, block_m), f32)  # dP^T
            pt = T.alloc_fragment((block_n, block_m), dtype)  # P^T
            dst = T.alloc_fragment((block_n, block_m), dtype)  # dS^T
            dk = T.alloc_fragment((block_n, d_pad), f32)
            dv = T.alloc_fragment((block_n, d_pad), f32)
            dq = T.alloc_fragment((block_m, d_pad), f32)
            if dq_tma:
                dq_tile = T.alloc_shared((block_m, d_pad), f32)

            if schedule == "ws":
                T.annotate_ws_schedule(T.WSSchedule(
                    num_warps=ws_warps(threads),
                    roles=ws_roles(threads),
                    pipelines=[T.WSPipeline("kv", [k_tile, v_tile], depth=1),
                               T.WSPipeline("q", [q_tile, lse], depth=stages),
                               T.WSPipeline("do", [do_tile, delta], depth=stages),
                               T.WSPipeline("dq", [dq_tile], depth=2)],
                    scopes=[
                        # per (query head, query block): S^T and dP^T issued; P^T once S^T is in; dV issued; dS^T
                        # once dP^T is in (dV still running); dK and dQ issued; one wait for all three
                        T.WSScope("loop", {
                            "TMA": ["index", T.WSSync.producer_acquire("q"), "load_q", "load_lse",
                                    T.WSSync.producer_commit("q"),
                                    T.WSSync.producer_acquire("do"), "load_do", "load_delta",
                                    T.WSSync.producer_commit("do"), T.WSSync.consumer_wait("dq", stage=1), "dq_out",
                                    T.WSSync.consumer_release("dq", stage=1)],
                            "MMA": ["index", T.WSSync.consumer_wait("q"), "st", T.WSSync.consumer_wait("do"), "dpt",
                                    "wait_st",
                                    "p", "dv", "wait_dpt", "ds", "dk", "dq", "wait_all", T.WSSync.consumer_release("q"),
                                    T.WSSync.consumer_release("do"), T.WSSync.producer_acquire("dq"), "dq_stage",
                                    T.WSSync.producer_commit("dq")],
                        }),
                        T.WSScope(T.WSScope.ROOT, {
                            "TMA": ["bounds", T.WSSync.producer_acquire("kv"), "load_k", "load_v",
                                    T.WSSync.producer_commit("kv"), "loop"],
                            "MMA": ["bounds", "init", T.WSSync.consumer_wait("kv"), "loop", "finish",
                                    T.WSSync.consumer_release("kv")],
                        }),
                    ],
                ))  # fmt: skip
                with T.ws_op("bounds"):
                    hk = (cz * chunk + gx) % HK
                    b = (cz * chunk + gx) // HK
                    n0 = nb * block_n
                    # as below
                    first = T.min(T.max(n0 - SK + SQ - right, 0) // block_m, T.ceildiv(SQ, block_m) - 1)
                    blocks = T.max(T.ceildiv(T.min(n0 + block_n - SK + SQ + left, SQ), block_m), first + 1) - first
                T.copy(K[b, n0 : n0 + block_n, hk, 0:d_pad], k_tile, annotations={T.WSID: "load_k"})
                T.copy(V[b, n0 : n0 + block_n, hk, 0:d_pad], v_tile, annotations={T.WSID: "load_v"})
                with T.ws_op("init"):
                    T.fill(dk, 0)
                    T.fill(dv, 0)
                for step in T.Pipelined(HQ // HK * blocks, num_stages=stages, annotations={T.WSID: "loop"}):
                    with T.ws_op("index"):  # the step's query head and first query row, as below
                        h = hk * (HQ // HK) + step // blocks
                        m0 = (first + step % blocks) * block_m
                    T.copy(Q[b, m0 : m0 + block_m, h, 0:d_pad], q_tile, annotations={T.WSID: "load_q"})
                    T.copy(LSE[b, h, m0 : m0 + block_m], lse, annotations={T.WSID: "load_lse"})
                    T.copy(DOUT[b, m0 : m0 + block_m, h, 0:d_pad], do_tile, annotations={T.WSID: "load_do"})
                    T.copy(DELTA[b, h, m0 : m0 + block_m], delta, annotations={T.WSID: "load_delta"})
                    T.gemm(k_tile, q_tile, st, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True,
                           annotations={T.WSID: "st", "wg_wait": -1})  # fmt: skip
                    T.gemm(v_tile, do_tile, dpt, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True,
                           annotations={T.WSID: "dpt", "wg_wait": -1})  # fmt: skip
                    with T.ws_op("wait_st"):
                        T.wait_wgmma(1)
                    with T.ws_op("p"):
                        probabilities_t(st, pt, lse, n0, m0, scale, left, right)
                    T.gemm(pt, do_tile, dv, policy=T.GemmWarpPolicy.FullRow, annotations={T.WSID: "dv", "wg_wait": -1})
                    with T.ws_op("wait_dpt"):  # dP^T in; dV may still run
                        T.wait_wgmma(1)
                    with T.ws_op("ds"):
                        for i, j in T.Parallel(block_n, block_m):
                            dst[i, j] = st[i, j] * (dpt[i, j] - delta[j])
                        T.copy(dst, ds_tile)
                    T.gemm(dst, q_tile, dk, policy=T.GemmWarpPolicy.FullRow, annotations={T.WSID: "dk", "wg_wait": -1})
                    T.gemm(ds_tile, k_tile, dq, transpose_A=True, clear_accum=True,
                           annotations={T.WSID: "dq", "wg_wait": -1})  # fmt: skip
                    with T.ws_op("wait_all"):
                        T.wait_wgmma(0)
                    with T.ws_op("dq_stage"):  # each thread's writes ordered before the TMA warp's bulk read
                        T.copy(dq, dq_tile)
                        T.fence_proxy_async()
                    # the TMA warp adds each dQ tile into the accumulator a step behind (its indices from `step`, which
                    # the schedule's shift rewrites, not from the step's h and m0)
                    T.atomic_add(DQ_ACC[b, hk * (HQ // HK) + step // blocks,
                                        (first + step % blocks) * block_m : (first + step % blocks + 1) * block_m,
                                        0:d_pad], dq_tile, annotations={T.WSID: "dq_out", "use_tma": 1})  # fmt: skip
                with T.ws_op("finish"):  # dK, dV through K's and V's shared tiles
                    for i, j in T.Parallel(block_n, d_pad):
                        dk[i, j] = dk[i, j] * scale
                    T.copy(dk, k_tile)
                    T.copy(dv, v_tile)
                    T.copy(k_tile, DK[b, n0 : n0 + block_n, hk, 0:d_pad])
                    T.copy(v_tile, DV[b, n0 : n0 + block_n, hk, 0:d_pad])
            else:
                dk_tile = T.alloc_shared((block_n, d_pad), dtype)
                dv_tile = T.alloc_shared((block_n, d_pad), dtype)
                group = HQ // HK
                hk = (cz * chunk + gx) % HK
                b = (cz * chunk + gx) // HK
                n0 = nb * block_n
                # bottom-right alignment: key j is seen by queries [j - shift - right, j - shift + left]
                shift = SK - SQ
                # query blocks [first, last) hold every row that sees a key of this block; at least one (clamped into
                # Sq) so the loop runs: a block that sees nothing then has P = 0 and adds zeros
                first = T.min(T.max(n0 - shift - right, 0) // block_m, T.ceildiv(SQ, block_m) - 1)
                last = T.max(T.ceildiv(T.min(n0 + block_n - shift + left, SQ), block_m), first + 1)
                blocks = last - first

                T.copy(K[b, n0 : n0 + block_n, hk, 0:d_pad], k_tile, annotations=hints)
                T.copy(V[b, n0 : n0 + block_n, hk, 0:d_pad], v_tile, annotations=hints)
                T.fill(dk, 0)
                T.fill(dv, 0)
                for step in T.Pipelined(group * blocks, num_stages=stages):
                    h = hk * group + step // blocks
                    m0 = (first + step % blocks) * block_m
                    T.copy(Q[b, m0 : m0 + block_m, h, 0:d_pad], q_tile, annotations=hints)
                    T.copy(LSE[b, h, m0 : m0 + block_m], lse)
                    T.gemm(k_tile, q_tile, st, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True,
                           annotations=issue)  # fmt: skip
                    T.copy(DOUT[b, m0 : m0 + block_m, h, 0:d_pad], do_tile, annotations=hints)
                    T.copy(DELTA[b, h, m0 : m0 + block_m], delta)
                    T.gemm(v_tile, do_tile, dpt, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True,
                           annotations=issue)  # fmt: skip
                    # every (key, query) pair of the block visible, inside Sq and Sk: no mask
                    partial = (
                        (n0 + left < m0 + block_m - 1 + shift)
                        | (n0 + block_n - 1 > m0 + shift + right)
                        | (m0 + block_m > SQ)
                        | (n0 + block_n > SK)
                    )
                    if overlap:  # P^T into st (fp32) while dP^T's wgmma runs
                        T.wait_wgmma(1)
                        probabilities_t(st, pt, lse, n0, m0, scale, left, right)
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(block_n, block_m):
                            dst[i, j] = st[i, j] * (dpt[i, j] - delta[j])
                    elif partial:
                        for i, j in T.Parallel(block_n, block_m):
                            key = n0 + i
                            diag = m0 + j + shift
                            seen = (m0 + j < SQ) & (key < SK) & (key >= diag - left) & (key <= diag + right)
                            if has_softcap:
                                # tanh(x) = 1 - 2 / (exp(2x) + 1), from exp2 as in the forward
                                t = 1 - 2 / (T.exp2(st[i, j] * (scale / softcap * 2 * LOG2E)) + 1)
                                p = T.if_then_else(seen, T.exp2(t * (softcap * LOG2E) - lse[j]), 0)
                                pt[i, j] = p
                                dst[i, j] = p * (dpt[i, j] - delta[j]) * (1 - t * t)
                            else:
                                p = T.if_then_else(seen, T.exp2(st[i, j] * (scale * LOG2E) - lse[j]), 0)
                                pt[i, j] = p
                                dst[i, j] = p * (dpt[i, j] - delta[j])
                    else:
                        for i, j in T.Parallel(block_n, block_m):
                            if has_softcap:
                                t = 1 - 2 / (T.exp2(st[i, j] * (scale / softcap * 2 * LOG2E)) + 1)
                                p = T.exp2(t * (softcap * LOG2E) - lse[j])
                                pt[i, j] = p
                                dst[i, j] = p * (dpt[i, j] - delta[j]) * (1 - t * t)
                            else:
                                p = T.exp2(st[i, j] * (scale * LOG2E) - lse[j])
                                pt[i, j] = p
                                dst[i, j] = p * (dpt[i, j] - delta[j])
                    T.gemm(pt, do_tile, dv, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(dst, ds_tile)
                    T.gemm(dst, q_tile, dk, policy=T.GemmWarpPolicy.FullRow)
                    T.gemm(ds_tile, k_tile, dq, transpose_A=True, clear_accum=True)
                    if dq_tma:
                        T.copy(dq, dq_tile)
                        T.atomic_add(DQ_ACC[b, h, m0 : m0 + block_m, 0:d_pad], dq_tile, annotations={"use_tma": 1})
                    else:
                        for i, j in T.Parallel(block_m, d_pad):
                            T.atomic_add(DQ_ACC[b, h, m0 + i, j], dq[i, j])
                for i, j in T.Parallel(block_n, d_pad):
                    dk[i, j] = dk[i, j] * scale
                T.copy(dk, dk_tile)
                T.copy(dv, dv_tile)
                T.copy(dk_tile, DK[b, n0 : n0 + block_n, hk, 0:d_pad], annotations=hints)
                T.copy(dv_tile, DV[b, n0 : n0 + block_n, hk, 0:d_pad], annotations=hints)

    return flash_bwd


def sm90_variants(dtypes, alternatives: bool = False) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of the kernels built for sm_90a only, so not in `variants` (the AOT matrix of every
    TileLang target): the backward's; `alternatives`: the forward's and the main backward kernel's non-default
    configurations too (the sweep's candidates)."""
    kernels = [kernel_name(d - pad, softcap, "bwd") for d in BWD_HEAD_DIMS for pad in (0, 1)
               for softcap in (False, True)]  # fmt: skip
    kernels += [kernel_name(d - pad, False, step) for d in BWD_HEAD_DIMS for pad in (0, 1)
                for step in ("bwd_pre", "bwd_post")]  # fmt: skip
    if alternatives:
        for direction, configs in (("fwd", CONFIGS["sm90"]), ("bwd", BWD_CONFIGS["sm90"])):
            kernels += [kernel_name(d, False, direction, i) for d, cs in configs.items() for i in range(1, len(cs))]
    return [(k, d, d) for d in dtypes if d in DTYPES for k in kernels]


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of every forward kernel in the given dtypes that it supports (the AOT matrix)."""
    kernels = [kernel_name(d - pad, softcap) for d in HEAD_DIMS for pad in (0, 1) for softcap in (False, True)]
    kernels.append(NO_KEYS_KERNEL)
    return [(k, d, d) for d in dtypes if d in DTYPES for k in kernels]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func, FAST_MATH)
