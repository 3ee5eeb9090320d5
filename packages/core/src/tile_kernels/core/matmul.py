"""GEMM with a fused epilogue: matmul(a, b, bias=None, activation=None, residual=None) = act(a @ b + bias) + residual.

a (M, K) and b (K, N) in float16 / bfloat16 (or float32); bias (N,) and residual (M, N) in a's dtype. Products
accumulate in fp32, the epilogue runs on the fp32 accumulator and the result is rounded once to a's dtype.
activation: None, "silu", "gelu" (erf, torch's default) or "gelu_tanh" (tanh approximation). Not differentiable.

matmul_kernel: one (BLOCK_M, BLOCK_N) output tile a program, K streamed in BLOCK_K steps (Triton pipelines the loads
over num_stages), the tiles visited in groups of GROUP_M tile rows (a group's programs share b's column blocks in L2).
Either operand may be row-major (unit stride along its last dim) or column-major (unit stride along its first: b =
W.T of a torch Linear weight W (N, K) is read in place), the layout a constexpr (A_COL / B_COL) and the other stride,
the leading dimension, a runtime int. K and the leading dimensions pass in 16-element units where they allow
(plan.in_units): the loads vectorize and the K mask is constant over 16 elements, which Triton's pipeliner needs to
stage the loads asynchronously (cp.async), under any launcher. Out-of-range rows and columns wrap to the tile's
first ones and are never stored: only the K tail is masked. Design limits: no split of K (a decode-sized M with few
output tiles runs few programs), no persistent scheduler, no TMA descriptors. backend="tilelang": a Hopper kernel
(matmul_tilelang.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from . import backends, checks, matmul_tilelang
from .backends import Call
from .flash_attention import dot
from .host import ieee_dots
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, gemm_dims, not_arrays, register, round_to

NAME = "matmul"
DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh")
GROUP_M = 8
MIN_TILELANG_ROWS = 128  # preferred_backend: fewer rows run Triton's small-M tiles
UNIT_ARGS = ("N", "K", "lda", "ldb", "ldr", "ldo")  # and M when a is column-major (its contiguous dimension)
# backend="tilelang": matmul_tilelang's Hopper kernel (compact operands); backend=None: preferred_backend
backends.register(NAME, {"triton": None, "tilelang": f"{__package__}.matmul_tilelang"})


@triton.jit
def _activation(y, ACTIVATION: tl.constexpr):
    """y in fp32 through the activation: silu y sigmoid(y); gelu y Phi(y) = y (1 + erf(y / sqrt 2)) / 2; gelu_tanh
    y (1 + tanh(u)) / 2 = y sigmoid(2 u) with u = sqrt(2 / pi) (y + 0.044715 y^3)."""
    if ACTIVATION == "silu":
        y = y * tl.sigmoid(y)
    elif ACTIVATION == "gelu":
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    return y


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row0, col0) of program_id(0)'s output tile of a cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N) grid, the tiles visited
    GROUP_M tile rows at a time, column by column: a group's programs share b's column blocks in L2."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    return tile_m * BLOCK_M, tile_n * BLOCK_N


@triton.jit
def matmul_kernel(
    A, B, BIAS, RES, M, N, K, lda, ldb, ldr, ldo,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, A_COL: tl.constexpr,
    B_COL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    IEEE: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),). a[m, k] at A + m lda + k (A + k lda + m if A_COL), b[k, n] at
    B + k ldb + n (B + n ldb + k if B_COL), residual[m, n] at RES + m ldr + n, OUT[m, n] at OUT + m ldo + n."""
    N, K, lda, ldb, ldr, ldo = N * UNIT, K * UNIT, lda * UNIT, ldb * UNIT, ldr * UNIT, ldo * UNIT  # plan.in_units
    if A_COL:
        M = M * UNIT
    row0, col0 = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # offsets within the tile in int32 from 64-bit tile bases (int64 offset tiles cost registers the epilogue lacks);
    # rows and columns past the ends are read, never stored, so the loads need no row / column mask: along an
    # operand's unit-stride dimension they wrap to the tile's first (x % d, d a known multiple of 16: runs of 16 stay
    # contiguous and the loads vectorize), along the other they read the last one (a clamp, fewer registers)
    rm, cn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    if A_COL:
        rows_in = rm % (M - row0)
    else:
        rows_in = tl.minimum(rm, M - 1 - row0)
    if B_COL:
        cols_in = tl.minimum(cn, N - 1 - col0)
    else:
        cols_in = cn % (N - col0)
    kk = tl.arange(0, BLOCK_K)
    if A_COL:
        a_ptrs = A + row0 + rows_in[:, None] + kk[None, :] * lda
        a_step = BLOCK_K * lda
    else:
        a_ptrs = A + row0.to(tl.int64) * lda + rows_in[:, None] * lda + kk[None, :]
        a_step = BLOCK_K
    if B_COL:
        b_ptrs = B + col0.to(tl.int64) * ldb + kk[:, None] + cols_in[None, :] * ldb
        b_step = BLOCK_K
    else:
        b_ptrs = B + col0 + kk[:, None] * ldb + cols_in[None, :]
        b_step = BLOCK_K * ldb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc += dot(a, b, IEEE)
        a_ptrs += a_step
        b_ptrs += b_step
    if HAS_BIAS:
        acc += tl.load(BIAS + col0 + cols_in).to(tl.float32)[None, :]
    acc = _activation(acc, ACTIVATION)
    mask = (rm < M - row0)[:, None] & (cn < N - col0)[None, :]
    if HAS_RESIDUAL:
        res = RES + row0.to(tl.int64) * ldr + col0 + rm[:, None] * ldr + cn[None, :]
        acc += tl.load(res, mask=mask, other=0.0).to(tl.float32)
    out = OUT + row0.to(tl.int64) * ldo + col0 + rm[:, None] * ldo + cn[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def check(a, b, bias=None, activation=None, residual=None) -> None:
    dtype = checks.check_float(NAME, "a", a)
    if len(a.shape) != 2:
        raise ValueError(f"{NAME}: a must be 2-D (M, K), got shape {tuple(a.shape)}")
    checks.check_same_dtype(NAME, "b", b, dtype, "that of a")
    if len(b.shape) != 2 or b.shape[0] != a.shape[1]:
        raise ValueError(f"{NAME}: b must be 2-D (K, N) with K = {a.shape[1]} (a's columns), got shape "
                         f"{tuple(b.shape)}")  # fmt: skip
    m, n = a.shape[0], b.shape[1]
    if bias is not None:
        checks.check_same_dtype(NAME, "bias", bias, dtype, "that of a")
        checks.check_shape(NAME, "bias", bias, (n,), "(N,)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{NAME}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if residual is not None:
        checks.check_same_dtype(NAME, "residual", residual, dtype, "that of a")
        checks.check_shape(NAME, "residual", residual, (m, n), "(M, N)")


@dataclass(frozen=True)
class Blocks:
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


def blocks(m: int, n: int, k: int, dtype: str, target: Target, epilogue: bool = False) -> Blocks:
    """16-bit on warp-32 GPUs at prefill sizes: 256 x 128 x 64 tiles, 8 warps, 3 stages without an epilogue (the
    fastest of benchmarks/sweep_matmul.py on an H200); with one (bias, activation, residual) 128 x 128 x 64, 4 stages,
    the largest tile whose epilogues compile without spills on sm_80 / sm_90 / sm_100 (256 x 128 and 128 x 256 spill;
    `tile-kernels aot --op matmul --report`); 64 x 128 x 64 at M <= 64 and 16 x 64 x 64 at M <= 16 (more programs
    over the weights). float32 (IEEE products, no TF32): 32 x 32 x 32, 3 stages (2 spill on sm_80). Wavefront-64
    (AMD, 64 KiB of LDS): 128 x 128 x 64, one stage. Tiles no wider than N and K round up to."""
    if dtype == "float32":
        b = Blocks(32, 32, 32, 4, 1 if target.warp_size == 64 else 3)
    elif target.warp_size == 64:
        b = Blocks(128, 128, 64, 4, 1)
    elif m <= 16:
        b = Blocks(16, 64, 64, 4, 4)
    elif m <= 64:
        b = Blocks(64, 128, 64, 4, 4)
    elif epilogue:
        b = Blocks(128, 128, 64, 8, 4)
    else:
        b = Blocks(256, 128, 64, 8, 3)
    return Blocks(b.block_m, min(b.block_n, max(16, next_power_of_2(n))), min(b.block_k, max(16, next_power_of_2(k))),
                  b.warps, b.stages)  # fmt: skip


def forward(m: int, n: int, k: int, *, dtype: str, target: Target, activation: str | None = None,
            has_bias: bool = False, has_residual: bool = False, a_col: bool = False, b_col: bool = False,
            lda: int | None = None, ldb: int | None = None, ldr: int | None = None) -> Plan:  # fmt: skip
    """Inputs a (M, K) and b (K, N), each row-major (unit stride along its last dim) or column-major (a_col / b_col:
    unit stride along its first) at leading dimension lda / ldb (None: compact); bias (N,) compact; residual (M, N)
    row-major at row stride ldr. Output out (M, N) compact in dtype (act(bias) + residual when K = 0)."""
    inputs = {"a": dtype, "b": dtype}
    inputs |= ({"bias": dtype} if has_bias else {}) | ({"residual": dtype} if has_residual else {})
    buffers = {"out": BufferSpec((m, n), dtype, zeroed=not (m and n))}  # empty: nothing to launch
    if not (m and n):
        return Plan(inputs, buffers, (), ("out",))
    b = blocks(m, n, k, dtype, target, epilogue=has_bias or has_residual or activation is not None)
    lda = (m if a_col else k) if lda is None else lda
    ldb = (k if b_col else n) if ldb is None else ldb
    ldr = (n if ldr is None else ldr) if has_residual else 0
    ieee = ieee_dots(dtype)
    reads = ("a", "b", "bias" if has_bias else None, "residual" if has_residual else None, m, n, k, lda, ldb, ldr, n)
    constexprs = dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, GROUP_M=GROUP_M, A_COL=a_col,
                      B_COL=b_col, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, ACTIVATION=activation,
                      IEEE=ieee)  # fmt: skip
    grid = (cdiv(m, b.block_m) * cdiv(n, b.block_n),)
    launch = Launch(matmul_kernel, grid, reads, ("out",), constexprs, b.warps, b.stages)
    launch = in_units(launch, *UNIT_ARGS, *(("M",) if a_col else ()), units=(16, 8))
    return Plan(inputs, buffers, (launch,), ("out",))


def check_backend(backend: str, dtype: str, k: int, n: int, arch: int | None = None):
    """Raises ValueError naming the input a resolved backend cannot run (matmul_tilelang.unsupported)."""
    if backend == "tilelang" and (why := matmul_tilelang.unsupported(dtype, k, n, arch)):
        raise ValueError(f"{NAME}: backend {backend!r} {why}; backend='triton' runs it")


def preferred_backend(arch: int, dtype: str, m: int, k: int, n: int) -> str:
    """backend=None's choice on compute capability `arch` (0: not a CUDA device): the fastest measured. "tilelang" on
    sm_90 for the inputs it runs with M >= MIN_TILELANG_ROWS (H200, 2026-12-04, bf16, b = W.t(), device time against
    cuBLAS: 8192^3 0.99-1.00x, 4096 x 4096 x 14336 0.93-0.94x, 4096 x 14336 x 4096 0.96x, Triton's best tiles 0.86 /
    0.80 / 0.79x; with bias, GELU and a residual at 4096 x 4096 x 14336 against cuBLAS + torch's epilogue 0.86x,
    Triton's default tiles 0.77x; benchmarks/results/h200/notes.md); "triton" for float32, unaligned K or N, fewer
    rows (its small-M tiles; one 128-row TileLang tile would be mostly empty) and other architectures."""
    tilelang = arch in matmul_tilelang.ARCHS and m >= MIN_TILELANG_ROWS
    return "tilelang" if tilelang and not matmul_tilelang.unsupported(dtype, k, n, arch) else "triton"


def compiled_forward(backend: str, m: int, n: int, k: int, *, dtype: str, b_col: bool, arch: int, target: Target,
                     activation: str | None = None, has_bias: bool = False, has_residual: bool = False,
                     tile_config: str | None = None) -> Plan:  # fmt: skip
    """The TileLang backend's forward for compute capability `arch` (90): a (M, K) and b ((K, N), or (N, K) read as
    its transpose with b_col), bias (N,) and residual (M, N) compact; out (M, N) compact in dtype. One Call; an empty
    output or K = 0 runs `forward`'s plan (a TMA descriptor cannot describe an empty operand). `tile_config`: one of
    matmul_tilelang.CONFIGS (None: its default; benchmarks/sweep_matmul.py tries the others)."""
    check_backend(backend, dtype, k, n, arch)
    epilogue = dict(activation=activation, has_bias=has_bias, has_residual=has_residual)
    if not (m and n and k):
        return forward(m, n, k, dtype=dtype, target=target, b_col=b_col, **epilogue)
    module = backends.module(NAME, backend)
    kernel = module.kernel_name(b_col, tile_config or module.DEFAULT_CONFIG, has_bias, activation, has_residual)
    load = functools.partial(module.function, kernel, dtype, dtype, arch)
    reads = ("a", "b") + ("bias",) * has_bias + ("residual",) * has_residual
    steps = (Call(f"tile_kernels_{backend}_{kernel}_{dtype}_sm{arch}", load, reads, ("out",)),)
    return Plan(dict.fromkeys(reads, dtype), {"out": BufferSpec((m, n), dtype)}, steps, ("out",))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def _activation_ref(y: np.ndarray, activation: str | None) -> np.ndarray:
    if activation == "silu":
        return y / (1.0 + np.exp(-y))
    if activation == "gelu":
        return 0.5 * y * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(y / math.sqrt(2.0)))
    if activation == "gelu_tanh":
        return 0.5 * y * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3)))
    return y


