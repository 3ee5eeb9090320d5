"""grouped_matmul's TileLang row kernel for Hopper (backend="tilelang"): out[rows of e] = a[rows of e] @ b_e, the
forward (b_e = weights[e]) and dx (b_e = weights[e].T, read column-major in place) of grouped_matmul.py.

Grid (cdiv(T, BLOCK_M) + E row tiles, cdiv(N, BLOCK_N)), as the Triton row kernel's: a group adds at most one
partial tile, so the grid covers every group's row tiles whatever the sizes. Each program finds its group and first
row by a scan of the E sizes (int32, on the device: no host sync); programs past the last tile do nothing. K streams
through a T.Pipelined loop of `stages` shared buffers: the a tile (rows from the group's start, any row) and b_e's
tile arrive by TMA (b a 3-D tensor map over (E, K, N)) from a producer warp group, wgmma on the consumers. Rows past
the group's end (the next group's) are multiplied but not stored: the tile goes through shared memory and leaves by
one TMA store when it lies inside its group, else (a group's last, part-filled tile) row-guarded by the consumers (a
TMA store would overwrite the next group).

Design limits: sm_90a only; float16 / bfloat16; compact operands; N and K multiples of 8 (TMA's 16-byte strides); a
group of fewer than BLOCK_M rows still costs a whole tile; not persistent. The weight gradient stays on the Triton
kernel. backend=None runs the forward and dx on sm_90 from 4096 tokens (grouped_matmul.preferred_backend: the ratios
are there).
"""

from .backends import tilelang_entry_points, tilelang_target

# the dense kernel's limits (float16 / bfloat16 wgmma on sm_90, TMA rows of whole 16 bytes): `unsupported(dtype, k, n,
# arch)` with k, n the reduced and the output width of the product (K, N forward; N, K for dx)
from .matmul_tilelang import ARCHS, DTYPES, unsupported  # noqa: F401 - ARCHS: this module's too (preferred_backend)

AOT_TARGETS = ("cuda:90",)  # the AOT matrix's TileLang targets (aot.TILELANG_TARGETS) that build it

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, threads, panel) by config name; "default" is what backend="tilelang" runs: a 128 x
# 256 tile in two consumer warp groups, BLOCK_K 128 in 2 stages (half the K steps of "k64", and so half the pipeline
# drains; its step was the faster in all three runs, H100 and H200, 2026-12-07), panels of 8. panel > 0: the programs
# visit panels of `panel` row tiles across every column tile (T.use_swizzle, column order), so that a wave reads each a
# tile from L2 instead of once per column tile (E8 T16384 K4096 N14336 in launch order: a is read 56 times, 7.5 GB;
# H200, benchmarks/sweep_grouped_matmul.py: forward 585 TFLOP/s with panels of 8, 513 in launch order)
CONFIGS = {
    "default": (128, 256, 128, 2, 256, 8),
    "k64": (128, 256, 64, 3, 256, 8),  # matmul_tilelang's default tile
    "m128n128s4": (128, 128, 64, 4, 256, 0),
    "unpaneled": (128, 256, 64, 3, 256, 0),
}
DEFAULT_CONFIG = "default"


def unsupported_inputs(kwargs) -> str | None:
    """`unsupported` for a call's arguments (backends.unsupported_inputs)."""
    x, weights = kwargs["x"], kwargs["weights"]
    return unsupported(str(x.dtype).removeprefix("torch."), weights.shape[1], weights.shape[2], None)


def kernel_name(b_col: bool, config: str = DEFAULT_CONFIG) -> str:
    """grouped_rows[_bcol][_<config>]"""
    return "_".join(["grouped_rows"] + ["bcol"] * b_col + [config] * (config != DEFAULT_CONFIG))


def _parse(kernel: str) -> tuple[bool, str]:
    parts = kernel.removeprefix("grouped_rows").split("_")
    return "bcol" in parts, next((p for p in parts if p in CONFIGS), DEFAULT_CONFIG)


