"""Row-local rules: which dims of an op's arrays may be split across devices, and how the pieces combine.

A spec names the dims of one array by factors, einsum style: "... n" is any number of leading dims (the rows) and a
last dim n; "s e" a 2-D table. A factor in `split` may be sharded: every array that carries it is cut along it the
same way, each device runs the op on its pieces with no communication, and every output that carries the factor
comes out cut the same way. An output that lacks a sharded factor reduces over it; `reductions` says how the
devices' partial results combine: "sum" adds them, "mean" adds the per-device sums and divides by the summed count of
the rows that count (cross_entropy's non-ignored targets; an average of per-device means would be wrong). An argument
that lacks a sharded factor (a norm's weight) is whole on every device, and its gradient is the sum of the devices'
partial gradients. Factors outside `split` (a norm's width, cross_entropy's classes, softmax's dim, rotary's head
dim) must be whole on every device: an input sharded along one is gathered first, visibly, never computed wrongly.

`RULES` holds one rule per registered op, for its public call; the adapters carry it into their kernel-level ops
(torch: DTensor sharding strategies; JAX: shard_map with sharding in types, custom_partitioning under jit), and
tests/test_distributed.py checks both frameworks against the float64 references from this table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ELLIPSIS = "..."
LEAD = "lead"  # the leading dims "..." stands for are named lead0, lead1, ... (no rule names a factor so)
COMBINES = ("sum", "mean")


@dataclass(frozen=True)
class Split:
    args: Mapping[str, str]  # array argument name -> factor spec
    outputs: tuple[str, ...]  # factor spec of each output, in order
    split: tuple[str, ...]  # factors that may be sharded; "..." = every leading dim
    reductions: Mapping[int, str] = field(default_factory=dict)  # output index -> "sum" | "mean"

    def __post_init__(self):
        if any(c not in COMBINES for c in self.reductions.values()):
            raise ValueError(f"reductions must be among {COMBINES}, got {dict(self.reductions)}")


def dims(spec: str, ndim: int) -> tuple[str, ...]:
    """The factor of each dim of an `ndim`-d array with this spec; "..." expands to lead0, lead1, ..."""
    names = spec.split()
    if ELLIPSIS not in names:
        if len(names) != ndim:
            raise ValueError(f"spec {spec!r} names {len(names)} dims, the array has {ndim}")
        return tuple(names)
    at, lead = names.index(ELLIPSIS), ndim - len(names) + 1
    if lead < 0:
        raise ValueError(f"spec {spec!r} needs at least {len(names) - 1} dims, the array has {ndim}")
    return tuple(names[:at]) + tuple(f"{LEAD}{i}" for i in range(lead)) + tuple(names[at + 1 :])


def split_factors(split: tuple[str, ...], factors) -> tuple[str, ...]:
    """The factors among `factors` that `split` allows to shard ("..." allows every lead factor)."""
    lead = ELLIPSIS in split
    return tuple(f for f in dict.fromkeys(factors) if f in split or (lead and f.startswith(LEAD)))


def lead_count(specs: Mapping[str, str], shapes: Mapping[str, tuple]) -> int:
    """How many dims "..." stands for in a call: read off the first array whose spec has it (0 if none has)."""
    for name, spec in specs.items():
        if ELLIPSIS in spec.split() and name in shapes:
            return len(shapes[name]) - len(spec.split()) + 1
    return 0


def output_dims(spec: str, lead: int) -> tuple[str, ...]:
    return dims(spec, len(spec.split()) - 1 + lead if ELLIPSIS in spec.split() else len(spec.split()))


# ------------------------------------------------------------------------------------------------------ per-op rules


def _norm(kwargs) -> Split:
    args = {"x": "... n", "weight": "n"}
    if kwargs.get("bias") is not None:
        args["bias"] = "n"
    outputs = ("... n",)
    if kwargs.get("residual") is not None:
        args["residual"] = "... n"
        outputs += ("... n",)  # h = x + residual
    return Split(args, outputs, split=(ELLIPSIS,))


def _softmax(kwargs) -> Split:
    """Every dim but the softmax dim (named n) is row-local."""
    ndim = len(kwargs["x"].shape)
    names = [f"d{i}" for i in range(ndim)]
    if ndim:
        names[kwargs.get("dim", -1) % ndim] = "n"
    spec = " ".join(names)
    return Split({"x": spec}, (spec,), split=tuple(n for n in names if n != "n"))


def _swiglu(kwargs) -> Split:
    """Elementwise: every dim, the last one too."""
    return Split({"gate": ELLIPSIS, "up": ELLIPSIS}, (ELLIPSIS,), split=(ELLIPSIS,))


def _rotary(kwargs) -> Split:
    """Batch and heads freely; the sequence when cos/sin are cut the same way (position i of a piece is row i of its
    table piece); the head dim pairs elements across it, so it stays whole."""
    return Split({"x": "b s h d", "cos": "s e", "sin": "s e"}, ("b s h d",), split=("b", "s", "h"))


def _flash_attention(kwargs) -> Split:
    """Batch, and heads when q and k/v have as many (a GQA group would have to be cut with its key/value head, which
    one factor per dim cannot say: there only the batch splits); the sequences and the head dim stay whole."""
    mha = kwargs["q"].shape[2] == kwargs["k"].shape[2]
    kv = "b t h d" if mha else "b t g d"
    return Split({"q": "b s h d", "k": kv, "v": kv}, ("b s h d",), split=("b", "h") if mha else ("b",))


def _decode_attention(kwargs) -> Split:
    """Contiguous caches: batch, and heads when q and the caches have as many (as flash_attention). Paged caches: the
    page pool (n pages) is shared by the whole batch (any row's block table may point anywhere in it), so the batch
    stays whole; heads split when q and the pool have as many, else nothing does."""
    q = "b s h d" if len(kwargs["q"].shape) == 4 else "b h d"  # s: the new tokens, whole (causal among them)
    mha = kwargs["q"].shape[-2] == kwargs["k_cache"].shape[2]
    heads = "h d" if mha else "g d"
    args = {"q": q, "cache_seqlens": "b"}
    if kwargs.get("block_table") is not None:
        args |= {"k_cache": f"n t {heads}", "v_cache": f"n t {heads}", "block_table": "b m"}
        return Split(args, (q,), split=("h",) if mha else ())
    args |= {"k_cache": f"b t {heads}", "v_cache": f"b t {heads}"}
    return Split(args, (q,), split=("b", "h") if mha else ("b",))


def _mla_decode(kwargs) -> Split:
    """Heads freely (the latent cache is one row a position, shared by every head, so it stays whole on each device);
    the batch with contiguous caches, not with a paged pool (shared by the batch, as decode_attention's)."""
    args = {"q_nope": "b h c", "q_pe": "b h r", "cache_seqlens": "b"}
    outputs = ("b h c", "b h") if kwargs.get("return_lse") else ("b h c",)
    if kwargs.get("block_table") is not None:
        args |= {"kv_c": "n t c", "k_pe": "n t r", "block_table": "b m"}
        return Split(args, outputs, split=("h",))
    return Split(args | {"kv_c": "b t c", "k_pe": "b t r"}, outputs, split=("b", "h"))


def _loss(kwargs, args: dict) -> Split:
    reduction = kwargs.get("reduction", "mean")
    if reduction == "none":
        return Split(args, ("r",), split=("r",))
    return Split(args, ("",), split=("r",), reductions={0: reduction})


def _cross_entropy(kwargs) -> Split:
    return _loss(kwargs, {"logits": "r v", "target": "r"})


def _fused_linear_cross_entropy(kwargs) -> Split:
    """Rows split; the weight (V, H) is whole everywhere, so its gradient is a sum of per-device partials."""
    return _loss(kwargs, {"hidden": "r k", "weight": "v k", "target": "r"})


RULES: dict[str, Callable[[Mapping[str, Any]], Split]] = {
    "rms_norm": _norm,
    "layer_norm": _norm,
    "softmax": _softmax,
    "swiglu": _swiglu,
    "apply_rotary": _rotary,
    "flash_attention": _flash_attention,
    "decode_attention": _decode_attention,
    "mla_decode": _mla_decode,
    "cross_entropy": _cross_entropy,
    "fused_linear_cross_entropy": _fused_linear_cross_entropy,
}


def rule(op: str, kwargs: Mapping[str, Any]) -> Split:
    """The row-local rule of a call of `op` with these (keyword) arguments."""
    if op not in RULES:
        raise KeyError(f"op {op!r} has no row-local rule: add one to tile_kernels.core.sharding.RULES")
    return RULES[op](kwargs)