def reference(a, b, bias=None, activation=None, residual=None):
    y = a.astype(np.float64) @ b.astype(np.float64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    y = _activation_ref(y, activation)
    return (y if residual is None else y + residual.astype(np.float64),)


def reference_vjp(kwargs, cotangents):
    return {}


def cost(kwargs) -> tuple[Cost, Cost]:
    """bytes: a, b, bias, residual, the output; flops 2 M N K."""
    a, b = kwargs["a"], kwargs["b"]
    (m, k), n, item = a.shape, b.shape[1], ITEMSIZE[str(a.dtype)]
    extra = sum(kwargs[x].size for x in ("bias", "residual") if kwargs.get(x) is not None)
    return Cost((a.size + b.size + extra + m * n) * item, 2 * m * n * k), Cost(0, 0)


def sample(rng: np.random.Generator, shape, dtype: str, bias=False, activation=None, residual=False) -> dict:
    """(M, K, N) as registry.gemm_dims gives them, K in 0 .. 300 where it gives none (a multiple of 8 in half the
    draws, as model widths are: what TMA's 16-byte strides need). Normal a, b scaled by 1 / sqrt(K) (outputs of
    order 1)."""
    m, k, n = gemm_dims(shape)
    if k is None:
        k = int(rng.choice([0, 1, int(rng.integers(2, 300)), 8 * int(rng.integers(1, 38))], p=[0.05, 0.05, 0.45, 0.45]))
    return {
        "a": round_to(rng.standard_normal((m, k)), dtype),
        "b": round_to(rng.standard_normal((k, n)) / math.sqrt(max(k, 1)), dtype),
        "bias": round_to(rng.standard_normal(n), dtype) if bias else None,
        "activation": activation,
        "residual": round_to(rng.standard_normal((m, n)), dtype) if residual else None,
    }


def bad_inputs(kwargs) -> list[BadInput]:
    a, b = kwargs["a"], kwargs["b"]
    other = np.float16 if a.dtype != np.float16 else np.float32
    return [
        BadInput({"a": a[None]}, ValueError, f"{NAME}: a must be 2-D"),
        BadInput({"a": a.astype(np.int32)}, TypeError, f"{NAME}: a must have dtype"),
        BadInput({"b": b.astype(other)}, TypeError, f"{NAME}: b must have dtype"),
        BadInput({"b": np.zeros((a.shape[1] + 1, b.shape[1]), a.dtype)}, ValueError, f"{NAME}: b must be 2-D"),
        BadInput({"bias": np.zeros(b.shape[1] + 1, a.dtype)}, ValueError, f"{NAME}: bias must have shape"),
        BadInput({"bias": np.zeros(b.shape[1], other)}, TypeError, f"{NAME}: bias must have dtype"),
        BadInput(
            {"residual": np.zeros((a.shape[0] + 1, b.shape[1]), a.dtype)},
            ValueError,
            f"{NAME}: residual must have shape",
        ),  # fmt: skip
        BadInput({"activation": "relu"}, ValueError, f"{NAME}: activation must be one of"),
        *not_arrays(NAME, "a", "b"),
    ]


def plans(target: Target):
    """Each dtype at decode (M 1, 16), mid (64) and prefill (4096) sizes, every operand layout at the prefill size,
    and every epilogue (bias, activation, residual) at one size."""
    for dtype in DTYPES:
        for m in (1, 16, 64, 4096):
            yield forward(m, 4096, 4096, dtype=dtype, target=target, b_col=True)
        for a_col in (False, True):
            yield forward(4096, 4096, 4096, dtype=dtype, target=target, a_col=a_col)
        for activation in ACTIVATIONS[1:]:
            yield forward(4096, 4096, 4096, dtype=dtype, target=target, activation=activation, has_bias=True,
                          has_residual=True, b_col=True)  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"bias": (False, True), "activation": ACTIVATIONS, "residual": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
