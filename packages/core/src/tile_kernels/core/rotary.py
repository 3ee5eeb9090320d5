"""Rotary position embedding: apply_rotary(x, cos, sin, interleaved=False), x (B, S, H, D), cos/sin (S, D/2).

Each pair (a, b) of a row at position s is rotated by the angle whose cos/sin are cos[s, i], sin[s, i]:
    a' = a cos - b sin,    b' = b cos + a sin                                     in fp32
GPT-NeoX pairs (i, i + D/2) by default, GPT-J pairs (2i, 2i + 1) when interleaved. The backward is the rotation by
the opposite angle (sin -> -sin), so one kernel serves both (CONJUGATE). A program rotates a tile of 2048 pairs of
(b, s, h) rows (one row per program left the H200 at 10-20% of copy bandwidth); a row's position is (row // H) % S.
`batch` independent problems (a JAX vmap folded into one launch) share cos/sin or bring their own.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "apply_rotary"
# The half head dim and the strides are passed in units of 16 elements where they all divide (plan.in_units) and
# multiplied back by UNIT first: rows then start 16-byte aligned and the loads and stores vectorize under jax-triton
# too (GPT-NeoX pairs only: the interleaved halves are stride-2 accesses, element by element in any build).


@triton.jit
def rotary_kernel(
    X, COS, SIN, rows, seqlen, heads, HALF, stride_x, stride_table,
    Y,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    UNIT: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(rows, BLOCK_R), batch): a tile of BLOCK_R rows (heads, then positions) per program."""
    HALF, stride_x, stride_table = HALF * UNIT, stride_x * UNIT, stride_table * UNIT
    b = tl.program_id(1).to(tl.int64)
    m = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row = (b * rows + m)[:, None]
    pos = ((m // heads) % seqlen)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (m[:, None] < rows) & (i < HALF)
    table = b * stride_table + pos * HALF + i  # a few KB per position, shared by the heads: cached
    c = tl.load(COS + table, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)
    if CONJUGATE:
        s = -s
    if INTERLEAVED:
        a_off, b_off = 2 * i, 2 * i + 1
    else:
        a_off, b_off = i, i + HALF
    x_ptr, y_ptr = X + row * stride_x, Y + row * (2 * HALF)
    a = tl.load(x_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
    bb = tl.load(x_ptr + b_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + a_off, (a * c - bb * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + b_off, (bb * c + a * s).to(Y.dtype.element_ty), mask=mask)


PAIRS_PER_PROGRAM = 2048  # rows per program = this / (head_dim / 2): ~8 KB of bf16 in and out per program


def check(x, cos, sin, interleaved=False, per_sequence=False) -> None:
    """per_sequence: tables may also be (batch, seqlen, head_dim / 2), one per sequence (torch adapter)."""
    checks.check_float(NAME, "x", x)
    if len(x.shape) != 4:
        raise ValueError(f"{NAME}: x must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"{NAME}: x's head_dim must be even, got {x.shape[-1]}")
    shape = (x.shape[1], x.shape[-1] // 2)
    checks.check_array(NAME, "cos", cos)
    if per_sequence and len(cos.shape) == 3:
        shape, what = (x.shape[0], *shape), "(batch, seqlen, head_dim / 2) of x"
    else:
        what = "(seqlen, head_dim / 2) of x" + (", or (batch, seqlen, head_dim / 2)" if per_sequence else "")
    for name, table in (("cos", cos), ("sin", sin)):
        checks.check_float(NAME, name, table)
        checks.check_shape(NAME, name, table, shape, what)


def rotate(
    batch: int, rows: int, seqlen: int, heads: int, head_dim: int, *, dtype: str, table_dtype: str,
    interleaved: bool, conjugate: bool, target: Target, stride_x: int | None = None, table_batched: bool = False,
) -> Plan:  # fmt: skip
    """Inputs x (batch*rows rows of head_dim, row stride stride_x; rows = B*S*H), cos, sin ((batch,) seqlen,
    head_dim/2). Output y (batch, rows, head_dim). conjugate=True is the backward (rotation by -angle)."""
    empty = batch * rows * head_dim == 0
    buffers = {"y": BufferSpec((batch, rows, head_dim), dtype, zeroed=empty)}
    launches = ()
    if not empty:
        half = head_dim // 2
        block = next_power_of_2(half)
        block_r = max(1, PAIRS_PER_PROGRAM // block)
        warps = max(1, min(8, block * block_r // (target.warp_size * 8)))
        launch = Launch(
            rotary_kernel,
            grid=(cdiv(rows, block_r), batch),
            reads=("x", "cos", "sin", rows, seqlen, heads, half, head_dim if stride_x is None else stride_x,
                   seqlen * half if table_batched else 0),
            writes=("y",),
            constexprs=dict(BLOCK_R=block_r, BLOCK=block, INTERLEAVED=interleaved, CONJUGATE=conjugate),
            num_warps=warps,
        )  # fmt: skip
        launches = (in_units(launch, "HALF", "stride_x", "stride_table"),)
    return Plan({"x": dtype, "cos": table_dtype, "sin": table_dtype}, buffers, launches, ("y",))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def _pairs(a, interleaved):
    half = a.shape[-1] // 2
    return (a[..., 0::2], a[..., 1::2]) if interleaved else (a[..., :half], a[..., half:])


def _join(first, second, interleaved):
    if interleaved:
        return np.stack([first, second], axis=-1).reshape(first.shape[:-1] + (2 * first.shape[-1],))
    return np.concatenate([first, second], axis=-1)


def _rotate(x, cos, sin, interleaved, sign):
    a, b = _pairs(x.astype(np.float64), interleaved)
    c = cos.astype(np.float64)[None, :, None, :]
    s = sign * sin.astype(np.float64)[None, :, None, :]
    return _join(a * c - b * s, b * c + a * s, interleaved)


def reference(x, cos, sin, interleaved=False):
    return (_rotate(x, cos, sin, interleaved, 1.0),)


def reference_vjp(kwargs, cotangents):
    return {"x": _rotate(cotangents[0], kwargs["cos"], kwargs["sin"], kwargs.get("interleaved", False), -1.0)}


def cost(kwargs) -> tuple[Cost, Cost]:
    x, cos = kwargs["x"], kwargs["cos"]
    numel, item = int(np.prod(x.shape)), ITEMSIZE[str(x.dtype)]
    tables = 2 * int(np.prod(cos.shape)) * ITEMSIZE[str(cos.dtype)]
    return Cost(2 * numel * item + tables, 3 * numel), Cost(2 * numel * item + tables, 3 * numel)


def sample(rng: np.random.Generator, shape, dtype: str, interleaved=False, fp32_tables=True) -> dict:
    """x (B, S, H, D) from the drawn shape: its leading dims padded to three, D even (at most 512); real angles."""
    b, s, h = (tuple(shape[:-1]) + (1, 1, 1))[:3]
    d = 2 * max(1, min(shape[-1], 512) // 2)
    angles = rng.uniform(0, 2 * np.pi, (s, d // 2))
    table = "float32" if fp32_tables else dtype
    return {"x": round_to(rng.standard_normal((b, s, h, d)), dtype), "cos": round_to(np.cos(angles), table),
            "sin": round_to(np.sin(angles), table), "interleaved": interleaved}  # fmt: skip


def bad_inputs(kwargs) -> list[BadInput]:
    x, cos = kwargs["x"], kwargs["cos"]
    return [
        BadInput({"x": x[0]}, ValueError, "apply_rotary: x must be 4-D"),
        BadInput({"x": x[..., :-1]}, ValueError, "apply_rotary: x's head_dim must be even"),
        BadInput({"x": x.astype(np.int32)}, TypeError, "apply_rotary: x must have dtype"),
        BadInput({"cos": cos[:, :-1]}, ValueError, "apply_rotary: cos must have shape"),
        *not_arrays(NAME, "x", "cos", "sin"),
    ]


def plans(target: Target):
    """Each head-dim bucket with compact rows (UNIT = 16 from head dim 32 on) and padded ones (stride d + 2: UNIT 1)."""
    for dtype in FLOAT_DTYPES:
        for table_dtype in sorted({dtype, "float32"}):
            for d in (2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512):
                for interleaved in (False, True):
                    for conjugate in (False, True):
                        for stride_x in (None, d + 2):
                            yield rotate(1, 8, 4, 2, d, dtype=dtype, table_dtype=table_dtype, interleaved=interleaved,
                                         conjugate=conjugate, target=target, stride_x=stride_x)  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"interleaved": (False, True), "fp32_tables": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("x",),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
