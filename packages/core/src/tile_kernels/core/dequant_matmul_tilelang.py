"""dequant_matmul's TileLang kernel for Hopper at prefill sizes (backend="tilelang"): the math of dequant_matmul.py.

One program per (BLOCK_M, BLOCK_N) output tile, the tiles visited in panels of SWIZZLE tile columns. K streams in
BLOCK_K steps through a T.Pipelined loop of `stages` shared buffers: the a tile (BLOCK_M, BLOCK_K), the packed codes
(BLOCK_K / 8, BLOCK_N) int32 and the step's row of scales (and zeros) arrive by TMA from a producer warp group (the
consumers read only shared memory: a global load of theirs would add its latency to every step). The consumer warp
groups unpack the codes into W = (code - zero) * scale, formed in fp32 and rounded to a's dtype as the reference's
dequantize-then-multiply (a step lies in one group: BLOCK_K divides group_size), write that (BLOCK_K, BLOCK_N) tile
to shared memory and run the step's wgmma on it. The fp32 accumulator is rounded once and leaves through shared
memory (a TMA store).

Sizes M, N, K are dynamic (no recompile per shape); rows and columns past the ends read TMA's zero fill (and a zero
scale) and are not stored.

Design limits: sm_90a only; float16 / bfloat16; qweight, scales and zeros compact (the adapters copy others); N a
multiple of 8 (TMA's 16-byte row strides of the scales), group_size a multiple of BLOCK_K (64); the codes are
unpacked by shifts and masks (no lop3 pairs, no Marlin-style repack); in the default configuration the unpacking
and the wgmmas do not overlap (the PAIRED one overlaps them); not persistent.
backend=None keeps the Triton kernels: this one is slower (H200, 2026-12-04, M 4096, K 8192, N 28672: 242 TFLOP/s,
the Triton kernel 333, cuBLAS on the dequantized weight 731; benchmarks/results/h200/notes.md).
"""

from .backends import tilelang_entry_points, tilelang_target, ws_roles, ws_warps

DTYPES = ("float16", "bfloat16")
ARCHS = (90,)  # compute capabilities the kernel is written for
AOT_TARGETS = ("cuda:90",)  # the AOT matrix's TileLang targets (aot.TILELANG_TARGETS) that build it
SWIZZLE = 8  # tile columns a panel
BLOCK_K = 64  # K step: 8 words of codes a column
SUPPORTED_OPTIONS = {"group_size": (128,)}  # of dequant_matmul's options (group sizes 8, 32, 128), what it runs

# (BLOCK_M, BLOCK_N, stages, threads, PAIRED) by config name; "default" is what backend="tilelang" runs: 128 x 128
# tiles in two consumer warp groups (64 rows each), 4 stages of 16 KiB of a and 4 KiB of codes. PAIRED: the K steps in
# pairs under an explicit warp-specialization schedule (two pipelines of `stages` each): a step's a tile is copied
# and its codes unpacked into consumer-owned tiles (two sets, one a step of the pair) while the previous step's wgmma
# runs, and its stage goes back to the producer before its own wgmma is issued, so the tensor cores work beside the
# unpacking (the automatic loop unpacks, then waits for its wgmma). Built for sm_90a, not yet timed.
CONFIGS = {
    "default": (128, 128, 4, 256, False), "m128n256s3": (128, 256, 3, 256, False),
    "m64n128s4": (64, 128, 4, 128, False), "paired": (128, 128, 2, 256, True),
}  # fmt: skip
DEFAULT_CONFIG = "default"


def unsupported(dtype: str, n: int, group_size: int, arch: int | None = None) -> str | None:
    """Why the TileLang kernel cannot run these inputs (a clause naming the feature), or None. arch None: not
    checked (known only on the device)."""
    if dtype not in DTYPES:
        return f"supports {' / '.join(DTYPES)} only, got {dtype}"
    if n % 8:
        return f"needs N a multiple of 8 (TMA's 16-byte row strides), got N = {n}"
    if group_size % BLOCK_K:
        return f"needs group_size a multiple of {BLOCK_K} (a K step within one group), got {group_size}"
    if arch is not None and arch not in ARCHS:
        return f"runs on sm_90 (Hopper: wgmma, TMA) only, got sm_{arch}"
    return None


def unsupported_inputs(kwargs) -> str | None:
    """`unsupported` for a call's arguments (backends.unsupported_inputs)."""
    a, qweight = kwargs["a"], kwargs["qweight"]
    return unsupported(str(a.dtype).removeprefix("torch."), qweight.shape[1], kwargs.get("group_size", 128), None)


