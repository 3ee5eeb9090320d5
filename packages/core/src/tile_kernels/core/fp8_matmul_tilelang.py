"""fp8_matmul's TileLang kernel for Hopper (backend="tilelang"): the math of fp8_matmul.py, written in TileLang.

One program per (128, BLOCK_N) output tile, the tiles visited in panels of SWIZZLE tile columns. K streams one 128-wide
scale block a step through a T.Pipelined loop of `stages` shared buffers: TileLang lowers the a and b tile copies to
TMA, the e4m3 products to wgmma (operands in shared memory, both K-major: b is a Linear weight's (N, K)) into a fresh
fp32 tile, and the loop to a TMA producer warp group beside two consumer warp groups of 64 rows. The consumers scale
each step's product by a's per-row scale times b's per-tile scale and add it to an fp32 accumulator (DeepSeek-V3's
promotion: the tensor cores' ~14-bit sums never span more than one block), the scales read from global memory before
they wait for the step's tiles (after the wgmma's wait, their latency would add to every step); the result is rounded
once to out_dtype and leaves through shared memory (a TMA store).

BLOCK_N 256 ("n256", the default) holds two 128-column halves, each with its own accumulator and b scale, multiplied
in turn into one product tile (a consumer thread: 2 x 64 accumulators + 64 of product, where a 64 x 256 product
would need 256 registers); a step loads 48 KiB (b's 256 rows in one TMA load) for the work that BLOCK_N 128 ("n128")
loads 64 KiB for. n128 runs where its 128 x 128 tiles fit one wave of the SMs (config_for): there its twice as many,
shorter programs finish first.

Sizes M, N, K are dynamic (no recompile per shape); rows past M and columns past N read TMA's zero fill and a zero
scale, and are not stored.

Design limits: sm_90a only; a, b compact, a_scales compact row-major (M, K / 128) (the adapters copy other layouts);
K and N multiples of 128 (fp8_matmul.check); each step's promotion waits for its wgmma (the other consumer group's
wgmma runs meanwhile); not persistent, no TMA multicast across a cluster. backend=None runs it on sm_90 from 128 rows
(fp8_matmul.preferred_backend: the ratios to the Triton kernel and to torch._scaled_mm are there).
"""

from .backends import tilelang_entry_points, tilelang_target
from .plan import cdiv

OUT_DTYPES = ("bfloat16", "float16", "float32")
ARCHS = (90,)  # compute capabilities the kernel is written for
AOT_TARGETS = ("cuda:90",)  # the AOT matrix's TileLang targets (aot.TILELANG_TARGETS) that build it
SWIZZLE = 8  # tile columns a panel
BLOCK = 128  # K step, BLOCK_M and a b tile's rows: fp8_matmul's scale block

# (BLOCK_N, stages) by config name, 256 threads (TileLang adds the producer warp group). 3 stages: 48 KiB (n256) or
# 32 KiB (n128) each, the output tile overlaid on them.
CONFIGS = {"n256": (256, 3), "n128": (128, 3)}
DEFAULT_CONFIG = "n256"


def config_for(m: int, n: int, num_sms: int) -> str:
    """The configuration backend="tilelang" runs for an (m, n) output on `num_sms` SMs: n128 while its 128 x 128
    tiles fit one wave (halving the programs of a grid that already leaves SMs idle costs more than wider tiles
    save), else the default."""
    return "n128" if cdiv(m, BLOCK) * cdiv(n, BLOCK) <= num_sms else DEFAULT_CONFIG


def unsupported(arch: int | None = None) -> str | None:
    """Why the TileLang kernel cannot run on compute capability `arch` (None: not checked), or None. fp8_matmul.check
    has already required e4m3 operands, K and N multiples of 128."""
    if arch is not None and arch not in ARCHS:
        return f"runs on sm_90 (Hopper: wgmma, TMA) only, got sm_{arch}"
    return None


def kernel_name(config: str = DEFAULT_CONFIG) -> str:
    """fp8_matmul[_<config>]"""
    return "fp8_matmul" if config == DEFAULT_CONFIG else f"fp8_matmul_{config}"


