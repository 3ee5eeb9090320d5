"""Fused linear + cross-entropy: cross_entropy(hidden @ weight.T, target) without the (N, V) logits.

    logits = hidden @ weight.T          hidden (N, D), weight (V, D): never materialized whole
    loss_i = lse(logits_i) - logits_i[target_i]      0 for rows whose target is ignore_index; none / sum / mean
Gradients, with g_i the row's cotangent (dloss, dloss / count for mean; 0 for ignored rows):
    dlogits = g * (softmax(logits) - onehot(target)),   dhidden = dlogits @ weight,   dweight = dlogits.T @ hidden

Design: rows are processed in chunks of C rows. Per chunk (Plan steps):
  1. logits_c = hidden_c @ weight.T              a Gemm step (the framework's matmul: cuBLAS / hipBLAS)
  2. the cross-entropy forward kernel (core.cross_entropy) writes the rows' loss, lse and valid flags and, in place
     over logits_c, dlogits_c for a unit cotangent
  3. dhidden_c = dlogits_c @ weight               Gemm into rows of dhidden
  4. dweight (+)= dlogits_c.T @ hidden_c          Gemm accumulating over the chunks
For sum/mean the gradient is linear in the one scalar cotangent, so the training forward computes unscaled gradients
(three GEMMs in all, as many as the unfused torch forward + backward) and the backward only scales them in place by
dloss (sum) or dloss / count (mean; 0 when no row counts). For 'none' each row has its own cotangent: the forward
runs steps 1-2 (no gradient) and saves lse; the backward recomputes logits_c and runs the cross-entropy backward kernel
in place (four GEMMs). Without gradients (inference) the forward runs steps 1-2 only. GEMMs take the input dtype and
accumulate in fp32 (as torch's matmul does); the cross-entropy math is fp32 on logits rounded to the input dtype (as
in the unfused torch version).

Chunk size: C = N*D/V rows (a chunk of logits as large as hidden), clamped to [1024, 4096], to N and, for N > 1024,
to N/2 (the (N, V) logits are never allocated whole), then evened out over the chunks. The lower clamp is for speed:
step 4 reads and writes all of dweight (V x D) per chunk, 4*V*D bytes against 2*V*D*C flops, which stays
compute-bound on an H200 (~190 flop/byte) only for C above ~400; 1024 also gives the step-1/3 GEMMs enough rows to
fill the GPU.

Memory beyond the inputs (`peak_bytes`): the plans' buffers, nothing else: GEMMs write into them (no matmul output
copied in, no fp32 copies), the logits chunk is in the input dtype, and the torch autograd node hands out only the
loss and the count (so autograd creates no zero cotangents of the (V, D) gradient buffers). For sum/mean the peak is
the end of the training forward: one chunk of logits (C x V), dhidden and dweight; at N = 8192, D = 4096, V = 128256
in bf16, C = 1024: 250.5 + 64 + 1002 MiB = 1317 MiB, 0.22x the 6012 MiB (three (N, V) buffers: logits, log-softmax,
dlogits) of the unfused torch forward + backward; C = 2048 would pass a quarter of it (1567 MiB), so the lower clamp
is also the largest chunk that stays under. Limits: dweight accumulates across chunks in the input dtype (one rounding
per chunk, as a GEMM with beta = 1: an fp32 accumulator would cost 4*V*D bytes, 2 GiB at that shape); the sum/mean
backward updates the saved gradients in place, so a second backward through the same graph (retain_graph) is refused
by torch's saved-tensor version check. Under JAX's vmap the problems run one after the other.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from . import cross_entropy as ce
from .plan import FLOAT_DTYPES, ITEMSIZE, BufferSpec, Gemm, Launch, Plan, Target, cdiv, dtype_name, in_units, rows
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to
from .rows import WIDTH_BUCKETS

NAME = "fused_linear_cross_entropy"
REDUCTIONS = ce.REDUCTIONS
TARGET_DTYPES = ce.TARGET_DTYPES
MIN_CHUNK, MAX_CHUNK = 1024, 4096  # default chunk rows (see the module docstring)
SCALE_BLOCK = 4096


@triton.jit
def scale_kernel(X, DLOSS, COUNT, n, OUT, BLOCK: tl.constexpr, MEAN: tl.constexpr, UNIT: tl.constexpr):
    """OUT[i] = X[i] * g over n elements (OUT may be X): g = dloss, or dloss / count for a mean (0 if count is 0:
    then every row was ignored and X is 0). n in units of UNIT elements (plan.in_units: jax-triton does not specialize
    ints), multiplied back first so that the mask is known constant over 16-element vectors."""
    n = n * UNIT
    g = tl.load(DLOSS).to(tl.float32)
    if MEAN:
        count = tl.load(COUNT)
        g = tl.where(count > 0, g, 0.0) / tl.maximum(count, 1.0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (x * g).to(OUT.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# validation and plans


def check(hidden, weight, target, ignore_index=-100, reduction="mean", chunk_size=None) -> None:
    dtype = checks.check_float(NAME, "hidden", hidden)
    if len(hidden.shape) != 2:
        raise ValueError(f"{NAME}: hidden must be 2-D (N, D), got shape {tuple(hidden.shape)}")
    checks.check_float(NAME, "weight", weight)
    checks.check_same_dtype(NAME, "weight", weight, dtype, "the dtype of hidden")
    if len(weight.shape) != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] < 1:
        raise ValueError(
            f"{NAME}: weight must have shape (V, D) with V >= 1 and D = {hidden.shape[1]} (hidden's last dim), "
            f"got {tuple(weight.shape)}"
        )
    checks.check_array(NAME, "target", target)
    if dtype_name(target.dtype) not in TARGET_DTYPES:
        raise TypeError(f"{NAME}: target must have dtype int32 or int64, got {dtype_name(target.dtype)}")
    checks.check_shape(NAME, "target", target, hidden.shape[:1], "one class index per row of hidden")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{NAME}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    checks.check_int(NAME, "ignore_index", ignore_index)
    if chunk_size is not None:
        if checks.check_int(NAME, "chunk_size", chunk_size, "an int or None") < 1:
            raise ValueError(f"{NAME}: chunk_size must be >= 1 (rows per chunk) or None, got {chunk_size}")


def default_chunk_size(n_rows: int, n_classes: int, dim: int) -> int:
    """Rows per chunk when chunk_size is None (see the module docstring)."""
    if n_rows == 0:
        return 1
    chunk = min(max(cdiv(n_rows * max(dim, 1), n_classes), MIN_CHUNK), MAX_CHUNK, n_rows)
    if n_rows > MIN_CHUNK:  # never all the logits at once
        chunk = min(chunk, cdiv(n_rows, 2))
    return cdiv(n_rows, cdiv(n_rows, chunk))  # the same number of chunks, evened out


def chunks(n_rows: int, n_classes: int, dim: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """The row ranges [start, stop) processed one after the other."""
    chunk = default_chunk_size(n_rows, n_classes, dim) if chunk_size is None else int(chunk_size)
    return [(r0, min(r0 + chunk, n_rows)) for r0 in range(0, n_rows, chunk)]


def _grad_buffers(n_rows, n_classes, dim, dtype, grad_hidden, grad_weight) -> dict:
    """dhidden (N, D) and dweight (V, D), or (0, D) placeholders when not wanted; zeroed when no chunk writes them."""
    return {
        "dhidden": BufferSpec((n_rows if grad_hidden else 0, dim), dtype, zeroed=not grad_hidden or n_rows == 0),
        "dweight": BufferSpec((n_classes if grad_weight else 0, dim), dtype, zeroed=not grad_weight or n_rows == 0),
    }


def _gradient_gemms(r0, r1, n_rows, logits, grad_hidden, grad_weight) -> list[Gemm]:
    """Steps 3-4 for rows [r0, r1), whose dlogits are in `logits`."""
    steps = []
    if grad_hidden:
        steps.append(Gemm(rows("dhidden", r0, r1, n_rows), logits, "weight"))
    if grad_weight:
        steps.append(Gemm("dweight", logits, rows("hidden", r0, r1, n_rows), trans_a=True, accumulate=r0 > 0))
    return steps


def forward(
    n_rows: int, n_classes: int, dim: int, *, dtype: str, target_dtype: str, reduction: str, ignore_index: int,
    chunk_size: int | None, grad_hidden: bool, grad_weight: bool, target: Target,
) -> Plan:  # fmt: skip
    """Inputs hidden (N, D), weight (V, D), target (N,). Outputs loss ((N,) for 'none', else (1,)) in float32 (as
    the unfused loss of upcast logits); lse (N,) and count (1,) fp32 (count: the non-ignored rows, 0 for 'none');
    for sum/mean with grad_* the unscaled gradients dhidden (N, D) / dweight (V, D), else (0, D) placeholders."""
    reduced = reduction != "none"
    grad_hidden, grad_weight = reduced and grad_hidden, reduced and grad_weight
    empty = n_rows == 0
    row_ranges = chunks(n_rows, n_classes, dim, chunk_size)
    chunk = max((r1 - r0 for r0, r1 in row_ranges), default=0)
    buffers = {
        "loss": BufferSpec((1,) if reduced else (n_rows,), "float32", zeroed=empty and not reduced),
        "lse": BufferSpec((n_rows,), "float32", zeroed=empty),
        "count": BufferSpec((1,), "float32", zeroed=not reduced),
        **_grad_buffers(n_rows, n_classes, dim, dtype, grad_hidden, grad_weight),
    }
    if reduced:  # per-row losses and valid flags (one element when there are no rows: a pointer for the reduction)
        buffers |= {n: BufferSpec((max(n_rows, 1),), "float32", zeroed=empty) for n in ("row_loss", "valid")}
    if not empty:
        buffers["logits"] = BufferSpec((chunk, n_classes), dtype)
    steps: list = []
    for r0, r1 in row_ranges:
        logits = rows("logits", 0, r1 - r0, chunk)
        steps.append(Gemm(logits, rows("hidden", r0, r1, n_rows), "weight", trans_b=True))
        steps.append(
            ce.forward_launch(
                1, r1 - r0, n_classes, logits=logits, labels=rows("target", r0, r1, n_rows),
                loss=rows("row_loss" if reduced else "loss", r0, r1, n_rows), lse=rows("lse", r0, r1, n_rows),
                valid=rows("valid", r0, r1, n_rows) if reduced else None,
                dlogits=logits if grad_hidden or grad_weight else None, ignore_index=ignore_index,
                label_smoothing=0.0, target=target,
            )
        )  # fmt: skip
        steps += _gradient_gemms(r0, r1, n_rows, logits, grad_hidden, grad_weight)
    if reduced:
        steps.append(ce.reduce_launch(1, n_rows, reduction, row_loss="row_loss", valid="valid", loss="loss",
                                      count="count"))  # fmt: skip
    inputs = {"hidden": dtype, "weight": dtype, "target": target_dtype}
    return Plan(inputs, buffers, tuple(steps), ("loss", "lse", "count", "dhidden", "dweight"))


def backward(
    n_rows: int, n_classes: int, dim: int, *, dtype: str, target_dtype: str, ignore_index: int,
    chunk_size: int | None, grad_hidden: bool, grad_weight: bool, target: Target,
) -> Plan:  # fmt: skip
    """Reduction 'none': inputs dloss (N,), hidden, weight, target, lse (N,); outputs dhidden, dweight (placeholders
    (0, D) where not wanted). Recomputes each chunk's logits and turns them into dlogits in place."""
    row_ranges = chunks(n_rows, n_classes, dim, chunk_size) if grad_hidden or grad_weight else []
    chunk = max((r1 - r0 for r0, r1 in row_ranges), default=0)
    buffers = _grad_buffers(n_rows, n_classes, dim, dtype, grad_hidden, grad_weight)
    if row_ranges:
        buffers["logits"] = BufferSpec((chunk, n_classes), dtype)
    steps: list = []
    for r0, r1 in row_ranges:
        logits = rows("logits", 0, r1 - r0, chunk)
        steps.append(Gemm(logits, rows("hidden", r0, r1, n_rows), "weight", trans_b=True))
        steps.append(
            ce.backward_launch(
                1, r1 - r0, n_classes, logits=logits, labels=rows("target", r0, r1, n_rows),
                lse=rows("lse", r0, r1, n_rows), dloss=rows("dloss", r0, r1, n_rows), count=None, dlogits=logits,
                reduction="none", ignore_index=ignore_index, label_smoothing=0.0, target=target,
            )
        )  # fmt: skip
        steps += _gradient_gemms(r0, r1, n_rows, logits, grad_hidden, grad_weight)
    inputs = {"dloss": "float32", "hidden": dtype, "weight": dtype, "target": target_dtype, "lse": "float32"}
    return Plan(inputs, buffers, tuple(steps), ("dhidden", "dweight"))


