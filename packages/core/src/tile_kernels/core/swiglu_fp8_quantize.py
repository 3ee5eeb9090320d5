"""SwiGLU whose output is cast to FP8 where it is born: swiglu_fp8_quantize(gate, up) = (codes, scales) =
fp8_quantize(swiglu(gate, up)) in one pass over memory, the input of the MLP's down projection as an fp8_matmul
(DeepSeek-V3's per-token 1 x 128 blocks: a_scales).

    y = silu(gate) up rounded to gate's dtype (swiglu's output)    scales[r, j] = max |y[r, block j]| / 448
    codes = rne_e4m3(y / scale)

gate and up (R, K) float32 / float16 / bfloat16, K a multiple of 128, each read at its row stride (halves of a fused
gate-up projection cost no copy). y never reaches memory: 2 inputs read, 1 + 4 / 128 bytes an element written. The
math is swiglu's (swiglu.py) and fp8_quantize's (quantize_block_rows), so the codes are those of the two ops run
one after the other on the same device. Not differentiable.

swiglu_fp8_quantize_kernel: a tile a program, as fp8_quantize's (fp8_quantize.row_tile).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks, swiglu
from .fp8_quantize import BLOCK, FP8, e4m3_target, fused_cast_slack, quantize, require_e4m3, row_tile, store_row_blocks
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "swiglu_fp8_quantize"


@triton.jit
def swiglu_fp8_quantize_kernel(
    GATE, UP, R, K, ldg, ldu,
    CODES, SCALES,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """gate[r, k] at GATE + r ldg + k, up[r, k] at UP + r ldu + k; CODES (R, K) and SCALES (R, K / 128) compact."""
    K, ldg, ldu = K * UNIT, ldg * UNIT, ldu * UNIT  # plan.in_units
    row0, col0 = tl.program_id(0) * BLOCK_R, tl.program_id(1) * BLOCK_K
    rr, kk = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_K)
    mask = (rr < R - row0)[:, None] & (kk < K - col0)[None, :]
    g = tl.load(GATE + row0.to(tl.int64) * ldg + rr[:, None] * ldg + col0 + kk[None, :], mask=mask, other=0.0)
    u = tl.load(UP + row0.to(tl.int64) * ldu + rr[:, None] * ldu + col0 + kk[None, :], mask=mask, other=0.0)
    y = swiglu.silu_times(g.to(tl.float32), u.to(tl.float32))
    y = y.to(GATE.dtype.element_ty).to(tl.float32)  # rounded as swiglu stores it
    store_row_blocks(y, CODES, SCALES, row0, R, K, col0, BLOCK_R, BLOCK_K)


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def check(gate, up) -> None:
    dtype = checks.check_float(NAME, "gate", gate)
    if len(gate.shape) != 2 or gate.shape[1] % BLOCK:
        raise ValueError(f"{NAME}: gate must be 2-D (R, K) with K a multiple of {BLOCK}, got shape "
                         f"{tuple(gate.shape)}")  # fmt: skip
    checks.check_same_dtype(NAME, "up", up, dtype, "the dtype of gate")
    checks.check_shape(NAME, "up", up, tuple(gate.shape), "the shape of gate")


def forward(r: int, k: int, *, dtype: str, target: Target, ldg: int | None = None, ldu: int | None = None) -> Plan:
    """Inputs gate and up (R, K) row-major at row strides ldg / ldu (None: compact). Outputs codes (R, K)
    float8_e4m3fn and scales (R, K / 128) float32, compact."""
    require_e4m3(NAME, target)
    empty = not (r and k)  # nothing to launch: the (empty) outputs count as zeroed
    buffers = {"codes": BufferSpec((r, k), FP8, zeroed=empty),
               "scales": BufferSpec((r, k // BLOCK), "float32", zeroed=empty)}  # fmt: skip
    inputs = {"gate": dtype, "up": dtype}
    if empty:
        return Plan(inputs, buffers, (), ("codes", "scales"))
    block_r, block_k, warps = row_tile(k)
    grid = (cdiv(r, block_r), cdiv(k, block_k))
    reads = ("gate", "up", r, k, ldg or k, ldu or k)
    constexprs = dict(BLOCK_R=block_r, BLOCK_K=block_k)
    launch = Launch(swiglu_fp8_quantize_kernel, grid, reads, ("codes", "scales"), constexprs, warps, 1)
    return Plan(inputs, buffers, (in_units(launch, "K", "ldg", "ldu", units=(16,)),), ("codes", "scales"))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(gate, up):
    """swiglu's output rounded to gate's dtype, through fp8_quantize's NumPy definition: (codes, scales)."""
    codes, scales = quantize(round_to(swiglu.reference(gate, up)[0], str(gate.dtype)), 1)
    return codes.astype(np.float64), scales.astype(np.float64)


def slack(kwargs) -> tuple:
    return fused_cast_slack(*reference(**kwargs))


def reference_vjp(kwargs, cotangents):
    return {}


def cost(kwargs) -> tuple[Cost, Cost]:
    """bytes: gate and up read, codes and scales written; flops ~5 an element."""
    gate = kwargs["gate"]
    n = gate.size
    return Cost(2 * n * ITEMSIZE[str(gate.dtype)] + n + 4 * n // BLOCK, 5 * n), Cost(0, 0)


def sample(rng: np.random.Generator, shape, dtype: str) -> dict:
    """swiglu's inputs with (R, K): R the product of the leading dims, K the last dim rounded up to a multiple of 128
    (at most 3 blocks for a test's width; a benchmark's (R, K) with K >= 1024 as it is)."""
    shape = tuple(shape)
    r, k = int(np.prod(shape[:-1])), shape[-1]
    if not (len(shape) == 2 and k >= BLOCK * 8 and k % BLOCK == 0):
        k = BLOCK * min(3, max(1, cdiv(k, BLOCK)))
    return swiglu.sample(rng, (r, k), dtype)


def bad_inputs(kwargs) -> list[BadInput]:
    gate, up = kwargs["gate"], kwargs["up"]
    other = np.float16 if gate.dtype != np.float16 else np.float32
    return [
        BadInput({"gate": gate.astype(np.int32)}, TypeError, f"{NAME}: gate must have dtype"),
        BadInput({"up": up.astype(other)}, TypeError, f"{NAME}: up must have dtype"),
        BadInput({"gate": gate[None], "up": up[None]}, ValueError, f"{NAME}: gate must be 2-D"),
        BadInput({"gate": gate[:, :-1], "up": up[:, :-1]}, ValueError, f"{NAME}: gate must be 2-D .* multiple of 128"),
        BadInput({"up": up[:1] if up.shape[0] > 1 else up[:, :0]}, ValueError, f"{NAME}: up must have shape"),
        *not_arrays(NAME, "gate", "up"),
    ]


def plans(target: Target):
    """Each input dtype at 4096 x 18432 (DeepSeek-V3's dense MLP width), on e4m3 targets."""
    if not e4m3_target(target):
        return
    for dtype in ("float32", "float16", "bfloat16"):
        yield forward(4096, 18432, dtype=dtype, target=target)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
        slack=slack,
    )
)