def scale_macros(M, NB):  # noqa: N803 - the kernel's dynamic sizes
    """(load_scales, promote): the T.macro pair that applies the block scales, for a prim_func whose sizes M and NB
    (= N / 128) are these T.dynamic variables (also the cluster prototype's: benchmarks/proto_fp8_multicast.py)."""
    import tilelang.language as T

    @T.macro
    def load_scales(row_scale, AS, BS, nb, by, k, scale_right=None):  # noqa: N803
        """Step k's scale of each row: a's row scale x the scale of b's 128-row block nb (0 past M or N); with
        scale_right, also the scales of block nb + 1 there, from the same load of a's scales."""
        for i in T.Parallel(BLOCK):
            a_scale = T.if_then_else(by * BLOCK + i < M, AS[by * BLOCK + i, k], T.float32(0))
            row_scale[i] = a_scale * T.if_then_else(nb < NB, BS[nb, k], T.float32(0))
            if scale_right is not None:
                scale_right[i] = a_scale * T.if_then_else(nb + 1 < NB, BS[nb + 1, k], T.float32(0))

    @T.macro
    def promote(acc, step, row_scale):
        """acc += the step's product x its scales, as the Triton kernel."""
        for i, j in T.Parallel(BLOCK, BLOCK):
            acc[i, j] += step[i, j] * row_scale[i]

    return load_scales, promote


def prim_func(kernel: str, _in_dtype: str, out_dtype: str, tilelang_target: dict):
    """The prim_func `kernel` (kernel_name) for one output dtype. Parameters: A (M, K), AS (M, K / 128), B (N, K),
    BS (N / 128, K / 128) (reads); OUT (M, N) (writes)."""
    import tilelang.language as T

    bn, stages = CONFIGS[kernel.removeprefix("fp8_matmul").removeprefix("_") or DEFAULT_CONFIG]
    wide = bn == 2 * BLOCK
    fp8, f32 = "float8_e4m3", "float32"
    M, N, K, KB, NB = T.dynamic("M N K KB NB")  # noqa: N806 - sizes; KB = K / 128, NB = N / 128

    load_scales, promote = scale_macros(M, NB)

    @T.prim_func
    def fp8_matmul(
        A: T.Tensor((M, K), fp8),  # noqa: N803
        AS: T.Tensor((M, KB), f32),  # noqa: N803
        B: T.Tensor((N, K), fp8),  # noqa: N803
        BS: T.Tensor((NB, KB), f32),  # noqa: N803
        OUT: T.Tensor((M, N), out_dtype),  # noqa: N803
    ):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, BLOCK), threads=256) as (bx, by):
            a_tile = T.alloc_shared((BLOCK, BLOCK), fp8)
            b_tile = T.alloc_shared((bn, BLOCK), fp8)
            out_tile = T.alloc_shared((BLOCK, BLOCK), out_dtype)
            acc = T.alloc_fragment((BLOCK, BLOCK), f32)
            step = T.alloc_fragment((BLOCK, BLOCK), f32)
            row_scale = T.alloc_fragment((BLOCK,), f32)
            acc_right = scale_right = None
            if wide:  # the right half's accumulator and scales
                acc_right = T.alloc_fragment((BLOCK, BLOCK), f32)
                scale_right = T.alloc_fragment((BLOCK,), f32)
                T.clear(acc_right)
            T.use_swizzle(SWIZZLE)
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, BLOCK), num_stages=stages):
                T.copy(A[by * BLOCK, k * BLOCK], a_tile)
                T.copy(B[bx * bn, k * BLOCK], b_tile)  # one TMA load of b's bn rows
                # the step's scales loaded before the products: their latency hides behind the wgmma instead of
                # following its wait
                load_scales(row_scale, AS, BS, bx * (bn // BLOCK), by, k, scale_right if wide else None)
                # a warp group per 64 rows: m64n128k32 wgmma (the default split of N would issue n64 ones)
                T.gemm(a_tile, b_tile[0:BLOCK, :], step, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                       clear_accum=True)  # fmt: skip
                promote(acc, step, row_scale)
                if wide:
                    T.gemm(a_tile, b_tile[BLOCK:bn, :], step, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                           clear_accum=True)  # fmt: skip
                    promote(acc_right, step, scale_right)
            T.copy(acc, out_tile)
            T.copy(out_tile, OUT[by * BLOCK, bx * bn])
            if wide:
                T.copy(acc_right, out_tile)
                T.copy(out_tile, OUT[by * BLOCK, bx * bn + BLOCK])

    return fp8_matmul


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, "float8_e4m3fn", out dtype) of each configuration and output dtype given (the AOT matrix)."""
    return [(kernel_name(c), "float8_e4m3fn", d) for c in CONFIGS for d in dtypes if d in OUT_DTYPES]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func)
