"""RMSNorm whose output is cast to FP8 where it is born: rms_norm_fp8_quantize(x, weight, eps, residual) = (codes,
scales[, h]) = fp8_quantize(rms_norm(x, weight, eps, residual)) in one pass over memory, the input of an fp8_matmul
(DeepSeek-V3's per-token 1 x 128 blocks: a_scales).

    h = x + residual (rounded to x.dtype, returned)    y = h rstd weight rounded to x.dtype (rms_norm's output)
    scales[r, j] = max |y[r, block j]| / 448           codes = rne_e4m3(y / scale)

x (R, K) float32 / float16 / bfloat16 with K a multiple of 128 up to MAX_K, weight (K,) any float dtype. The bytes
of y never reach memory: x (and the residual) read once, 1 + 4 / 128 bytes an element written (+ h). The math of
each step is rms_norm's (norms.py) and fp8_quantize's (store_row_blocks), so the codes are those of the two ops
run one after the other on the same device. Not differentiable.

rms_norm_fp8_quantize_kernel: one row a program, in registers (BLOCK_K = K rounded up to a power of 2), cast and
stored by fp8_quantize.store_row_blocks. Design limits: K <= MAX_K (the row in registers; no split-row path).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import norms
from .fp8_quantize import BLOCK, FP8, e4m3_target, fused_cast_slack, quantize, require_e4m3, store_row_blocks
from .norms import _load_sum, _mean
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, register, round_to

NAME = "rms_norm_fp8_quantize"
MAX_K = 16384


@triton.jit
def rms_norm_fp8_quantize_kernel(
    X, RES, W, eps, R, K, ldx, ldr,
    CODES, SCALES, H,
    HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Grid (R,). x[r, k] at X + r ldx + k, residual at RES + r ldr + k; CODES, H (R, K) and SCALES (R, K / 128)
    compact."""
    K, ldx, ldr = K * UNIT, ldx * UNIT, ldr * UNIT  # plan.in_units
    eps = tl.cast(eps, tl.float32)  # torch.compile passes floats as fp64
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    h = _load_sum(X + row * ldx, RES + row * ldr, H + row * K, cols, mask, HAS_RESIDUAL)
    rstd = tl.rsqrt(_mean(tl.sum(h * h, axis=0), K) + eps)
    y = h * rstd * tl.load(W + cols, mask=mask).to(tl.float32)
    y = y.to(X.dtype.element_ty).to(tl.float32)  # rounded as rms_norm stores it
    store_row_blocks(tl.reshape(y, (1, BLOCK_K)), CODES, SCALES, row, R, K, 0, 1, BLOCK_K)


# ---------------------------------------------------------------------------------------------------------------------
# validation, plans


def check(x, weight, eps=1e-6, residual=None) -> None:
    norms.check(NAME, x, weight, None, residual, eps)
    if len(x.shape) != 2 or x.shape[1] % BLOCK or x.shape[1] > MAX_K:
        raise ValueError(f"{NAME}: x must be 2-D (R, K) with K a multiple of {BLOCK} up to {MAX_K}, got shape "
                         f"{tuple(x.shape)}")  # fmt: skip


def forward(r: int, k: int, *, dtype: str, weight_dtype: str, eps: float, target: Target, has_residual: bool = False,
            ldx: int | None = None, ldr: int | None = None) -> Plan:  # fmt: skip
    """Inputs x (R, K) and residual (R, K) row-major at row strides ldx / ldr (None: compact), weight (K,). Outputs
    codes (R, K) float8_e4m3fn, scales (R, K / 128) float32 and with a residual h (R, K) in dtype, compact."""
    require_e4m3(NAME, target)
    inputs = {"x": dtype, "weight": weight_dtype} | ({"residual": dtype} if has_residual else {})
    empty = not (r and k)  # nothing to launch: the (empty) outputs count as zeroed
    buffers = {"codes": BufferSpec((r, k), FP8, zeroed=empty),
               "scales": BufferSpec((r, k // BLOCK), "float32", zeroed=empty)}  # fmt: skip
    if has_residual:
        buffers["h"] = BufferSpec((r, k), dtype, zeroed=empty)
    outputs = tuple(buffers)
    if empty:
        return Plan(inputs, buffers, (), outputs)
    block_k = max(BLOCK, next_power_of_2(k))
    warps = 4 if block_k <= 1024 else 8 if block_k <= 4096 else 16
    ldr = (ldr or k) if has_residual else k
    reads = ("x", "residual" if has_residual else None, "weight", eps, r, k, ldx or k, ldr)
    writes = ("codes", "scales", "h" if has_residual else None)
    constexprs = dict(HAS_RESIDUAL=has_residual, BLOCK_K=block_k)
    launch = Launch(rms_norm_fp8_quantize_kernel, (r,), reads, writes, constexprs, warps, 1)
    return Plan(inputs, buffers, (in_units(launch, "K", "ldx", "ldr", units=(16,)),), outputs)


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(x, weight, eps=1e-6, residual=None):
    """rms_norm's output rounded to x's dtype, through fp8_quantize's NumPy definition: (codes, scales[, h])."""
    out = norms.reference(x, weight, None, eps, residual, is_rms=True)
    codes, scales = quantize(round_to(out[0], str(x.dtype)), 1)
    return (codes.astype(np.float64), scales.astype(np.float64), *out[1:])


def slack(kwargs) -> tuple:
    codes, scales, *h = reference(**kwargs)
    return (*fused_cast_slack(codes, scales), *[None] * len(h))


def reference_vjp(kwargs, cotangents):
    return {}


def cost(kwargs) -> tuple[Cost, Cost]:
    """bytes: x (and residual) read, codes, scales (and h) written, the weight; flops ~6 an element."""
    x, residual = kwargs["x"], kwargs.get("residual")
    item, streams = ITEMSIZE[str(x.dtype)], 1 if residual is None else 3
    n = x.size
    return Cost(n * item * streams + n + 4 * n // BLOCK + kwargs["weight"].nbytes, 6 * n), Cost(0, 0)


def sample(rng: np.random.Generator, shape, dtype: str, residual=False, eps=1e-6) -> dict:
    """rms_norm's inputs with x (R, K): R the product of the leading dims, K the last dim rounded up to a multiple of
    128 (at most 3 blocks for a test's width; a benchmark's (R, K) with K >= 1024 as it is)."""
    shape = tuple(shape)
    r, k = int(np.prod(shape[:-1])), shape[-1]
    if not (len(shape) == 2 and BLOCK * 8 <= k <= MAX_K and k % BLOCK == 0):
        k = BLOCK * min(3, max(1, -(-k // BLOCK)))
    return norms.sample(rng, (r, k), dtype, residual=residual, eps=eps)


def bad_inputs(kwargs) -> list[BadInput]:
    x = kwargs["x"]
    return [
        *norms.bad_inputs(NAME, kwargs),
        BadInput({"x": x[None]}, ValueError, f"{NAME}: .*must"),
        BadInput({"x": x[:, :-1], "weight": kwargs["weight"][:-1], "residual": None}, ValueError, f"{NAME}: x must be"),
    ]


def plans(target: Target):
    """Each input dtype, with and without a residual, at 4096 x 7168 (DeepSeek-V3's hidden size), on e4m3 targets."""
    if not e4m3_target(target):
        return
    for dtype in ("float32", "float16", "bfloat16"):
        for has_residual in (False, True):
            yield forward(4096, 7168, dtype=dtype, weight_dtype=dtype, eps=1e-6, target=target,
                          has_residual=has_residual)  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"residual": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=(),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
        slack=slack,
    )
)
