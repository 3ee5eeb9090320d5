"""mla_decode's TileLang split kernel for Hopper (backend="tilelang"): the math of mla_decode.py, written in TileLang.

One program per (tile of BLOCK_H = 64 query heads, sequence b, split s), grid (cdiv(H, 64), B, S). The program's
query rows (q_nope 64 x Dc, q_pe 64 x Dr) stay in shared memory; the latent rows kv_c (BLOCK_N x Dc) and the rope
keys k_pe (BLOCK_N x Dr) of its positions stream through a T.Pipelined loop of `stages` shared buffers, and each
latent tile serves as the keys and as the values. Per block of positions, in base-2 units (c = log2(e)):
    s = scale * c * (q_nope kv^T + q_pe k_pe^T)            (64 x BLOCK_N, fp32)
    s = -inf at positions >= end (the block that holds the split's end only: a runtime test)
    m' = max(m, rowmax(s)),  p = exp2(s - m'),  l = l * exp2(m - m') + rowsum(p),  acc = acc * exp2(m - m') + p kv
then out = acc / l (0 where l = 0) and lse = m + log2(l) (-inf where l = 0). m starts at -1e30 (finite: no
inf - inf), so a row that has seen no position keeps l = 0 and acc = 0.
Work split: two consumer warp groups (256 threads; TileLang adds a TMA producer warp group on sm_90a). The output
accumulator acc (64 x 512 fp32) is split by columns (GemmWarpPolicy.FullCol): each group holds 64 x 256 (128
registers a thread) and multiplies p by its half of the latent tile. The scores are split the same way (each group
64 x BLOCK_N / 2 of them, the row max and sum reduced across the groups through shared memory) and the
probabilities pass to both groups through a shared 64 x BLOCK_N tile. TileLang lowers the tile copies to TMA, the
products to wgmma (operands in shared memory) and splits the loop into producer / consumers (warp specialization,
mbarriers, setmaxnreg), all on its own for sm_90a.

Positions (as the Triton kernel, mla_decode.py): sequence b's length L = clamp(cache_seqlens[b], 0, capacity); split
s of S takes [s * c, min((s + 1) * c, L)), c = cdiv(cdiv(L, S), BLOCK_N) * BLOCK_N (2 * BLOCK_N in body_ws, whose
loops take blocks in pairs). Paged caches: position p is row
p % page_size of page block_table[b, p // page_size]; page_size must be a multiple of BLOCK_N (a tile never crosses
a page; 64 = FlashMLA's pages). Contiguous caches are one page per sequence (page b, page_size = Smax; the tile past
Smax is TMA's zero fill). The rows of a block past the split's end are zeroed in shared memory before the p kv
product (an unused cache slot may hold NaN, and 0 x NaN is NaN); an empty split still runs one block, all masked,
so that every TMA load the producer issues is waited for.

Kernels: one per (dtype, PAGED, PARTIAL) and architecture. PARTIAL = 0 (S = 1): writes out (B, H, Dc) in q's dtype
and lse (B, H) fp32, natural log. PARTIAL = 1 (S > 1): writes the split's normalized output (B, H, S, Dc) fp32 and
base-2 lse (B, H, S), merged by decode_attention's combine kernel (Triton), as the Triton path does. Sizes B, H, S,
the page count, page size and pool size are dynamic: no recompile per shape.

Design limits: sm_90a only (wgmma, TMA, 224 KiB of shared memory: q 72 KiB + 2 stages x 72 KiB of latent and rope
rows + the probabilities' tile; `unsupported` says so for other architectures); q, kv_c, k_pe compact in float16 /
bfloat16 (float32 would run the products in TF32) with Dc = 512 and Dr = 64 exactly (DeepSeek-V2/V3); H any (a
tile of fewer than 64 heads is zero-filled by TMA and computes padded rows); positions below 2^31.

Status (2026-12-03): its GPU tests (tests/test_mla_decode.py) pass on the H200, and
benchmarks/sweep_mla_decode_tilelang.py measured it at about 2x the Triton path: backend=None in torch takes it where
it runs (mla_decode.preferred_backend).
"""