def scale_gradients(n_hidden: int, n_weight: int, *, dtype: str, reduction: str, target: Target) -> Plan:
    """Reduction sum/mean: inputs dloss (1,), count (1,), dhidden and dweight (the forward's unscaled gradients, of
    n_hidden and n_weight elements), which are scaled in place and returned."""
    steps = tuple(
        in_units(Launch(scale_kernel, grid=(cdiv(n, SCALE_BLOCK),), reads=(name, "dloss", "count", n), writes=(name,),
                        constexprs=dict(BLOCK=SCALE_BLOCK, MEAN=reduction == "mean"), num_warps=8), "n")
        for name, n in (("dhidden", n_hidden), ("dweight", n_weight))
        if n > 0
    )  # fmt: skip
    inputs = {"dloss": "float32", "count": "float32", "dhidden": dtype, "dweight": dtype}
    return Plan(inputs, {}, steps, ("dhidden", "dweight"))


def peak_bytes(
    n_rows: int, n_classes: int, dim: int, *, dtype: str, reduction: str, chunk_size: int | None = None
) -> int:
    """Bytes that a training step (forward, then backward of both gradients) holds at its peak beyond its inputs
    and the cotangent: during the forward all of its buffers; during the backward the forward's outputs (the sum/mean
    gradients, or the 'none' loss and lse) and the backward's buffers (none for sum/mean, which scales in place)."""
    kw = dict(dtype=dtype, target_dtype="int64", ignore_index=-100, chunk_size=chunk_size, target=Target())
    fwd = forward(n_rows, n_classes, dim, reduction=reduction, grad_hidden=True, grad_weight=True, **kw)
    if reduction == "none":
        bwd = backward(n_rows, n_classes, dim, grad_hidden=True, grad_weight=True, **kw)
    else:
        bwd = scale_gradients(n_rows * dim, n_classes * dim, dtype=dtype, reduction=reduction, target=Target())
    kept = sum(fwd.buffers[name].nbytes for name in fwd.outputs)
    return max(sum(s.nbytes for s in fwd.buffers.values()), kept + sum(s.nbytes for s in bwd.buffers.values()))


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples


