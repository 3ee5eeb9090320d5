"""fp8_matmul's TileLang kernel for Hopper (backend="tilelang"): the math of fp8_matmul.py, written in TileLang.

One program per (BLOCK_M, 128) output tile, the tiles visited in panels of SWIZZLE tile columns. K streams one 128-wide
scale block a step through a T.Pipelined loop of `stages` shared buffers: TileLang lowers the a and b tile copies to
TMA, the e4m3 product to wgmma (operands in shared memory, both K-major: b is a Linear weight's (N, K)) into a fresh
fp32 tile, and the loop to a TMA producer warp group beside the consumer warp groups. The consumers scale each step's
tile by a's per-row scale times b's per-tile scale and add it to the fp32 accumulator (DeepSeek-V3's promotion: the
tensor cores' ~14-bit sums never span more than one block), the scales read by the consumers from global memory
before they wait for the step's tiles (after the wgmma's wait, their latency would add to every step); the result
is rounded once to out_dtype and leaves through shared memory (a TMA store).

Sizes M, N, K are dynamic (no recompile per shape); rows past M read TMA's zero fill and a zero scale, and are not
stored.

Design limits: sm_90a only; a, b compact, a_scales compact row-major (M, K / 128) (the adapters copy other layouts);
K and N multiples of 128 (fp8_matmul.check); BLOCK_N = 128, one b scale a tile; in the default configuration a
step's promotion waits for its wgmma (the PAIRED ones keep a second product tile in flight); not persistent.
backend=None runs it on sm_90 from 128 rows (fp8_matmul.preferred_backend: the ratios to the Triton kernel and to
torch._scaled_mm are there).
"""

from .backends import tilelang_entry_points, tilelang_target, ws_roles, ws_warps

OUT_DTYPES = ("bfloat16", "float16", "float32")
ARCHS = (90,)  # compute capabilities the kernel is written for
AOT_TARGETS = ("cuda:90",)  # the AOT matrix's TileLang targets (aot.TILELANG_TARGETS) that build it
SWIZZLE = 8  # tile columns a panel
BLOCK = 128  # K step and BLOCK_N: fp8_matmul's scale block

# (BLOCK_M, stages, threads, PAIRED) by config name; "default" is what backend="tilelang" runs: 128 rows in two
# consumer warp groups (64 x 128 fp32 of accumulator and 64 x 128 of the step's product each), 3 stages of 32 KiB (the
# fastest of benchmarks/sweep_fp8_matmul.py on an H200: 4 stages tie at 8192^3 and lose 8% at 4096 x 14336 x 4096).
# PAIRED: the K steps in pairs under an explicit warp-specialization schedule (two pipelines of `stages` each, two
# product tiles): each step's promotion runs while the other step's wgmma does, and the consumers wait for the
# tensor cores once a pair (TileLang's automatic loop waits for every step's wgmma before promoting it). 2 stages: 4
# tiles of 32 KiB and the output tile (32 KiB bf16, 64 KiB fp32; the schedule does not overlay it on the stages).
# Built for sm_90a without spills, not yet timed.
CONFIGS = {
    "default": (128, 3, 256, False), "m64s6": (64, 6, 128, False), "m128s4": (128, 4, 256, False),
    "paired": (128, 2, 256, True),
}  # fmt: skip
DEFAULT_CONFIG = "default"


def unsupported(arch: int | None = None) -> str | None:
    """Why the TileLang kernel cannot run on compute capability `arch` (None: not checked), or None. fp8_matmul.check
    has already required e4m3 operands, K and N multiples of 128."""
    if arch is not None and arch not in ARCHS:
        return f"runs on sm_90 (Hopper: wgmma, TMA) only, got sm_{arch}"
    return None


def kernel_name(config: str = DEFAULT_CONFIG) -> str:
    """fp8_matmul[_<config>]"""
    return "fp8_matmul" if config == DEFAULT_CONFIG else f"fp8_matmul_{config}"