from .backends import tilelang_entry_points, tilelang_target

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DTYPES = ("float16", "bfloat16")
LATENT_DIM, ROPE_DIM = 512, 64
BLOCK_H = 64  # query heads a program: wgmma's M
ARCHS = (90,)  # compute capabilities the kernels are written for
# the AOT matrix's TileLang targets (aot.TILELANG_TARGETS) that build these kernels: Hopper only
AOT_TARGETS = ("cuda:90",)
FAST_MATH = {"tl.enable_fast_math": True}  # exp2 / log2 as single MUFU instructions (as flash_attention_tilelang)

# (BLOCK_N, stages) by config name; "default" is what backend="tilelang" runs. BLOCK_N 64 in 2 stages fills 224 KiB
# of shared memory; 32 in 2 or 3 stages leaves room (benchmarks/sweep_mla_decode_tilelang.py times them all). "ws"
# is a second body (body_ws, FlashMLA's split of the work): one consumer group computes each block's whole 64 x 64
# scores as one wgmma of N 64 (the default's groups each run N = BLOCK_N / 2, reading q's 72 KiB from shared memory
# twice a block), the other multiplies its half of the outputs while the first moves to the next block; roles,
# barriers and register shares written by hand (240 / 168 / 56), TMA loads into two buffers. "wsp": the same with
# the first group's p kv of a block issued with the next block's scores, so that it runs during that block's softmax.
CONFIGS = {"default": (64, 2), "n32s2": (32, 2), "n32s3": (32, 3), "ws": (64, 2), "wsp": (64, 2)}
DEFAULT_CONFIG = "default"


def unsupported(dtype: str, latent_dim: int, rope_dim: int, arch: int | None = None) -> str | None:
    """Why the TileLang kernels cannot run these inputs (a clause naming the feature), or None. arch None: not
    checked (known only on the device)."""
    if dtype not in DTYPES:
        return (f"supports q_nope, kv_c in {' / '.join(DTYPES)} only (its products would round float32 to TF32), "
                f"got {dtype}")  # fmt: skip
    if (latent_dim, rope_dim) != (LATENT_DIM, ROPE_DIM):
        return (f"supports Dc = {LATENT_DIM}, Dr = {ROPE_DIM} only (DeepSeek-V2/V3), got Dc = {latent_dim}, "
                f"Dr = {rope_dim}")  # fmt: skip
    if arch is not None and arch not in ARCHS:
        return f"runs on sm_90 (Hopper: wgmma, TMA) only, got sm_{arch}"
    return None


def unsupported_page_size(page_size: int, config: str = DEFAULT_CONFIG) -> str | None:
    block_n = CONFIGS[config][0]
    if page_size % block_n:
        return f"needs a page size that is a multiple of {block_n}, got {page_size}"
    return None


def unsupported_inputs(kwargs) -> str | None:
    """`unsupported` for a call's arguments (backends.unsupported_inputs)."""
    q_nope, q_pe, kv_c = kwargs["q_nope"], kwargs["q_pe"], kwargs["kv_c"]
    why = unsupported(str(q_nope.dtype).removeprefix("torch."), q_nope.shape[-1], q_pe.shape[-1])
    if why is None and kwargs.get("block_table") is not None:
        why = unsupported_page_size(kv_c.shape[1])
    return why


def kernel_name(paged: bool, partial: bool, config: str = DEFAULT_CONFIG) -> str:
    """mla_decode[_paged][_partial][_<config>]"""
    name = "mla_decode" + ("_paged" if paged else "") + ("_partial" if partial else "")
    return name if config == DEFAULT_CONFIG else f"{name}_{config}"