def reference(hidden, weight, target, ignore_index=-100, reduction="mean", chunk_size=None):
    logits = hidden.astype(np.float64) @ weight.astype(np.float64).T
    return ce.reference(logits, target, ignore_index, reduction)


def reference_vjp(kwargs, cotangents):
    hidden, weight = kwargs["hidden"].astype(np.float64), kwargs["weight"].astype(np.float64)
    ce_kwargs = dict(logits=hidden @ weight.T, target=kwargs["target"], ignore_index=kwargs.get("ignore_index", -100),
                     reduction=kwargs.get("reduction", "mean"))  # fmt: skip
    with np.errstate(divide="ignore", invalid="ignore"):  # a mean over no rows: every row's cotangent is 0 anyway
        dlogits = ce.reference_vjp(ce_kwargs, cotangents)["logits"]
    return {"hidden": dlogits @ weight, "weight": dlogits.T @ hidden}


def cost(kwargs) -> tuple[Cost, Cost]:
    """The training forward (with the sum/mean gradients fused into it) and the backward."""
    hidden, weight, target = kwargs["hidden"], kwargs["weight"], kwargs["target"]
    (n, d), v = hidden.shape, weight.shape[0]
    item, titem = ITEMSIZE[str(hidden.dtype)], ITEMSIZE[str(target.dtype)]
    gemm, ce_flops = 2 * n * d * v, 4 * n * v
    inputs, grads = (n * d + v * d) * item + n * titem, (n * d + v * d) * item
    if kwargs.get("reduction", "mean") == "none":  # the backward recomputes the logits
        saved = n * (item + 4)  # loss, lse
        return Cost(inputs + saved, gemm + ce_flops), Cost(inputs + saved + grads, 3 * gemm + ce_flops)
    return Cost(inputs + grads + item, 3 * gemm + 2 * ce_flops), Cost(2 * grads, n * d + v * d)