def prim_func(kernel: str, _in_dtype: str, out_dtype: str, tilelang_target: dict):
    """The prim_func `kernel` (kernel_name) for one output dtype. Parameters: A (M, K), AS (M, K / 128), B (N, K),
    BS (N / 128, K / 128) (reads); OUT (M, N) (writes)."""
    import tilelang.language as T

    bm, stages, threads, paired = CONFIGS[kernel.removeprefix("fp8_matmul").removeprefix("_") or DEFAULT_CONFIG]
    fp8, f32 = "float8_e4m3", "float32"
    M, N, K, KB, NB = T.dynamic("M N K KB NB")  # noqa: N806 - sizes; KB = K / 128, NB = N / 128

    @T.macro
    def load_scales(row_scale, AS, BS, bx, by, k):  # noqa: N803
        """Step k's scale of each row: a's row scale x b's tile scale (0 past M)."""
        for i in T.Parallel(bm):
            row_scale[i] = T.if_then_else(by * bm + i < M, AS[by * bm + i, k], T.float32(0)) * BS[bx, k]

    @T.macro
    def promote(acc, step, row_scale):
        """acc += the step's product x its scales, as the Triton kernel."""
        for i, j in T.Parallel(bm, BLOCK):
            acc[i, j] += step[i, j] * row_scale[i]

    @T.prim_func
    def fp8_matmul(
        A: T.Tensor((M, K), fp8),  # noqa: N803
        AS: T.Tensor((M, KB), f32),  # noqa: N803
        B: T.Tensor((N, K), fp8),  # noqa: N803
        BS: T.Tensor((NB, KB), f32),  # noqa: N803
        OUT: T.Tensor((M, N), out_dtype),  # noqa: N803
    ):
        with T.Kernel(T.ceildiv(N, BLOCK), T.ceildiv(M, bm), threads=threads) as (bx, by):
            a_tile = T.alloc_shared((bm, BLOCK), fp8)
            b_tile = T.alloc_shared((BLOCK, BLOCK), fp8)
            out_tile = T.alloc_shared((bm, BLOCK), out_dtype)
            acc = T.alloc_fragment((bm, BLOCK), f32)
            step = T.alloc_fragment((bm, BLOCK), f32)
            row_scale = T.alloc_fragment((bm,), f32)
            T.use_swizzle(SWIZZLE)
            if paired:
                # the odd steps' tiles, product and scales; a last odd step past K (K / 128 odd) reloads step
                # K / 128 - 1 and is not promoted
                a_odd = T.alloc_shared((bm, BLOCK), fp8)
                b_odd = T.alloc_shared((BLOCK, BLOCK), fp8)
                step_odd = T.alloc_fragment((bm, BLOCK), f32)
                scale_odd = T.alloc_fragment((bm,), f32)
                T.annotate_ws_schedule(T.WSSchedule(
                    num_warps=ws_warps(threads),
                    roles=ws_roles(threads),
                    pipelines=[T.WSPipeline("even", [a_tile, b_tile], depth=stages),
                               T.WSPipeline("odd", [a_odd, b_odd], depth=stages)],
                    scopes=[
                        T.WSScope("pairs", {
                            "TMA": [T.WSSync.producer_acquire("even"), "load_a", "load_b",
                                    T.WSSync.producer_commit("even"), T.WSSync.producer_acquire("odd"), "load_a_odd",
                                    "load_b_odd", T.WSSync.producer_commit("odd")],
                            # even step 2t issued, then the odd step 2t - 1 promoted while it runs; odd step 2t + 1
                            # issued, even step 2t promoted once its wgmma is in; one full wait a pair
                            "MMA": ["scales", T.WSSync.consumer_wait("even"), "mma", "promote_odd", "scales_odd",
                                    T.WSSync.consumer_wait("odd"), "mma_odd", "wait_even",
                                    T.WSSync.consumer_release("even"), "promote", "wait_odd",
                                    T.WSSync.consumer_release("odd")],
                        }),
                        T.WSScope(T.WSScope.ROOT,
                                  {"TMA": ["pairs"], "MMA": ["clear", "pairs", "promote_last", "store"]}),
                    ],
                ))  # fmt: skip
                with T.ws_op("clear"):
                    T.clear(acc)
                for t in T.Pipelined(T.ceildiv(K, 2 * BLOCK), num_stages=stages, annotations={T.WSID: "pairs"}):
                    T.copy(A[by * bm, 2 * t * BLOCK], a_tile, annotations={T.WSID: "load_a"})
                    T.copy(B[bx * BLOCK, 2 * t * BLOCK], b_tile, annotations={T.WSID: "load_b"})
                    T.copy(A[by * bm, T.min(2 * t + 1, KB - 1) * BLOCK], a_odd, annotations={T.WSID: "load_a_odd"})
                    T.copy(B[bx * BLOCK, T.min(2 * t + 1, KB - 1) * BLOCK], b_odd, annotations={T.WSID: "load_b_odd"})
                    with T.ws_op("scales"):
                        load_scales(row_scale, AS, BS, bx, by, 2 * t)
                    T.gemm(a_tile, b_tile, step, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True,
                           annotations={T.WSID: "mma", "wg_wait": -1})  # fmt: skip
                    with T.ws_op("promote_odd"):  # step 2t - 1, complete since the last pair's full wait
                        if t > 0:
                            promote(acc, step_odd, scale_odd)
                    with T.ws_op("scales_odd"):
                        load_scales(scale_odd, AS, BS, bx, by, T.min(2 * t + 1, KB - 1))
                    T.gemm(a_odd, b_odd, step_odd, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                           clear_accum=True, annotations={T.WSID: "mma_odd", "wg_wait": -1})  # fmt: skip
                    with T.ws_op("wait_even"):
                        T.wait_wgmma(1)
                    with T.ws_op("promote"):
                        promote(acc, step, row_scale)
                    with T.ws_op("wait_odd"):
                        T.wait_wgmma(0)
                with T.ws_op("promote_last"):
                    if KB % 2 == 0:
                        promote(acc, step_odd, scale_odd)
                with T.ws_op("store"):
                    T.copy(acc, out_tile)
                    T.copy(out_tile, OUT[by * bm, bx * BLOCK])
            else:
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(K, BLOCK), num_stages=stages):
                    T.copy(A[by * bm, k * BLOCK], a_tile)
                    T.copy(B[bx * BLOCK, k * BLOCK], b_tile)
                    # the step's scales loaded before the product: their latency hides behind the wgmma instead of
                    # following its wait
                    load_scales(row_scale, AS, BS, bx, by, k)
                    # a warp group per 64 rows: m64n128k32 wgmma (the default split of N would issue n64 ones)
                    T.gemm(a_tile, b_tile, step, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    promote(acc, step, row_scale)
                T.copy(acc, out_tile)
                T.copy(out_tile, OUT[by * bm, bx * BLOCK])

    return fp8_matmul


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, "float8_e4m3fn", out dtype) of the default config for each output dtype given (the AOT matrix)."""
    return [(kernel_name(), "float8_e4m3fn", d) for d in dtypes if d in OUT_DTYPES]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func)