def kernel_name(has_zeros: bool, config: str = DEFAULT_CONFIG) -> str:
    """dequant_matmul[_zeros][_<config>]"""
    return "_".join(["dequant_matmul"] + ["zeros"] * has_zeros + [config] * (config != DEFAULT_CONFIG))


def _parse(kernel: str) -> tuple[bool, str]:
    parts = kernel.removeprefix("dequant_matmul").split("_")
    return "zeros" in parts, next((p for p in parts if p in CONFIGS), DEFAULT_CONFIG)


def prim_func(kernel: str, dtype: str, _dtype: str, tilelang_target: dict, group_size: int = 128):
    """The prim_func `kernel` (kernel_name) for one dtype and group size. Parameters: A (M, K), QW (K / 8, N), S
    (K / group_size, N), with _zeros Z (K / group_size, N) (reads); OUT (M, N) (writes)."""
    import tilelang.language as T

    has_zeros, config = _parse(kernel)
    bm, bn, stages, threads, paired = CONFIGS[config]
    f32 = "float32"
    M, N, K, KW, G = T.dynamic("M N K KW G")  # noqa: N806 - sizes; KW = K / 8, G = K / group_size

    @T.macro
    def unpack(codes, s_tile, z_tile, w_tile):
        """W = (code - zero) * scale in fp32, rounded to a's dtype; code k = 8 w + b: bits 4b .. 4b + 3 of word w."""
        for i, j in T.Parallel(BLOCK_K, bn):
            code = T.cast((codes[i // 8, j] >> (4 * (i % 8))) & 15, f32)
            zero = T.cast(z_tile[0, j], f32) if has_zeros else T.float32(8)
            w_tile[i, j] = T.cast((code - zero) * T.cast(s_tile[0, j], f32), dtype)

    @T.macro
    def paired_steps(A, QW, S, Z, OUT, bx, by, a_tile, codes, w_tile, out_tile, acc, s_tile, z_tile):  # noqa: N803
        """The PAIRED schedule (see CONFIGS): steps 2t (the even pipeline: a_tile, codes, s_tile, z_tile) and 2t + 1
        (the odd one); each step's operands copied into consumer-owned tiles (a_own / w_tile for even steps, a_odd /
        w_odd for odd ones) once the wgmma that last read them is in, its stage released, its wgmma issued."""
        a_own = T.alloc_shared((bm, BLOCK_K), dtype)
        a_in_odd = T.alloc_shared((bm, BLOCK_K), dtype)
        codes_odd = T.alloc_shared((BLOCK_K // 8, bn), "int32")
        s_odd = T.alloc_shared((1, bn), dtype)
        z_odd = T.alloc_shared((1, bn), dtype)
        a_odd = T.alloc_shared((bm, BLOCK_K), dtype)
        w_odd = T.alloc_shared((BLOCK_K, bn), dtype)
        even = [a_tile, codes, s_tile] + ([z_tile] if has_zeros else [])
        odd = [a_in_odd, codes_odd, s_odd] + ([z_odd] if has_zeros else [])
        loads = ["load_a", "load_codes", "load_s"] + (["load_z"] if has_zeros else [])
        T.annotate_ws_schedule(T.WSSchedule(
            num_warps=ws_warps(threads),
            roles=ws_roles(threads),
            pipelines=[T.WSPipeline("even", even, depth=stages), T.WSPipeline("odd", odd, depth=stages)],
            scopes=[
                T.WSScope("pairs", {
                    "TMA": [T.WSSync.producer_acquire("even"), *loads, T.WSSync.producer_commit("even"),
                            T.WSSync.producer_acquire("odd"), *[f"{x}_odd" for x in loads],
                            T.WSSync.producer_commit("odd")],
                    # one wgmma in flight while a step's operands are unpacked: the one issued last
                    "MMA": [T.WSSync.consumer_wait("even"), "free_even", "own_even", T.WSSync.consumer_release("even"),
                            "mma", T.WSSync.consumer_wait("odd"), "free_odd", "own_odd",
                            T.WSSync.consumer_release("odd"), "mma_odd"],
                }),
                T.WSScope(T.WSScope.ROOT, {"TMA": ["pairs"], "MMA": ["clear", "pairs", "store"]}),
            ],
        ))  # fmt: skip
        with T.ws_op("clear"):
            T.clear(acc)
        for t in T.Pipelined(T.ceildiv(K, 2 * BLOCK_K), num_stages=stages, annotations={T.WSID: "pairs"}):
            # an odd last step past K (K / 64 odd) reads TMA's zero fill: codes, scales and a of 0 add nothing
            T.copy(A[by * bm, 2 * t * BLOCK_K], a_tile, annotations={T.WSID: "load_a"})
            T.copy(QW[2 * t * (BLOCK_K // 8), bx * bn], codes, annotations={T.WSID: "load_codes"})
            T.copy(S[(2 * t * BLOCK_K) // group_size, bx * bn], s_tile, annotations={T.WSID: "load_s"})
            T.copy(A[by * bm, (2 * t + 1) * BLOCK_K], a_in_odd, annotations={T.WSID: "load_a_odd"})
            T.copy(QW[(2 * t + 1) * (BLOCK_K // 8), bx * bn], codes_odd, annotations={T.WSID: "load_codes_odd"})
            T.copy(S[((2 * t + 1) * BLOCK_K) // group_size, bx * bn], s_odd, annotations={T.WSID: "load_s_odd"})
            if has_zeros:
                T.copy(Z[(2 * t * BLOCK_K) // group_size, bx * bn], z_tile, annotations={T.WSID: "load_z"})
                T.copy(Z[((2 * t + 1) * BLOCK_K) // group_size, bx * bn], z_odd, annotations={T.WSID: "load_z_odd"})
            with T.ws_op("free_even"):  # the wgmma of step 2t - 2 (it read a_own, w_tile) is in; 2t - 1's may run
                T.wait_wgmma(1)
            with T.ws_op("own_even"):
                T.copy(a_tile, a_own)
                unpack(codes, s_tile, z_tile, w_tile)
            T.gemm(a_own, w_tile, acc, policy=T.GemmWarpPolicy.FullRow, annotations={T.WSID: "mma", "wg_wait": -1})
            with T.ws_op("free_odd"):  # step 2t - 1's wgmma is in; 2t's may run
                T.wait_wgmma(1)
            with T.ws_op("own_odd"):
                T.copy(a_in_odd, a_odd)
                unpack(codes_odd, s_odd, z_odd, w_odd)
            T.gemm(a_odd, w_odd, acc, policy=T.GemmWarpPolicy.FullRow, annotations={T.WSID: "mma_odd", "wg_wait": -1})
        with T.ws_op("store"):
            T.wait_wgmma(0)
            T.copy(acc, out_tile)
            T.copy(out_tile, OUT[by * bm, bx * bn])

    @T.macro
    def body(A, QW, S, Z, OUT):  # noqa: N803
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=threads) as (bx, by):
            a_tile = T.alloc_shared((bm, BLOCK_K), dtype)
            codes = T.alloc_shared((BLOCK_K // 8, bn), "int32")
            w_tile = T.alloc_shared((BLOCK_K, bn), dtype)
            out_tile = T.alloc_shared((bm, bn), dtype)
            acc = T.alloc_fragment((bm, bn), f32)
            s_tile = T.alloc_shared((1, bn), dtype)
            z_tile = T.alloc_shared((1, bn), dtype)
            T.use_swizzle(SWIZZLE)
            if paired:
                paired_steps(A, QW, S, Z, OUT, bx, by, a_tile, codes, w_tile, out_tile, acc, s_tile, z_tile)
            else:
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=stages):
                    T.copy(A[by * bm, k * BLOCK_K], a_tile)
                    T.copy(QW[k * (BLOCK_K // 8), bx * bn], codes)
                    # the step's group row of scales (and zeros) by TMA too: the consumers read only shared memory
                    T.copy(S[(k * BLOCK_K) // group_size, bx * bn], s_tile)
                    if has_zeros:
                        T.copy(Z[(k * BLOCK_K) // group_size, bx * bn], z_tile)
                    unpack(codes, s_tile, z_tile, w_tile)
                    T.gemm(a_tile, w_tile, acc, policy=T.GemmWarpPolicy.FullRow)
                T.copy(acc, out_tile)
                T.copy(out_tile, OUT[by * bm, bx * bn])

    # annotations are factories (TileLang calls them): one buffer per parameter
    def a_t():
        return T.Tensor((M, K), dtype)

    def qw_t():
        return T.Tensor((KW, N), "int32")

    def g_t():
        return T.Tensor((G, N), dtype)

    def out_t():
        return T.Tensor((M, N), dtype)

    if has_zeros:

        @T.prim_func
        def dequant_matmul(A: a_t, QW: qw_t, S: g_t, Z: g_t, OUT: out_t):  # noqa: N803
            body(A, QW, S, Z, OUT)

    else:

        @T.prim_func
        def dequant_matmul(A: a_t, QW: qw_t, S: g_t, OUT: out_t):  # noqa: N803
            body(A, QW, S, None, OUT)

    return dequant_matmul


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of the default config with and without zeros in each supported dtype given (the AOT
    matrix), group_size 128."""
    return [(kernel_name(z), d, d) for d in dtypes if d in DTYPES for z in (False, True)]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func)