DIMS = (1, 8, 19, 32)  # hidden sizes drawn by `sample`: small, so that the interpreter's matmuls stay cheap
# dhidden sums V products in a GEMM's fp32 accumulator: its error grows with V (a running sum dominated by the
# target's term: 1.8e-4 at |dhidden| ~ 10 for V = 4096 with torch's own CPU matmul), past the suite's one-ulp float32
# bound. float32 samples therefore keep V <= 256; wider vocabularies are drawn in float16 / bfloat16, and
# tests/test_fused_linear_cross_entropy.py checks a float32 V = 40000 against the fp32 GEMM error bound.
FLOAT32_MAX_CLASSES = 256


def sample(rng: np.random.Generator, shape, dtype: str, reduction="mean", small_chunks=False, dim=None) -> dict:
    """hidden (prod(shape[:-1]), D) with D = dim or drawn from DIMS, weight (max(shape[-1], 1), D) (V capped for
    float32, see FLOAT32_MAX_CLASSES), logits of std ~2, about a fifth of the targets ignore_index; with
    small_chunks, chunk_size splits the rows into 2-4 chunks, the last one usually shorter."""
    n_rows, n_classes = int(np.prod(shape[:-1])), max(shape[-1], 1)
    if dtype == "float32":
        n_classes = min(n_classes, FLOAT32_MAX_CLASSES)
    dim = int(rng.choice(DIMS)) if dim is None else dim
    hidden = round_to(rng.standard_normal((n_rows, dim)), dtype)
    weight = round_to(rng.standard_normal((n_classes, dim)) * (2.0 / np.sqrt(dim)), dtype)
    target = np.where(rng.random(n_rows) < 0.2, -100, rng.integers(0, n_classes, n_rows)).astype(np.int64)
    chunk_size = cdiv(n_rows, int(rng.integers(2, 5))) if small_chunks and n_rows > 1 else None
    return {"hidden": hidden, "weight": weight, "target": target, "ignore_index": -100, "reduction": reduction,
            "chunk_size": chunk_size}  # fmt: skip


