"""matmul's TileLang kernel for Hopper (backend="tilelang"): out = act(a @ b + bias) + residual, the math of matmul.py.

One program per (BLOCK_M, BLOCK_N) output tile, the tiles visited in panels of SWIZZLE tiles (T.use_swizzle: a
panel's programs share a's row blocks and b's column blocks in L2). a (M, K) row-major and b either
(K, N) row-major or, as a torch Linear weight W (N, K) is read for x @ W.t(), column-major (B_COL: the kernel takes
W itself and multiplies by its transpose). K streams through a T.Pipelined loop of `stages` shared buffers: TileLang
lowers the tile copies to TMA, the products to wgmma with operands in shared memory and the loop to a TMA producer
warp group beside the consumer warp groups (warp specialization, mbarriers, setmaxnreg), on its own for sm_90a. The
fp32 accumulator goes through the epilogue (bias from a shared copy of the tile's columns, the activation, the
residual tile copied into the output's shared buffer), is rounded once to the output dtype and leaves through shared
memory (a TMA store).

Sizes M, N, K are dynamic (no recompile per shape); tiles past M, N or K read TMA's zero fill and are not stored.

Design limits: sm_90a only (`unsupported` says so elsewhere); float16 / bfloat16 in and out, compact operands (the
torch adapter copies others); K and N multiples of 8 elements (TMA's 16-byte row strides, the output's too); one
program a tile except in the persistent configurations. The epilogue and 256-row configurations spill 120-172 bytes
a thread (`__launch_bounds__(384, 1)` caps ptxas at 168 registers, below the consumers' setmaxnreg 240).

backend=None runs it on sm_90 where it is measured faster (matmul.preferred_backend: the ratios to cuBLAS are there).
"""

from .backends import tilelang_entry_points, tilelang_target

DTYPES = ("float16", "bfloat16")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # matmul.ACTIVATIONS but None
ARCHS = (90,)  # compute capabilities the kernel is written for
AOT_TARGETS = ("cuda:90",)  # the AOT matrix's TileLang targets (aot.TILELANG_TARGETS) that build it
SWIZZLE = 8  # tile columns a panel

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, threads, persistent) by config name; "default" is what backend="tilelang" runs:
# 128 x 256 tiles in two consumer warp groups (TileLang's default policy gives each 128 x 128 of the tile: 128
# registers of accumulator a thread, m64n128k16 wgmmas), 3 stages of 48 KiB, one program a tile. The others are
# candidates for benchmarks/sweep_matmul.py. A persistent config runs PERSISTENT_PROGRAMS programs that walk the tiles
# (T.Persistent, grouped by 8 tile rows): 0.86-0.92x cuBLAS on an H200 (slower than one program a tile; with an
# epilogue 0.37x). The k128 configs halve the K steps (TileLang's automatic warp specialization waits for every step's
# wgmmas before it releases the stage, so the tensor cores idle once a step): 0.93-1.01x the default on an H100.
# Measured and dropped: each consumer group 64 whole rows (m64n256k16), 0.94-1.02x the default on an H100
# (benchmarks/results/h200/notes.md).
CONFIGS = {
    "default": (128, 256, 64, 3, 256, False),
    "m128n128s4": (128, 128, 64, 4, 256, False),
    "m256n128s3": (256, 128, 64, 3, 256, False),
    "m128n256k128s2": (128, 256, 128, 2, 256, False),
    "m128n128k128s3": (128, 128, 128, 3, 256, False),
    "persistent": (128, 256, 64, 3, 256, True),
    "persistentm256n128": (256, 128, 64, 3, 256, True),
}
PERSISTENT_PROGRAMS = 132  # the SMs of an H100 SXM / H200 (on fewer SMs still correct, the waves less even)
DEFAULT_CONFIG = "default"