def prim_func(kernel: str, dtype: str, _dtype: str, tilelang_target: dict):
    """The prim_func `kernel` (kernel_name) for one dtype. Parameters: A (T, R), B (E, R, N) or (E, N, R) with _bcol,
    SIZES (E,) int32, OUT_IN (reads); OUT (T, N) (writes; rows outside every group are left as they are). OUT_IN and
    OUT are one buffer, zeroed by the caller: listed as read, JAX keeps its zeros (an aliased FFI operand)."""
    import tilelang.language as T

    b_col, config = _parse(kernel)
    bm, bn, bk, stages, threads, panel = CONFIGS[config]
    TOK, R, N, E = T.dynamic("TOK R N E")  # noqa: N806 - sizes
    b_shape = (E, N, R) if b_col else (E, R, N)

    @T.prim_func
    def grouped_rows(
        A: T.Tensor((TOK, R), dtype),  # noqa: N803
        B: T.Tensor(b_shape, dtype),  # noqa: N803
        SIZES: T.Tensor((E,), "int32"),  # noqa: N803
        OUT_IN: T.Tensor((TOK, N), dtype),  # noqa: N803 - OUT itself (zeroed by the caller): the Call reads it too
        OUT: T.Tensor((TOK, N), dtype),  # noqa: N803
    ):
        with T.Kernel(T.ceildiv(TOK, bm) + E, T.ceildiv(N, bn), threads=threads) as (tile, bx):
            a_tile = T.alloc_shared((bm, bk), dtype)
            b_tile = T.alloc_shared((bn, bk) if b_col else (bk, bn), dtype)
            out_tile = T.alloc_shared((bm, bn), dtype)
            acc = T.alloc_fragment((bm, bn), "float32")
            T.use_swizzle(panel, order="column", enable=panel > 0)
            group = T.alloc_var("int32", init=-1)
            row0 = T.alloc_var("int32", init=0)
            end = T.alloc_var("int32", init=0)
            start = T.alloc_var("int32", init=0)
            before = T.alloc_var("int32", init=0)  # row tiles of the groups before e
            for e in T.serial(E):  # this program's group: the one whose row tiles hold tile `tile`
                size = SIZES[e]
                if tile >= before and tile < before + T.ceildiv(size, bm):
                    group = e
                    row0 = start + (tile - before) * bm
                    end = T.min(start + size, TOK)
                start = start + size
                before = before + T.ceildiv(size, bm)
            T.clear(acc)
            # a program past the last tile (group -1) runs no K step and stores nothing (end = 0); the guard is the
            # loop's extent, not an `if` around the loop, which TileLang 0.1.15's warp specialization would test
            # before the scan
            for k in T.Pipelined(T.if_then_else(group >= 0, T.ceildiv(R, bk), 0), num_stages=stages):
                T.copy(A[row0, k * bk], a_tile)
                if b_col:
                    T.copy(B[group, bx * bn, k * bk], b_tile)
                else:
                    T.copy(B[group, k * bk, bx * bn], b_tile)
                T.gemm(a_tile, b_tile, acc, transpose_B=b_col)
            T.copy(acc, out_tile)
            if row0 + bm <= end:  # a tile inside its group: one TMA store (columns past N clipped by TMA)
                T.copy(out_tile, OUT[row0, bx * bn])
            else:  # the group's last, part-filled tile: its rows only (the next group's rows follow)
                for i, j in T.Parallel(bm, bn):
                    if row0 + i < end and bx * bn + j < N:
                        OUT[row0 + i, bx * bn + j] = out_tile[i, j]

    return grouped_rows


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of the default config, b row- and column-major, in each supported dtype given (the AOT
    matrix)."""
    return [(kernel_name(b_col), d, d) for d in dtypes if d in DTYPES for b_col in (False, True)]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func)