def bad_inputs(kwargs) -> list[BadInput]:
    hidden, weight, target = kwargs["hidden"], kwargs["weight"], kwargs["target"]
    other = np.float16 if hidden.dtype != np.float16 else np.float32
    wide = np.concatenate([weight, weight], axis=1)
    return [
        BadInput({"hidden": hidden[None]}, ValueError, f"{NAME}: hidden must be 2-D"),
        BadInput({"hidden": hidden.astype(np.int32)}, TypeError, f"{NAME}: hidden must have dtype"),
        BadInput({"weight": weight.astype(other)}, TypeError, rf"{NAME}: weight must have dtype {hidden.dtype} \("),
        BadInput({"weight": wide}, ValueError, rf"{NAME}: weight must have shape \(V, D\)"),
        BadInput({"weight": weight[0]}, ValueError, rf"{NAME}: weight must have shape \(V, D\)"),
        BadInput({"target": target.astype(np.float32)}, TypeError, f"{NAME}: target must have dtype int32"),
        BadInput({"target": target[:-1]}, ValueError, f"{NAME}: target must have shape"),
        BadInput({"reduction": "avg"}, ValueError, f"{NAME}: reduction must be one of"),
        BadInput({"chunk_size": 0}, ValueError, f"{NAME}: chunk_size must be >= 1"),
        BadInput({"chunk_size": 2.5}, TypeError, f"{NAME}: chunk_size must be an int"),
        BadInput({"ignore_index": True}, TypeError, f"{NAME}: ignore_index must be an int"),
        *not_arrays(NAME, "hidden", "weight", "target"),
    ]  # fmt: skip


def plans(target: Target):
    """Every launch configuration: the cross-entropy kernels as this op configures them (with and without the fused
    gradient), per dtype and vocabulary bucket, and the gradient scaling."""
    for dtype in FLOAT_DTYPES:
        for target_dtype in TARGET_DTYPES:
            kw = dict(dtype=dtype, target_dtype=target_dtype, ignore_index=-100, chunk_size=None, target=target)
            for n in WIDTH_BUCKETS:
                for reduction in REDUCTIONS:
                    for grads in (False, True):
                        yield forward(4, n, 8, reduction=reduction, grad_hidden=grads, grad_weight=grads, **kw)
                yield backward(4, n, 8, grad_hidden=True, grad_weight=True, **kw)
        for reduction in ("sum", "mean"):
            yield scale_gradients(32, 64, dtype=dtype, reduction=reduction, target=target)


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options={"reduction": REDUCTIONS, "small_chunks": (False, True)},
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("hidden", "weight"),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