def unsupported(dtype: str, k: int, n: int, arch: int | None = None) -> str | None:
    """Why the TileLang kernel cannot run these inputs (a clause naming the feature), or None. arch None: not
    checked (known only on the device)."""
    if dtype not in DTYPES:
        return f"supports {' / '.join(DTYPES)} only (float32 would run in TF32), got {dtype}"
    if k % 8 or n % 8:  # a's and b's rows (either layout) and the output's, for the TMA loads and store
        return f"needs K and N multiples of 8 (TMA's 16-byte row strides), got K = {k}, N = {n}"
    if arch is not None and arch not in ARCHS:
        return f"runs on sm_90 (Hopper: wgmma, TMA) only, got sm_{arch}"
    return None


def unsupported_inputs(kwargs) -> str | None:
    """`unsupported` for a call's arguments (backends.unsupported_inputs; b as the reference takes it, (K, N))."""
    a, b = kwargs["a"], kwargs["b"]
    return unsupported(str(a.dtype).removeprefix("torch."), b.shape[0], b.shape[1], None)


def kernel_name(b_col: bool, config: str = DEFAULT_CONFIG, has_bias: bool = False, activation: str | None = None,
                has_residual: bool = False) -> str:  # fmt: skip
    """matmul[_bcol][_bias][_<activation without underscores>][_res][_<config>]"""
    parts = (
        ["matmul"]
        + ["bcol"] * b_col
        + ["bias"] * has_bias
        + [(activation or "").replace("_", "")] * bool(activation)
        + ["res"] * has_residual
        + [config] * (config != DEFAULT_CONFIG)
    )
    return "_".join(parts)


def _parse(kernel: str) -> tuple[bool, str, bool, str | None, bool]:
    """(b_col, config, has_bias, activation, has_residual) of a kernel_name."""
    parts = kernel.removeprefix("matmul").split("_")
    activation = next((a for a in ACTIVATIONS if a.replace("_", "") in parts), None)
    config = next((p for p in parts if p in CONFIGS), DEFAULT_CONFIG)
    return "bcol" in parts, config, "bias" in parts, activation, "res" in parts


def _activation(y, activation: str | None):
    """y (a float32 TIR expression) through matmul's activation, as matmul._activation writes it."""
    import tilelang.language as T

    if activation == "silu":
        return y * T.sigmoid(y)
    if activation == "gelu":
        return 0.5 * y * (1.0 + T.erf(y * 0.7071067811865476))
    if activation == "gelu_tanh":
        return y * T.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    return y