def _parse(kernel: str) -> tuple[bool, bool, str]:
    parts = kernel.removeprefix("mla_decode").split("_")
    config = next((p for p in parts if p in CONFIGS), DEFAULT_CONFIG)
    return "paged" in parts, "partial" in parts, config


def prim_func(kernel: str, dtype: str, _dtype: str, tilelang_target: dict):
    """The split prim_func `kernel` (kernel_name) for one dtype. Parameters: Q_NOPE (B, H, Dc), Q_PE (B, H, Dr),
    KV (P, PS, Dc), K_PE (P, PS, Dr), SEQLENS (B,) int32, [BLOCK_TABLE (B, MP) int32 when paged] (reads); OUT (B, H,
    Dc), LSE (B, H) or PARTIAL_O (B, H, S, Dc), PARTIAL_LSE (B, H, S) (writes); scale (scalar)."""
    import tilelang.language as T

    paged, partial, config = _parse(kernel)
    pipelined = config == "wsp"  # body_ws's variant
    block_n, stages = CONFIGS[config]
    f32 = "float32"
    dc, dr, bh = LATENT_DIM, ROPE_DIM, BLOCK_H
    B, H, P, PS, S = T.dynamic("B H P PS S")  # noqa: N806 - sizes
    MP = T.dynamic("MP") if paged else 1  # noqa: N806

    def bounds(SEQLENS, b, split, splits, unit=block_n):  # noqa: N803
        """[start, end) of split `split` of sequence b's positions (splits of whole `unit`s), and its blocks (at
        least one)."""
        capacity = MP * PS if paged else PS
        seqlen = T.min(T.max(SEQLENS[b], 0), capacity)
        chunk = T.ceildiv(T.ceildiv(seqlen, splits), unit) * unit
        start = split * chunk
        end = T.min(start + chunk, seqlen)
        return start, end, T.max(T.ceildiv(end - start, block_n), 1)

    def pair_bounds(SEQLENS, b, split, splits):  # noqa: N803
        """body_ws's `bounds`: splits of whole pairs of blocks, and the pairs (an odd count's last block, the
        sequence's last, is all masked). Each role computes them itself: TileLang's sync planner fails to see the
        roles' conditions warp-uniform under these expressions."""
        start, end, blocks = bounds(SEQLENS, b, split, splits, 2 * block_n)
        return start, end, T.ceildiv(blocks, 2)

    @T.macro
    def online_softmax(s, m, m_prev, row_sum, l, n0, end, scale):  # noqa: E741
        """One block's step of the docstring's recurrence: s (scores) becomes p, m and l advance, and m_prev is left
        holding the factor exp2(m_old - m) that rescales the output accumulator."""
        for i, j in T.Parallel(bh, block_n):
            s[i, j] = T.if_then_else(n0 + j < end, s[i, j] * (scale * LOG2E), -T.infinity(f32))
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)  # m = max(m_prev, rowmax(s))
        for i, j in T.Parallel(bh, block_n):
            s[i, j] = T.exp2(s[i, j] - m[i])
        T.reduce_sum(s, row_sum, dim=1)
        for i in T.Parallel(bh):
            m_prev[i] = T.exp2(m_prev[i] - m[i])
            l[i] = l[i] * m_prev[i] + row_sum[i]

    @T.macro
    def body(Q_NOPE, Q_PE, KV, K_PE, SEQLENS, BLOCK_TABLE, OUT, LSE, scale, splits):  # noqa: N803
        # the head tiles of a sequence are neighbours in the grid: they run at the same time and share its rows in L2
        with T.Kernel(T.ceildiv(H, bh), B, splits, threads=256) as (hb, b, split):
            q_tile = T.alloc_shared((bh, dc), dtype)
            qpe_tile = T.alloc_shared((bh, dr), dtype)
            kv_tile = T.alloc_shared((block_n, dc), dtype)
            kpe_tile = T.alloc_shared((block_n, dr), dtype)
            p_tile = T.alloc_shared((bh, block_n), dtype)
            s = T.alloc_fragment((bh, block_n), f32)
            acc = T.alloc_fragment((bh, dc), f32)
            m = T.alloc_fragment((bh,), f32)
            m_prev = T.alloc_fragment((bh,), f32)
            row_sum = T.alloc_fragment((bh,), f32)
            l = T.alloc_fragment((bh,), f32)  # noqa: E741 - the softmax denominator's usual name

            h0 = hb * bh
            # at least one block: an empty split masks all of one (see the module's docstring)
            start, end, blocks = bounds(SEQLENS, b, split, splits)

            T.copy(Q_NOPE[b, h0 : h0 + bh, :], q_tile)
            T.copy(Q_PE[b, h0 : h0 + bh, :], qpe_tile)
            T.fill(acc, 0)
            T.fill(l, 0)
            T.fill(m, -1e30)
            for k in T.Pipelined(blocks, num_stages=stages):
                n0 = start + k * block_n
                if paged:
                    page = BLOCK_TABLE[b, T.min(n0 // PS, MP - 1)]
                    row = n0 % PS
                else:
                    page, row = b, n0
                T.copy(KV[page, row : row + block_n, :], kv_tile)
                T.copy(K_PE[page, row : row + block_n, :], kpe_tile)
                T.gemm(q_tile, kv_tile, s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                T.gemm(qpe_tile, kpe_tile, s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                online_softmax(s, m, m_prev, row_sum, l, n0, end, scale)
                for i, j in T.Parallel(bh, dc):
                    acc[i, j] *= m_prev[i]
                T.copy(s, p_tile)
                if n0 + block_n > end:  # rows past the end: zeros, not whatever the cache holds there
                    for i, j in T.Parallel(block_n, dc):
                        if n0 + i >= end:
                            kv_tile[i, j] = T.cast(0, dtype)
                T.gemm(p_tile, kv_tile, acc, policy=T.GemmWarpPolicy.FullCol)
            for i, j in T.Parallel(bh, dc):
                acc[i, j] = acc[i, j] / T.if_then_else(l[i] == 0, T.float32(1), l[i])
            if partial:
                T.copy(acc, OUT[b, h0 : h0 + bh, split, :])
                for i in T.Parallel(bh):
                    if h0 + i < H:
                        LSE[b, h0 + i, split] = T.if_then_else(l[i] == 0, -T.infinity(f32), m[i] + T.log2(l[i]))
            else:
                T.copy(acc, q_tile)  # the queries' buffer, free now, stages the output for a TMA store
                T.copy(q_tile, OUT[b, h0 : h0 + bh, :])
                for i in T.Parallel(bh):
                    if h0 + i < H:
                        LSE[b, h0 + i] = T.if_then_else(l[i] == 0, -T.infinity(f32), (m[i] + T.log2(l[i])) * LN2)

    @T.macro
    def body_ws(Q_NOPE, Q_PE, KV, K_PE, SEQLENS, BLOCK_TABLE, OUT, LSE, scale, splits):  # noqa: N803
        # "ws": three warp groups by hand. Group 0 computes each block's whole 64 x BLOCK_N scores (one wgmma of
        # N = BLOCK_N a K slice), its softmax and the left half of p kv, and zeroes the block's rows past the split's
        # end (both halves); group 1 the right half of p kv from the probabilities and rescale factors group 0 leaves
        # in shared memory; group 2 loads q, then the blocks into two buffers, with TMA.
        half = dc // 2
        with T.Kernel(T.ceildiv(H, bh), B, splits, threads=384) as (hb, b, split):
            q_l = T.alloc_shared((bh, half), dtype)
            q_r = T.alloc_shared((bh, half), dtype)
            qpe_tile = T.alloc_shared((bh, dr), dtype)
            kv0_l = T.alloc_shared((block_n, half), dtype)
            kv0_r = T.alloc_shared((block_n, half), dtype)
            kv1_l = T.alloc_shared((block_n, half), dtype)
            kv1_r = T.alloc_shared((block_n, half), dtype)
            kpe0 = T.alloc_shared((block_n, dr), dtype)
            kpe1 = T.alloc_shared((block_n, dr), dtype)
            kvs_l, kvs_r, kpes = [kv0_l, kv1_l], [kv0_r, kv1_r], [kpe0, kpe1]
            p_tile = T.alloc_shared((bh, block_n), dtype)
            alpha_shared = T.alloc_shared((bh,), f32)
            l_shared = T.alloc_shared((bh,), f32)
            acc_l = T.alloc_fragment((bh, half), f32)
            acc_r = T.alloc_fragment((bh, half), f32)
            s = T.alloc_fragment((bh, block_n), f32)
            m = T.alloc_fragment((bh,), f32)
            m_prev = T.alloc_fragment((bh,), f32)
            row_sum = T.alloc_fragment((bh,), f32)
            l = T.alloc_fragment((bh,), f32)  # noqa: E741 - the softmax denominator's usual name
            q_ready = T.alloc_barrier(arrive_count=128)  # the TMA group's, + the bytes
            kv_ready = [T.alloc_barrier(arrive_count=128), T.alloc_barrier(arrive_count=128)]  # + TMA's bytes
            kv_free = [T.alloc_barrier(arrive_count=256), T.alloc_barrier(arrive_count=256)]  # both p kv done
            p_ready = T.alloc_barrier(arrive_count=256)  # p_tile / alpha_shared of a block written (group 0)
            p_free = T.alloc_barrier(arrive_count=256)  # ... and read (group 1)
            l_ready = T.alloc_barrier(arrive_count=256)

            h0 = hb * bh
            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(240, 1)
                start, end, pairs = pair_bounds(SEQLENS, b, split, splits)
                T.fill(acc_l, 0)
                T.fill(l, 0)
                T.fill(m, -1e30)
                T.barrier_wait(q_ready, 0)
                for i in T.serial(pairs):
                    for j in (0, 1):  # the two buffers (expanded when the IR is built)
                        k = 2 * i + j
                        n0 = start + k * block_n
                        kv_l, kv_r, kpe = kvs_l[j], kvs_r[j], kpes[j]
                        T.barrier_wait(kv_ready[j], i & 1)
                        T.gemm(q_l, kv_l, s, transpose_B=True, clear_accum=True, annotations={"wg_wait": -1})
                        T.gemm(q_r, kv_r, s, transpose_B=True, annotations={"wg_wait": -1})
                        T.gemm(qpe_tile, kpe, s, transpose_B=True, annotations={"wg_wait": -1})
                        if pipelined:  # the previous block's p kv runs while this block's softmax does
                            if k > 0:
                                T.gemm(p_tile, kvs_l[1 - j], acc_l, annotations={"wg_wait": -1})
                                T.wait_wgmma(1)
                            else:
                                T.wait_wgmma(0)
                            online_softmax(s, m, m_prev, row_sum, l, n0, end, scale)
                            T.wait_wgmma(0)
                            if k > 0:
                                T.barrier_arrive(kv_free[1 - j])
                        else:
                            T.wait_wgmma(0)
                        if k > 0:  # group 1 has read the previous block's p_tile and alpha_shared
                            T.barrier_arrive(p_free)
                            T.barrier_wait(p_free, (k & 1) ^ 1)
                        if not pipelined:
                            online_softmax(s, m, m_prev, row_sum, l, n0, end, scale)
                        for r, c in T.Parallel(bh, half):
                            acc_l[r, c] *= m_prev[r]
                        T.copy(m_prev, alpha_shared)
                        T.copy(s, p_tile)
                        # rows past the end: zeros, not whatever the cache holds there (group 1's half too: its
                        # p kv runs after ours)
                        for r, c in T.Parallel(block_n, half):
                            if n0 + r >= end:
                                kv_l[r, c] = T.cast(0, dtype)
                                kv_r[r, c] = T.cast(0, dtype)
                        if pipelined:
                            T.fence_proxy_async()  # our writes, before group 1's wgmma reads them
                        else:
                            T.gemm(p_tile, kv_l, acc_l)
                        T.barrier_arrive(p_ready)
                        if not pipelined:
                            T.barrier_arrive(kv_free[j])
                if pipelined:  # the last block's (always the second buffer's)
                    T.gemm(p_tile, kvs_l[1], acc_l)
                T.copy(l, l_shared)
                T.barrier_arrive(l_ready)
                for r, c in T.Parallel(bh, half):
                    acc_l[r, c] = acc_l[r, c] / T.if_then_else(l[r] == 0, T.float32(1), l[r])
                if partial:
                    for r, c in T.Parallel(bh, half):
                        if h0 + r < H:
                            OUT[b, h0 + r, split, c] = acc_l[r, c]
                    for r in T.Parallel(bh):
                        if h0 + r < H:
                            LSE[b, h0 + r, split] = T.if_then_else(l[r] == 0, -T.infinity(f32), m[r] + T.log2(l[r]))
                else:
                    T.copy(acc_l, q_l)  # free now: stages the output for one store
                    T.copy(q_l, OUT[b, h0 : h0 + bh, 0:half])
                    for r in T.Parallel(bh):
                        if h0 + r < H:
                            LSE[b, h0 + r] = T.if_then_else(l[r] == 0, -T.infinity(f32), (m[r] + T.log2(l[r])) * LN2)
            elif tx >= 128 and tx < 256:
                T.set_max_nreg(168, 1)
                start, end, pairs = pair_bounds(SEQLENS, b, split, splits)
                T.fill(acc_r, 0)
                for i in T.serial(pairs):
                    for j in (0, 1):  # the two buffers (expanded when the IR is built)
                        k = 2 * i + j
                        kv_r = kvs_r[j]
                        T.barrier_arrive(p_ready)
                        T.barrier_wait(p_ready, k & 1)
                        for r, c in T.Parallel(bh, half):
                            acc_r[r, c] *= alpha_shared[r]
                        T.gemm(p_tile, kv_r, acc_r)
                        T.barrier_arrive(kv_free[j])
                        if k < 2 * pairs - 1:  # group 0 waits for this before its next block only
                            T.barrier_arrive(p_free)
                T.barrier_arrive(l_ready)
                T.barrier_wait(l_ready, 0)
                for r, c in T.Parallel(bh, half):
                    acc_r[r, c] = acc_r[r, c] / T.if_then_else(l_shared[r] == 0, T.float32(1), l_shared[r])
                if partial:
                    for r, c in T.Parallel(bh, half):
                        if h0 + r < H:
                            OUT[b, h0 + r, split, half + c] = acc_r[r, c]
                else:
                    T.copy(acc_r, q_r)  # group 0's last scores are done: free
                    T.copy(q_r, OUT[b, h0 : h0 + bh, half:dc])
            else:
                T.set_max_nreg(56, 0)
                start, end, pairs = pair_bounds(SEQLENS, b, split, splits)
                T.tma_copy(Q_NOPE[b, h0 : h0 + bh, 0:half], q_l, barrier=q_ready)
                T.tma_copy(Q_NOPE[b, h0 : h0 + bh, half:dc], q_r, barrier=q_ready)
                T.tma_copy(Q_PE[b, h0 : h0 + bh, :], qpe_tile, barrier=q_ready)
                T.barrier_arrive(q_ready)
                for i in T.serial(pairs):
                    for j in (0, 1):  # the two buffers (expanded when the IR is built)
                        n0 = start + (2 * i + j) * block_n
                        if paged:
                            page = BLOCK_TABLE[b, T.min(n0 // PS, MP - 1)]
                            row = n0 % PS
                        else:
                            page, row = b, n0
                        T.barrier_wait(kv_free[j], (i & 1) ^ 1)
                        T.tma_copy(KV[page, row : row + block_n, 0:half], kvs_l[j], barrier=kv_ready[j])
                        T.tma_copy(KV[page, row : row + block_n, half:dc], kvs_r[j], barrier=kv_ready[j])
                        T.tma_copy(K_PE[page, row : row + block_n, :], kpes[j], barrier=kv_ready[j])
                        T.barrier_arrive(kv_ready[j])

    if config in ("ws", "wsp"):
        body = body_ws  # noqa: F811 - the prim_funcs below take the configuration's body

    if paged and partial:

        @T.prim_func
        def mla_decode_paged_partial(
            Q_NOPE: T.Tensor((B, H, dc), dtype), Q_PE: T.Tensor((B, H, dr), dtype),
            KV: T.Tensor((P, PS, dc), dtype), K_PE: T.Tensor((P, PS, dr), dtype),
            SEQLENS: T.Tensor((B,), "int32"), BLOCK_TABLE: T.Tensor((B, MP), "int32"),
            PARTIAL_O: T.Tensor((B, H, S, dc), f32), PARTIAL_LSE: T.Tensor((B, H, S), f32), scale: T.float32,
        ):  # fmt: skip
            body(Q_NOPE, Q_PE, KV, K_PE, SEQLENS, BLOCK_TABLE, PARTIAL_O, PARTIAL_LSE, scale, S)

        return mla_decode_paged_partial
    if paged:

        @T.prim_func
        def mla_decode_paged(
            Q_NOPE: T.Tensor((B, H, dc), dtype), Q_PE: T.Tensor((B, H, dr), dtype),
            KV: T.Tensor((P, PS, dc), dtype), K_PE: T.Tensor((P, PS, dr), dtype),
            SEQLENS: T.Tensor((B,), "int32"), BLOCK_TABLE: T.Tensor((B, MP), "int32"),
            OUT: T.Tensor((B, H, dc), dtype), LSE: T.Tensor((B, H), f32), scale: T.float32,
        ):  # fmt: skip
            body(Q_NOPE, Q_PE, KV, K_PE, SEQLENS, BLOCK_TABLE, OUT, LSE, scale, 1)

        return mla_decode_paged
    if partial:

        @T.prim_func
        def mla_decode_partial(
            Q_NOPE: T.Tensor((B, H, dc), dtype), Q_PE: T.Tensor((B, H, dr), dtype),
            KV: T.Tensor((B, PS, dc), dtype), K_PE: T.Tensor((B, PS, dr), dtype), SEQLENS: T.Tensor((B,), "int32"),
            PARTIAL_O: T.Tensor((B, H, S, dc), f32), PARTIAL_LSE: T.Tensor((B, H, S), f32), scale: T.float32,
        ):  # fmt: skip
            body(Q_NOPE, Q_PE, KV, K_PE, SEQLENS, None, PARTIAL_O, PARTIAL_LSE, scale, S)

        return mla_decode_partial

    @T.prim_func
    def mla_decode(
        Q_NOPE: T.Tensor((B, H, dc), dtype), Q_PE: T.Tensor((B, H, dr), dtype),
        KV: T.Tensor((B, PS, dc), dtype), K_PE: T.Tensor((B, PS, dr), dtype), SEQLENS: T.Tensor((B,), "int32"),
        OUT: T.Tensor((B, H, dc), dtype), LSE: T.Tensor((B, H), f32), scale: T.float32,
    ):  # fmt: skip
        body(Q_NOPE, Q_PE, KV, K_PE, SEQLENS, None, OUT, LSE, scale, 1)

    return mla_decode


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of every kernel in the given dtypes that it supports (the AOT matrix): the default
    config, contiguous and paged, whole and partial."""
    kernels = [kernel_name(paged, partial) for paged in (False, True) for partial in (False, True)]
    return [(k, d, d) for d in dtypes if d in DTYPES for k in kernels]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func, FAST_MATH)
