"""MoE expert GEMM: grouped_matmul(x, weights, group_sizes), out[rows of group e] = x[rows of group e] @ weights[e].

x (T, K) holds the tokens sorted by expert: group e is rows start_e .. start_e + group_sizes[e] - 1, start_e the sum
of the sizes before it; weights (E, K, N) in x's dtype; group_sizes (E,) int32 (empty groups allowed). Returns (T, N)
in x's dtype, fp32 accumulation. Rows past the groups' sum are 0 (as jax.lax.ragged_dot); groups past T are cut at
T. The sizes live on the device: their sum is not checked against T (a host sync), those two rules define the rest.
Differentiable in x and weights:
    dx[rows of e] = dy[rows of e] @ weights[e].T        dweights[e] = x[rows of e].T @ dy[rows of e]

Kernels (Triton; compact row-major operands):
  * grouped_rows_kernel, out = a @ b_e over each group's rows (the forward, and dx with b_e = weights[e].T read
    column-major in place): grid (cdiv(T, BLOCK_M) + E, cdiv(N, BLOCK_N)), which covers every group's row tiles
    whatever the sizes (a group adds at most one partial tile); each program finds its group and tile by a scan of
    the E sizes, programs past the last tile run no loop.
  * grouped_weight_grad_kernel, dweights[e] = x[rows of e].T @ dy[rows of e]: grid (tiles of (K, N), E), each program
    streams its group's rows (an empty group writes zeros).
Design limits: no persistent scheduler or TMA. backend="tilelang" runs the forward and dx on grouped_matmul_tilelang's
Hopper row kernel (TMA, wgmma, a producer warp group; dx with weights[e] read transposed in place), dW on
grouped_weight_grad_kernel (compiled_forward, compiled_backward); backend=None picks each pass's (preferred_backend).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from . import backends, checks, grouped_matmul_tilelang
from .backends import Call
from .flash_attention import dot
from .host import ieee_dots
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "grouped_matmul"
# backend="tilelang": grouped_matmul_tilelang's forward; backend=None: preferred_backend
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.grouped_matmul_tilelang"})
DTYPES = ("float32", "float16", "bfloat16")


@triton.jit
def panel_tile(order, tiles_m, tiles_n, PANEL: tl.constexpr):  # noqa: N803
    """(row tile, column tile) of the program `order`-th in launch order over tiles_m x tiles_n tiles visited in
    panels of PANEL row tiles across every column tile (a wave then reads its row tiles' operands from L2)."""
    first = order // (PANEL * tiles_n) * PANEL
    width = tl.minimum(tiles_m - first, PANEL)  # the last panel's may be narrower
    return first + order % (PANEL * tiles_n) % width, order % (PANEL * tiles_n) // width


@triton.jit
def grouped_rows_kernel(
    A, B, SIZES, E, T, N, R, lda, ldb, stride_be, ldo,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, B_COL: tl.constexpr, IEEE: tl.constexpr,
    PANEL: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """OUT[t, n] = sum_r A[t, r] b_e[r, n] for the rows t of group e; A (T, R) at row stride lda; b_e[r, n] at
    B + e stride_be + r ldb + n (B + e stride_be + n ldb + r if B_COL); OUT (T, N) at row stride ldo. Grid (row
    tiles, column tiles); PANEL > 0: programs in launch order visit panels of PANEL row tiles across every column tile
    (a wave reads its a tiles from L2), else row tiles first."""
    N, R, lda, ldb, ldo = N * UNIT, R * UNIT, lda * UNIT, ldb * UNIT, ldo * UNIT  # plan.in_units
    stride_be = stride_be * UNIT
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    if PANEL:
        tiles_m, tiles_n = tl.num_programs(0), tl.num_programs(1)
        pid, pid_n = panel_tile(pid + pid_n * tiles_m, tiles_m, tiles_n, PANEL)  # from the hardware's launch order
    group, row0, end = pid * 0 - 1, pid * 0, pid * 0
    start, tiles_before = pid * 0, pid * 0
    for e in range(E):  # this program's group: the one whose row tiles hold tile `pid`
        size = tl.load(SIZES + e)
        tiles = tl.cdiv(size, BLOCK_M)
        hit = (pid >= tiles_before) & (pid < tiles_before + tiles)
        group = tl.where(hit, e, group)
        row0 = tl.where(hit, start + (pid - tiles_before) * BLOCK_M, row0)
        end = tl.where(hit, start + size, end)
        start += size
        tiles_before += tiles
    end = tl.minimum(end, T)
    col0 = pid_n * BLOCK_N
    rm, cn, rr = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_R)
    row_ok, col_ok = rm < end - row0, cn < N - col0
    # int32 offsets within the tile from 64-bit tile bases: int64 offset tiles cost registers
    a_ptrs = A + row0.to(tl.int64) * lda + rm[:, None] * lda + rr[None, :]
    b_base = B + tl.maximum(group, 0).to(tl.int64) * stride_be
    if B_COL:
        b_ptrs = b_base + col0.to(tl.int64) * ldb + rr[:, None] + cn[None, :] * ldb
        b_step = BLOCK_R
    else:
        b_ptrs = b_base + col0 + rr[:, None] * ldb + cn[None, :]
        b_step = BLOCK_R * ldb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, tl.where(group >= 0, R, 0), BLOCK_R):
        r_ok = rr < R - r0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        acc += dot(a, b, IEEE)
        a_ptrs += BLOCK_R
        b_ptrs += b_step
    out = OUT + row0.to(tl.int64) * ldo + col0 + rm[:, None] * ldo + cn[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def grouped_weight_grad_kernel(
    X, DY, SIZES, T, K, N, ldx, ldy,
    DW,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, PANEL: tl.constexpr,
    UNIT: tl.constexpr,
):  # fmt: skip
    """DW[e, k, n] = sum over the rows t of group e of X[t, k] DY[t, n]; grid (cdiv(K, BLOCK_K) cdiv(N, BLOCK_N), E);
    DW (E, K, N) compact. PANEL > 0: an expert's programs in launch order visit panels of PANEL K tiles across every N
    tile (a wave reads the group's rows of x and dy from L2), else the K tiles one after another across the N tiles."""
    K, N, ldx, ldy = K * UNIT, N * UNIT, ldx * UNIT, ldy * UNIT  # plan.in_units
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if PANEL:
        pid_k, pid_n = panel_tile(tl.program_id(0), tl.cdiv(K, BLOCK_K), tiles_n, PANEL)
    else:
        pid_k, pid_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok, n_ok = ks < K, ns < N
    start = e * 0
    for i in range(e):
        start += tl.load(SIZES + i)
    end = tl.minimum(start + tl.load(SIZES + e), T)
    start = tl.minimum(start, T)
    tt = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t_ok = tt < end - t0
        t0_64 = tl.cast(t0, tl.int64)  # the interpreter passes a Python int
        x_tile, dy_tile = X + t0_64 * ldx, DY + t0_64 * ldy  # int32 offsets within the tile
        xt = tl.load(x_tile + tt[None, :] * ldx + ks[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)  # (K, T)
        dy = tl.load(dy_tile + tt[:, None] * ldy + ns[None, :], mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        acc += dot(xt, dy, IEEE)
    out = DW + e.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def check(x, weights, group_sizes) -> None:
    dtype = checks.check_float(NAME, "x", x)
    if len(x.shape) != 2:
        raise ValueError(f"{NAME}: x must be 2-D (T, K), got shape {tuple(x.shape)}")
    checks.check_same_dtype(NAME, "weights", weights, dtype, "that of x")
    if len(weights.shape) != 3 or weights.shape[1] != x.shape[1]:
        raise ValueError(f"{NAME}: weights must be 3-D (E, K, N) with K = {x.shape[1]} (x's columns), got shape "
                         f"{tuple(weights.shape)}")  # fmt: skip
    checks.check_same_dtype(NAME, "group_sizes", group_sizes, "int32", "the rows of each group")
    checks.check_shape(NAME, "group_sizes", group_sizes, (weights.shape[0],), "(E,), one size per expert")


@dataclass(frozen=True)
class Blocks:
    block_m: int  # rows (grouped_rows_kernel) or the K tile (grouped_weight_grad_kernel)
    block_n: int
    block_r: int  # the reduced dim's step
    warps: int
    stages: int
    panel: int = 0  # the kernels' PANEL (0: launch order)


def blocks(rows: int, n: int, r: int, dtype: str, target: Target) -> Blocks:
    """16-bit: 128 x 256 tiles stepping 64 deep, 8 warps, 3 stages, panels of 8 row tiles from 4096 rows on sm_90+
    (the fastest of benchmarks/sweep_grouped_matmul.py on an H200 at Mixtral's shapes; it spills on sm_80), else
    64 x 128 (MoE groups are often a few hundred rows: 64-row tiles waste less of a group's last tile; 4 warps spill in
    dx's transposed read); float32 (IEEE products): 32 x 32 x 32; one stage on wavefront-64 (AMD) targets. Tiles no
    wider than the dims round up to."""
    stages = 1 if target.warp_size == 64 else 3
    if dtype == "float32":
        b = Blocks(32, 32, 32, 4, min(stages, 2))
    elif rows >= 4096 and target.cuda_arch >= 90:
        b = Blocks(128, 256, 64, 8, stages, 8)
    else:
        b = Blocks(64, 128, 64, 8, stages)

    def fit(block: int, dim: int) -> int:
        return min(block, max(16, next_power_of_2(dim)))

    return Blocks(fit(b.block_m, rows), fit(b.block_n, n), fit(b.block_r, r), b.warps, b.stages, b.panel)


def _rows_launch(a: str, b: str, out: str, t: int, e: int, n: int, r: int, b_col: bool, stride_be: int, dtype: str,
                 target: Target) -> Launch:  # fmt: skip
    """out (T, N) = a (T, R) @ b_e per group, b_e (R, N) row-major or (N, R) row-major read as its transpose."""
    bl = blocks(t, n, r, dtype, target)
    ieee = ieee_dots(dtype)
    grid = (cdiv(t, bl.block_m) + e, cdiv(n, bl.block_n))
    reads = (a, b, "group_sizes", e, t, n, r, r, r if b_col else n, stride_be, n)
    constexprs = dict(BLOCK_M=bl.block_m, BLOCK_N=bl.block_n, BLOCK_R=bl.block_r, B_COL=b_col, IEEE=ieee,
                      PANEL=bl.panel)  # fmt: skip
    launch = Launch(grouped_rows_kernel, grid, reads, (out,), constexprs, bl.warps, bl.stages)
    # N and stride_be too: the column mask and each expert's base known multiples of 16 (else b loads element-wise)
    return in_units(launch, "N", "R", "lda", "ldb", "stride_be", "ldo", units=(16, 8))


def forward(t: int, k: int, n: int, e: int, *, dtype: str, target: Target) -> Plan:
    """Inputs x (T, K), weights (E, K, N), group_sizes (E,) int32, compact. Output out (T, N) compact in dtype, zeroed
    first (rows past the groups' sum)."""
    inputs = {"x": dtype, "weights": dtype, "group_sizes": "int32"}
    buffers = {"out": BufferSpec((t, n), dtype, zeroed=True)}
    if not (t and n and e):
        return Plan(inputs, buffers, (), ("out",))
    launch = _rows_launch("x", "weights", "out", t, e, n, k, False, k * n, dtype, target)
    return Plan(inputs, buffers, (launch,), ("out",))


MIN_TILELANG_ROWS = 4096  # preferred_backend: fewer tokens run Triton's 64-row tiles (less of a group's tile wasted)


def preferred_backend(arch: int, dtype: str, t: int, k: int, n: int, backward: bool = False) -> str:
    """backend=None's choice on compute capability `arch` (0: not a CUDA device) for the forward, or (`backward`) for
    the backward's dx (dW runs on Triton's kernel either way): "tilelang" on sm_90 for the inputs it runs with T >=
    MIN_TILELANG_ROWS; else "triton". Forward, bf16, E8, device time: up projection (T16384 K 4096, N 14336), H200,
    2026-12-04: 521 TFLOP/s against Triton's 482-494; down projection (T16384 K 14336, N 4096), 2026-12-07: H200 2772 us
    against Triton's 2985 (torch._grouped_mm's 2739), H100 2789-2977 against 3020-3068. dx: H100, E8: T8192 up
    projection 1289-1291 us against Triton's 1736-1741 (torch._grouped_mm's 1305), T16384 down projection 2687-2745
    against 4030-4390 (torch's 2816) (benchmarks/results/h200/notes.md)."""
    k, n = (n, k) if backward else (k, n)  # dx reduces N into K columns
    tilelang = arch in grouped_matmul_tilelang.ARCHS and t >= MIN_TILELANG_ROWS
    return "tilelang" if tilelang and not grouped_matmul_tilelang.unsupported(dtype, k, n, arch) else "triton"


def check_backend(backend: str, dtype: str, k: int, n: int, arch: int | None = None) -> None:
    """Raises ValueError naming the input a resolved backend cannot run (grouped_matmul_tilelang.unsupported)."""
    if backend == "tilelang" and (why := grouped_matmul_tilelang.unsupported(dtype, k, n, arch)):
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")


def compiled_forward(backend: str, t: int, k: int, n: int, e: int, *, dtype: str, arch: int, target: Target,
                     tile_config: str | None = None) -> Plan:  # fmt: skip
    """`forward` on the TileLang backend for compute capability `arch` (90): the same inputs and zeroed output, one
    Call (an empty product: `forward`'s plan). `tile_config`: one of grouped_matmul_tilelang.CONFIGS (None: its
    default)."""
    check_backend(backend, dtype, k, n, arch)
    if not (t and n and e and k):
        return forward(t, k, n, e, dtype=dtype, target=target)
    module = backends.module(NAME, backend)
    kernel = module.kernel_name(False, tile_config or module.DEFAULT_CONFIG)
    load = functools.partial(module.function, kernel, dtype, dtype, arch)
    inputs = {"x": dtype, "weights": dtype, "group_sizes": "int32"}
    steps = (Call(f"tile_kernels_{backend}_{kernel}_{dtype}_sm{arch}", load, (*inputs, "out"), ("out",)),)
    return Plan(inputs, {"out": BufferSpec((t, n), dtype, zeroed=True)}, steps, ("out",))


def _backward_plan(dx_step, t: int, k: int, n: int, e: int, dtype: str, target: Target) -> Plan:
    """Inputs dy (T, N), x (T, K), weights (E, K, N), group_sizes (E,), compact. Outputs dx (T, K) (zeroed first) and
    dweights (E, K, N): dx by the step `dx_step()` returns (called for a non-empty product only), dW by
    grouped_weight_grad_kernel."""
    inputs = {"dy": dtype, "x": dtype, "weights": dtype, "group_sizes": "int32"}
    buffers = {"dx": BufferSpec((t, k), dtype, zeroed=True),
               "dweights": BufferSpec((e, k, n), dtype, zeroed=not (k and n and e))}  # fmt: skip
    launches = (dx_step(),) if t and k and e else ()
    if k and n and e:
        bl = blocks(k, n, t, dtype, target)
        ieee = ieee_dots(dtype)
        grid = (cdiv(k, bl.block_m) * cdiv(n, bl.block_n), e)
        constexprs = dict(BLOCK_K=bl.block_m, BLOCK_N=bl.block_n, BLOCK_T=bl.block_r, IEEE=ieee, PANEL=bl.panel)
        reads = ("x", "dy", "group_sizes", t, k, n, k, n)
        launch = Launch(grouped_weight_grad_kernel, grid, reads, ("dweights",), constexprs, bl.warps, bl.stages)
        launches += (in_units(launch, "K", "N", "ldx", "ldy", units=(16, 8)),)
    return Plan(inputs, buffers, launches, ("dx", "dweights"))


def backward(t: int, k: int, n: int, e: int, *, dtype: str, target: Target) -> Plan:
    """The backward on the Triton kernels (_backward_plan's inputs and outputs)."""
    return _backward_plan(lambda: _rows_launch("dy", "weights", "dx", t, e, k, n, True, k * n, dtype, target),
                          t, k, n, e, dtype, target)  # fmt: skip


def compiled_backward(backend: str, t: int, k: int, n: int, e: int, *, dtype: str, arch: int, target: Target,
                      tile_config: str | None = None) -> Plan:  # fmt: skip
    """`backward` with dx = dy @ weights[e].T on the TileLang row kernel (weights read transposed in place, a Call
    that reads and writes the zeroed dx) for compute capability `arch`; dW on grouped_weight_grad_kernel.
    `tile_config`: one of grouped_matmul_tilelang.CONFIGS (None: its default)."""
    check_backend(backend, dtype, n, k, arch)  # dx reduces N into K columns
    if not n:
        return backward(t, k, n, e, dtype=dtype, target=target)
    module = backends.module(NAME, backend)
    kernel = module.kernel_name(True, tile_config or module.DEFAULT_CONFIG)
    load = functools.partial(module.function, kernel, dtype, dtype, arch)
    reads = ("dy", "weights", "group_sizes", "dx")
    call = Call(f"tile_kernels_{backend}_{kernel}_{dtype}_sm{arch}", load, reads, ("dx",))
    return _backward_plan(lambda: call, t, k, n, e, dtype, target)


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def _groups(group_sizes, t: int):
    """(e, row slice) per group, cut at T."""
    start = 0
    for e, size in enumerate(np.asarray(group_sizes).tolist()):
        yield e, slice(min(start, t), min(start + size, t))
        start += size


def reference(x, weights, group_sizes):
    x64, w64 = x.astype(np.float64), weights.astype(np.float64)
    out = np.zeros((x.shape[0], weights.shape[2]))
    for e, rows in _groups(group_sizes, x.shape[0]):
        out[rows] = x64[rows] @ w64[e]
    return (out,)


def reference_vjp(kwargs, cotangents):
    x, w = kwargs["x"].astype(np.float64), kwargs["weights"].astype(np.float64)
    dy = np.asarray(cotangents[0], np.float64)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for e, rows in _groups(kwargs["group_sizes"], x.shape[0]):
        dx[rows] = dy[rows] @ w[e].T
        dw[e] = x[rows].T @ dy[rows]
    return {"x": dx, "weights": dw}


def cost(kwargs) -> tuple[Cost, Cost]:
    """flops 2 T K N forward, twice that backward; bytes: the operands and results each once."""
    x, w = kwargs["x"], kwargs["weights"]
    (t, k), n, item = x.shape, w.shape[2], ITEMSIZE[str(x.dtype)]
    fwd = Cost((x.size + w.size + t * n) * item, 2 * t * k * n)
    return fwd, Cost((2 * x.size + 2 * w.size + t * n) * item, 4 * t * k * n)


def sample(rng: np.random.Generator, shape, dtype: str, experts=None) -> dict:
    """A benchmark's (E, T, K, N) as it is (K >= 256; T tokens spread evenly over E experts); else T = the product
    of the leading dims (1 without), N = the last dim (up to 256; wider ones folded to 128 .. 256), K in 1 .. 150;
    half the time K and N multiples of 8 (K up to 144, N rounded down); E in 1 .. 6 (`experts` fixes it) with random
    sizes summing to T (empty groups likely)."""
    shape = tuple(shape)
    if len(shape) == 4 and shape[2] >= 256:
        e, t, k, n = shape
        sizes = np.full(e, t // e) + (np.arange(e) < t % e)
    else:
        t, n = int(np.prod(shape[:-1])), shape[-1]
        n = n if n <= 256 else 128 + n % 129
        if rng.random() < 0.5:  # K and N multiples of 8 half the time: the widths TMA (the TileLang kernel) needs
            k, n = 8 * int(rng.integers(1, 19)), 8 * max(1, n // 8)
        else:
            k = int(rng.integers(1, 151))
        e = experts or int(rng.integers(1, 7))
        sizes = rng.multinomial(t, rng.dirichlet(np.ones(e)))
    return {
        "x": round_to(rng.standard_normal((t, k)), dtype),
        "weights": round_to(rng.standard_normal((e, k, n)) / np.sqrt(k), dtype),
        "group_sizes": sizes.astype(np.int32),
    }


def bad_inputs(kwargs) -> list[BadInput]:
    x, w, sizes = kwargs["x"], kwargs["weights"], kwargs["group_sizes"]
    other = np.float16 if x.dtype != np.float16 else np.float32
    return [
        BadInput({"x": x[None]}, ValueError, f"{NAME}: x must be 2-D"),
        BadInput({"x": x.astype(np.int32)}, TypeError, f"{NAME}: x must have dtype"),
        BadInput({"weights": w[0]}, ValueError, f"{NAME}: weights must be 3-D"),
        BadInput({"weights": w.astype(other)}, TypeError, f"{NAME}: weights must have dtype"),
        BadInput(
            {"weights": np.zeros((w.shape[0], w.shape[1] + 1, w.shape[2]), x.dtype)},
            ValueError,
            f"{NAME}: weights must be 3-D",
        ),  # fmt: skip
        BadInput({"group_sizes": sizes.astype(np.float32)}, TypeError, f"{NAME}: group_sizes must have dtype int32"),
        BadInput(
            {"group_sizes": np.append(sizes, 0).astype(np.int32)}, ValueError, f"{NAME}: group_sizes must have shape"
        ),  # fmt: skip
        *not_arrays(NAME, "x", "weights", "group_sizes"),
    ]


def plans(target: Target):
    """Each dtype at Mixtral's expert shape (8 experts, 8192 tokens, K 4096, N 14336): the forward and the backward
    (dx's transposed read, the weight gradient)."""
    for dtype in DTYPES:
        yield forward(8192, 4096, 14336, 8, dtype=dtype, target=target)
        yield backward(8192, 4096, 14336, 8, dtype=dtype, target=target)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("x", "weights"),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