def prim_func(kernel: str, dtype: str, _dtype: str, tilelang_target: dict):
    """The prim_func `kernel` (kernel_name) for one dtype. Parameters: A (M, K), B (K, N) or (N, K) with _bcol, BIAS
    (N,) with _bias, RES (M, N) with _res (reads); OUT (M, N) (writes)."""
    import tilelang.language as T

    b_col, config, has_bias, activation, has_residual = _parse(kernel)
    has_activation = activation is not None
    bm, bn, bk, stages, threads, persistent = CONFIGS[config]
    f32 = "float32"
    M, N, K = T.dynamic("M N K")  # noqa: N806 - sizes
    b_shape, b_tile = ((N, K), (bn, bk)) if b_col else ((K, N), (bk, bn))

    @T.macro
    def tile(A, B, BIAS, RES, OUT, bx, by, a_tile, b_tile_s, out_tile, bias_tile, acc):  # noqa: N803
        """Output tile (by, bx): the K loop, the epilogue, the store."""
        T.clear(acc)
        for k in T.Pipelined(T.ceildiv(K, bk), num_stages=stages):
            T.copy(A[by * bm, k * bk], a_tile)
            if b_col:
                T.copy(B[bx * bn, k * bk], b_tile_s)
            else:
                T.copy(B[k * bk, bx * bn], b_tile_s)
            T.gemm(a_tile, b_tile_s, acc, transpose_B=b_col)
        if has_residual:  # the residual tile into the output's buffer (zero past M and N)
            T.copy(RES[by * bm, bx * bn], out_tile)
        if has_bias:
            for j in T.Parallel(bn):
                bias_tile[j] = T.if_then_else(bx * bn + j < N, BIAS[bx * bn + j], T.cast(0, dtype))
        if has_bias and has_residual:
            for i, j in T.Parallel(bm, bn):
                acc[i, j] = _activation(acc[i, j] + T.cast(bias_tile[j], f32), activation) + T.cast(out_tile[i, j], f32)
        elif has_bias:
            for i, j in T.Parallel(bm, bn):
                acc[i, j] = _activation(acc[i, j] + T.cast(bias_tile[j], f32), activation)
        elif has_residual:
            for i, j in T.Parallel(bm, bn):
                acc[i, j] = _activation(acc[i, j], activation) + T.cast(out_tile[i, j], f32)
        elif has_activation:
            for i, j in T.Parallel(bm, bn):
                acc[i, j] = _activation(acc[i, j], activation)
        T.copy(acc, out_tile)
        T.copy(out_tile, OUT[by * bm, bx * bn])

    @T.macro
    def body(A, B, BIAS, RES, OUT):  # noqa: N803
        if persistent:
            with T.Kernel(PERSISTENT_PROGRAMS, threads=threads) as program:
                a_tile = T.alloc_shared((bm, bk), dtype)
                b_tile_s = T.alloc_shared(b_tile, dtype)
                out_tile = T.alloc_shared((bm, bn), dtype)
                bias_tile = T.alloc_shared((bn,), dtype)
                acc = T.alloc_fragment((bm, bn), f32)
                for by, bx in T.Persistent([T.ceildiv(M, bm), T.ceildiv(N, bn)], PERSISTENT_PROGRAMS, program):
                    tile(A, B, BIAS, RES, OUT, bx, by, a_tile, b_tile_s, out_tile, bias_tile, acc)
        else:
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=threads) as (bx, by):
                a_tile = T.alloc_shared((bm, bk), dtype)
                b_tile_s = T.alloc_shared(b_tile, dtype)
                out_tile = T.alloc_shared((bm, bn), dtype)
                bias_tile = T.alloc_shared((bn,), dtype)
                acc = T.alloc_fragment((bm, bn), f32)
                T.use_swizzle(SWIZZLE)
                tile(A, B, BIAS, RES, OUT, bx, by, a_tile, b_tile_s, out_tile, bias_tile, acc)

    # annotations are factories (TileLang calls them): one buffer per parameter
    def a_t():
        return T.Tensor((M, K), dtype)

    def b_t():
        return T.Tensor(b_shape, dtype)

    def bias_t():
        return T.Tensor((N,), dtype)

    def mn_t():
        return T.Tensor((M, N), dtype)

    if has_bias and has_residual:

        @T.prim_func
        def matmul(A: a_t, B: b_t, BIAS: bias_t, RES: mn_t, OUT: mn_t):  # noqa: N803
            body(A, B, BIAS, RES, OUT)

    elif has_bias:

        @T.prim_func
        def matmul(A: a_t, B: b_t, BIAS: bias_t, OUT: mn_t):  # noqa: N803
            body(A, B, BIAS, None, OUT)

    elif has_residual:

        @T.prim_func
        def matmul(A: a_t, B: b_t, RES: mn_t, OUT: mn_t):  # noqa: N803
            body(A, B, None, RES, OUT)

    else:

        @T.prim_func
        def matmul(A: a_t, B: b_t, OUT: mn_t):  # noqa: N803
            body(A, B, None, None, OUT)

    return matmul


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of every kernel in the given dtypes that it supports (the AOT matrix): the default
    config, b row- and column-major, and b column-major with the whole epilogue (bias, gelu, residual)."""
    kernels = [kernel_name(False), kernel_name(True), kernel_name(True, DEFAULT_CONFIG, True, "gelu", True)]
    return [(kernel, d, d) for d in dtypes if d in DTYPES for kernel in kernels]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func)
