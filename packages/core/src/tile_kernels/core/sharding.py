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

`KERNELS` states these facts once for every kernel-level call (torch's tile_kernels::*_fwd / *_bwd ops, the JAX
adapters' calls of the same plans), and the adapters carry them into their frameworks (torch: DTensor sharding
strategies; JAX: shard_map with sharding in types, custom_partitioning under jit). `RULES` holds one rule per
registered op for its public call, most read off its forward kernel's facts; tests/test_distributed.py checks both
frameworks against the float64 references from this table.
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


# ------------------------------------------------------------------------------------------- kernel-level calls

COUNT = "c"  # the count of counted rows, a (1,) tensor (JAX's problem-batched calls carry one a problem, along p)
ROWS = "... n"  # rows of width n


@dataclass(frozen=True)
class Kernel:
    """The row-local facts of one kernel-level call (torch's op tile_kernels::<name>, the JAX adapter's call of the
    same plan), in Split's terms. Arrays are named as the op's schema names them and listed in its order, which the
    JAX calls follow (they take arrays positionally); the optional arrays these options leave out are not listed.
    Outputs are listed in the order the call returns them. A spec of None is an empty placeholder where these options
    compute nothing: torch's ops take and return it (replicated), JAX's calls leave it out."""

    args: Mapping[str, str | None]  # array argument name -> factor spec
    outputs: Mapping[str, str | None]  # output name -> factor spec
    split: tuple[str, ...]
    reductions: Mapping[str, str] = field(default_factory=dict)  # a reduced loss -> "sum" | "mean" (others: sums)
    linear: tuple[str, ...] = ()  # inputs read linearly or not at all: they may come as partial sums


def _present(specs: dict, **given: bool) -> dict:
    """specs without the optional arrays that `given` says are absent."""
    return {name: spec for name, spec in specs.items() if given.get(name, True)}


# norms: rows split, the width whole (weight and bias whole on every device, their gradients the devices' partial
# sums); h = x + residual, a placeholder without a residual


def _rms_norm_fwd(residual: bool = False) -> Kernel:
    args = _present({"x": ROWS, "weight": "n", "residual": ROWS}, residual=residual)
    return Kernel(args, {"y": ROWS, "h": ROWS if residual else None, "rstd": ELLIPSIS}, split=(ELLIPSIS,))


def _layer_norm_fwd(bias: bool = False, residual: bool = False) -> Kernel:
    args = _present({"x": ROWS, "weight": "n", "bias": "n", "residual": ROWS}, bias=bias, residual=residual)
    outputs = {"y": ROWS, "h": ROWS if residual else None, "mean": ELLIPSIS, "rstd": ELLIPSIS}
    return Kernel(args, outputs, split=(ELLIPSIS,))


def _rms_norm_bwd(dh: bool = False) -> Kernel:
    args = _present({"dy": ROWS, "h": ROWS, "weight": "n", "rstd": ELLIPSIS, "dh": ROWS}, dh=dh)
    return Kernel(args, {"dx": ROWS, "dweight": "n"}, split=(ELLIPSIS,))


def _layer_norm_bwd(bias: bool = False, dh: bool = False) -> Kernel:
    args = _present({"dy": ROWS, "h": ROWS, "weight": "n", "mean": ELLIPSIS, "rstd": ELLIPSIS, "dh": ROWS}, dh=dh)
    return Kernel(args, {"dx": ROWS, "dweight": "n", "dbias": "n" if bias else None}, split=(ELLIPSIS,))


def _alike(spec: str, args: str, outputs: str) -> Kernel:
    """Every array and output of one spec, its leading dims split."""
    return Kernel(dict.fromkeys(args.split(), spec), dict.fromkeys(outputs.split(), spec), split=(ELLIPSIS,))


def _rotary(rotated: str, result: str) -> Kernel:
    """Batch, sequence and heads; the sequence as cos/sin are cut (position i of a piece is row i of its table
    piece); the head dim pairs elements across it, so it stays whole."""
    x = "b s h d"
    return Kernel({rotated: x, "cos": "s e", "sin": "s e"}, {result: x}, split=("b", "s", "h"))


def _reduced(reduction: str) -> dict:
    return {} if reduction == "none" else {"loss": reduction}


def _cross_entropy_fwd(reduction: str) -> Kernel:
    """Rows split, classes whole; a reduced loss and the count are the devices' partial results."""
    outputs = {"loss": "r" if reduction == "none" else "", "lse": "r", "count": COUNT}
    return Kernel({"logits": "r v", "target": "r"}, outputs, ("r",), _reduced(reduction))


def _cross_entropy_bwd(reduction: str) -> Kernel:
    """Row-local given the whole count, which only a mean reads."""
    args = {"dloss": "r" if reduction == "none" else "", "logits": "r v", "target": "r", "lse": "r", "count": COUNT}
    return Kernel(args, {"dlogits": "r v"}, ("r",), linear=() if reduction == "mean" else ("count",))


def _gradients(grad_hidden: bool, grad_weight: bool) -> dict:
    """dhidden by rows; dweight, of the weight whole on every device, the devices' partial sums."""
    return {"dhidden": "r k" if grad_hidden else None, "dweight": "v k" if grad_weight else None}


def _fused_linear_cross_entropy_fwd(reduction: str, grad_hidden: bool = False, grad_weight: bool = False) -> Kernel:
    """Rows split, the weight whole; for sum/mean also the unscaled gradients asked for."""
    reduced = reduction != "none"
    outputs = {"loss": "" if reduced else "r", "lse": "r", "count": COUNT}
    outputs |= _gradients(reduced and grad_hidden, reduced and grad_weight)
    return Kernel({"hidden": "r k", "weight": "v k", "target": "r"}, outputs, ("r",), _reduced(reduction))


def _fused_linear_cross_entropy_bwd(grad_hidden: bool = False, grad_weight: bool = False) -> Kernel:
    """Reduction 'none': the chunks recomputed from the per-row cotangent."""
    args = {"dloss": "r", "hidden": "r k", "weight": "v k", "target": "r", "lse": "r"}
    return Kernel(args, _gradients(grad_hidden, grad_weight), ("r",))


def _fused_linear_cross_entropy_scale_(reduction: str, grad_hidden: bool = True, grad_weight: bool = True) -> Kernel:
    """Sum/mean: the forward's gradients times dloss (or dloss / count), in place, as they are placed (a partial sum
    scaled is the scaled sum's part). Its outputs are the gradients it updates (torch's op returns nothing)."""
    grads = _gradients(grad_hidden, grad_weight)
    linear = ("dweight",) * grad_weight + ("count",) * (reduction != "mean")  # only a mean reads the count
    return Kernel({"dloss": "", "count": COUNT, **grads}, grads, ("r",), linear=linear)


def _attention_heads(heads_q: int, heads_k: int) -> tuple[str, tuple[str, ...]]:
    """The key/value heads' factor, and the heads that may split: q's with k/v's when they have as many (a GQA group
    would have to be cut with its key/value head, which one factor per dim cannot say: there no head splits)."""
    return ("h", ("h",)) if heads_q == heads_k else ("g", ())


def _flash_attention_fwd(heads_q: int, heads_k: int) -> Kernel:
    """Batch, and heads as _attention_heads says; the sequences and the head dim stay whole; lse (B, Hq, Sq) follows
    q."""
    g, heads = _attention_heads(heads_q, heads_k)
    q, kv = "b s h d", f"b t {g} d"
    return Kernel({"q": q, "k": kv, "v": kv}, {"out": q, "lse": "b h s"}, ("b", *heads))


def _flash_attention_bwd(heads_q: int, heads_k: int) -> Kernel:
    g, heads = _attention_heads(heads_q, heads_k)
    q, kv = "b s h d", f"b t {g} d"
    args = {"dout": q, "q": q, "k": kv, "v": kv, "out": q, "lse": "b h s"}
    return Kernel(args, {"dq": q, "dk": kv, "dv": kv}, ("b", *heads))


def _flash_attention_varlen_fwd(heads_q: int, heads_k: int) -> Kernel:
    """Packed sequences: heads as _attention_heads says; the rows (t, u: every sequence's) and the sequence offsets
    (e) stay whole; lse (Hq, total_q)."""
    g, heads = _attention_heads(heads_q, heads_k)
    q, kv = "t h d", f"u {g} d"
    args = {"q": q, "k": kv, "v": kv, "cu_seqlens_q": "e", "cu_seqlens_k": "e"}
    return Kernel(args, {"out": q, "lse": "h t"}, heads)


def _flash_attention_varlen_bwd(heads_q: int, heads_k: int) -> Kernel:
    g, heads = _attention_heads(heads_q, heads_k)
    q, kv = "t h d", f"u {g} d"
    args = {"dout": q, "q": q, "k": kv, "v": kv, "out": q, "lse": "h t", "cu_seqlens_q": "e", "cu_seqlens_k": "e"}
    return Kernel(args, {"dq": q, "dk": kv, "dv": kv}, heads)


def _decode_attention_fwd(heads_q: int, heads_k: int, q_ndim: int, paged: bool = False) -> Kernel:
    """Contiguous caches: as flash_attention. Paged caches: the page pool (n pages) is shared by the whole batch (any
    row's block table may point anywhere in it), so the batch stays whole; heads split as _attention_heads says."""
    g, heads = _attention_heads(heads_q, heads_k)
    q = "b s h d" if q_ndim == 4 else "b h d"  # s: the new tokens, whole (causal among them)
    cache = f"{'n' if paged else 'b'} t {g} d"
    args = {"q": q, "k_cache": cache, "v_cache": cache, "cache_seqlens": "b", "block_table": "b m"}
    return Kernel(_present(args, block_table=paged), {"out": q}, heads if paged else ("b", *heads))


def _mla_decode_fwd(paged: bool = False) -> Kernel:
    """Heads freely (the latent cache is one row a position, shared by every head, so it stays whole on each device);
    the batch with contiguous caches, not with a paged pool (shared by the batch, as decode_attention's). lse (B, H)
    follows q."""
    pages = "n" if paged else "b"
    args = {"q_nope": "b h c", "q_pe": "b h r", "kv_c": f"{pages} t c", "k_pe": f"{pages} t r"}
    args |= {"cache_seqlens": "b", "block_table": "b m"}
    return Kernel(_present(args, block_table=paged), {"out": "b h c", "lse": "b h"}, ("h",) if paged else ("b", "h"))


def _dequant_matmul_fwd(zeros: bool = False) -> Kernel:
    """Rows of a and columns of the weights (codes, scales, zeros) and of the output; K (k, its packed words p, its
    groups g) stays whole."""
    args = _present({"a": "m k", "qweight": "p n", "scales": "g n", "zeros": "g n"}, zeros=zeros)
    return Kernel(args, {"out": "m n"}, ("m", "n"))


def _matmul_fwd(bias: bool = False, residual: bool = False) -> Kernel:
    """Rows of a (and of the residual and the output) and columns of b (and of the bias); K stays whole."""
    args = _present({"a": "m k", "b": "k n", "bias": "n", "residual": "m n"}, bias=bias, residual=residual)
    return Kernel(args, {"out": "m n"}, ("m", "n"))


def _fp8_matmul_fwd() -> Kernel:
    """Rows of a (and of its scales and the output); N stays whole (b's scale blocks are 128 columns wide)."""
    args = {"a": "m k", "a_scales": "m j", "b": "n k", "b_scales": "i j"}
    return Kernel(args, {"out": "m n"}, ("m",))


def _fp8_quantize_fwd(block_rows: int = 1) -> Kernel:
    """Rows with per-row scales (block_rows 1); 128-row blocks stay whole (their scales' rows are not x's)."""
    scales = "m j" if block_rows == 1 else "i j"
    return Kernel({"x": "m k"}, {"codes": "m k", "scales": scales}, ("m",) if block_rows == 1 else ())


def _rms_norm_fp8_quantize_fwd(residual: bool = False) -> Kernel:
    """Rows; K stays whole (the norm reduces over it)."""
    args = _present({"x": "m k", "residual": "m k", "weight": "k"}, residual=residual)
    return Kernel(args, {"codes": "m k", "scales": "m j", "h": "m k" if residual else None}, ("m",))


def _swiglu_fp8_quantize_fwd() -> Kernel:
    """Rows; K stays whole (the scales' blocks are 128 columns wide)."""
    return Kernel({"gate": "m k", "up": "m k"}, {"codes": "m k", "scales": "m j"}, ("m",))


# MoE routing: positions index rows of the whole batch (T k of them), so tokens stay whole; the feature dim d splits
# (the gates' gradient then the devices' partial sums over it). The route itself stays whole.
def _moe_route_fwd() -> Kernel:
    return Kernel({"expert_ids": "t j"}, {"positions": "t j", "group_sizes": "e"}, ())


def _moe_permute_fwd() -> Kernel:
    return Kernel({"x": "t d", "positions": "t j"}, {"xs": "s d"}, ("d",))


def _moe_permute_bwd() -> Kernel:
    return Kernel({"dxs": "s d", "positions": "t j"}, {"dx": "t d"}, ("d",))


def _moe_unpermute_fwd() -> Kernel:
    return Kernel({"ys": "s d", "positions": "t j", "weights": "t j"}, {"out": "t d"}, ("d",))


def _moe_unpermute_bwd() -> Kernel:
    args = {"dout": "t d", "ys": "s d", "positions": "t j", "weights": "t j"}
    return Kernel(args, {"dys": "s d", "dweights": "t j"}, ("d",))


# grouped_matmul: group_sizes counts global rows, so the rows stay whole; N (the weights' and the output's columns)
# splits, dx then the devices' partial sums over it
def _grouped_matmul_fwd() -> Kernel:
    return Kernel({"x": "t k", "weights": "e k n", "group_sizes": "e"}, {"out": "t n"}, ("n",))


def _grouped_matmul_bwd() -> Kernel:
    args = {"dy": "t n", "x": "t k", "weights": "e k n", "group_sizes": "e"}
    return Kernel(args, {"dx": "t k", "dweights": "e k n"}, ("n",))


KERNELS: dict[str, Callable[..., Kernel]] = {
    "rms_norm_fwd": _rms_norm_fwd,
    "rms_norm_bwd": _rms_norm_bwd,
    "layer_norm_fwd": _layer_norm_fwd,
    "layer_norm_bwd": _layer_norm_bwd,
    # softmax over the last dim: every other dim is row-local (other dims reach it moved last)
    "softmax_fwd": lambda: _alike(ROWS, "x", "y"),
    "softmax_bwd": lambda: _alike(ROWS, "y dy", "dx"),
    # swiglu is elementwise: every dim, the last one too
    "swiglu_fwd": lambda: _alike(ELLIPSIS, "gate up", "y"),
    "swiglu_bwd": lambda: _alike(ELLIPSIS, "dy gate up", "dgate dup"),
    "apply_rotary_fwd": lambda: _rotary("x", "y"),
    "apply_rotary_bwd": lambda: _rotary("dy", "dx"),
    "cross_entropy_fwd": _cross_entropy_fwd,
    "cross_entropy_bwd": _cross_entropy_bwd,
    "fused_linear_cross_entropy_fwd": _fused_linear_cross_entropy_fwd,
    "fused_linear_cross_entropy_bwd": _fused_linear_cross_entropy_bwd,
    "fused_linear_cross_entropy_scale_": _fused_linear_cross_entropy_scale_,
    "flash_attention_fwd": _flash_attention_fwd,
    "flash_attention_bwd": _flash_attention_bwd,
    "flash_attention_varlen_fwd": _flash_attention_varlen_fwd,
    "flash_attention_varlen_bwd": _flash_attention_varlen_bwd,
    "decode_attention_fwd": _decode_attention_fwd,
    "dequant_matmul_fwd": _dequant_matmul_fwd,
    "matmul_fwd": _matmul_fwd,
    "fp8_matmul_fwd": _fp8_matmul_fwd,
    "fp8_quantize_fwd": _fp8_quantize_fwd,
    "rms_norm_fp8_quantize_fwd": _rms_norm_fp8_quantize_fwd,
    "swiglu_fp8_quantize_fwd": _swiglu_fp8_quantize_fwd,
    "grouped_matmul_fwd": _grouped_matmul_fwd,
    "grouped_matmul_bwd": _grouped_matmul_bwd,
    "mla_decode_fwd": _mla_decode_fwd,
    "moe_route_fwd": _moe_route_fwd,
    "moe_permute_fwd": _moe_permute_fwd,
    "moe_permute_bwd": _moe_permute_bwd,
    "moe_unpermute_fwd": _moe_unpermute_fwd,
    "moe_unpermute_bwd": _moe_unpermute_bwd,
}

# ------------------------------------------------------------------------------------------- public calls' rules


def _public(kernel: Kernel, *outputs: str) -> Split:
    """The rule of a public call that takes its forward kernel's arrays and returns these of its outputs."""
    kept = [name for name in outputs if kernel.outputs[name] is not None]
    reductions = {i: kernel.reductions[name] for i, name in enumerate(kept) if name in kernel.reductions}
    return Split(dict(kernel.args), tuple(kernel.outputs[name] for name in kept), kernel.split, reductions)


def _given(kwargs, name: str) -> bool:
    return kwargs.get(name) is not None


def _softmax(kwargs) -> Split:
    """Every dim but the softmax dim (named n) is row-local."""
    ndim = len(kwargs["x"].shape)
    names = [f"d{i}" for i in range(ndim)]
    if ndim:
        names[kwargs.get("dim", -1) % ndim] = "n"
    spec = " ".join(names)
    return Split({"x": spec}, (spec,), split=tuple(n for n in names if n != "n"))


def _decode_attention(kwargs) -> Split:
    q, k_cache = kwargs["q"].shape, kwargs["k_cache"].shape
    return _public(_decode_attention_fwd(q[-2], k_cache[2], len(q), _given(kwargs, "block_table")), "out")


def _mla_decode(kwargs) -> Split:
    return _public(_mla_decode_fwd(_given(kwargs, "block_table")), "out", *["lse"] * bool(kwargs.get("return_lse")))


RULES: dict[str, Callable[[Mapping[str, Any]], Split]] = {
    "rms_norm": lambda kwargs: _public(_rms_norm_fwd(_given(kwargs, "residual")), "y", "h"),
    "layer_norm": lambda kwargs: _public(_layer_norm_fwd(_given(kwargs, "bias"), _given(kwargs, "residual")), "y", "h"),
    "softmax": _softmax,
    "swiglu": lambda kwargs: _public(KERNELS["swiglu_fwd"](), "y"),
    "apply_rotary": lambda kwargs: _public(KERNELS["apply_rotary_fwd"](), "y"),
    "flash_attention": lambda kwargs: _public(_flash_attention_fwd(kwargs["q"].shape[2], kwargs["k"].shape[2]), "out"),
    "flash_attention_varlen": lambda kwargs: _public(
        _flash_attention_varlen_fwd(kwargs["q"].shape[1], kwargs["k"].shape[1]), "out"
    ),
    "decode_attention": _decode_attention,
    "dequant_matmul": lambda kwargs: _public(_dequant_matmul_fwd(_given(kwargs, "zeros")), "out"),
    "fp8_matmul": lambda kwargs: _public(_fp8_matmul_fwd(), "out"),
    "fp8_quantize": lambda kwargs: _public(_fp8_quantize_fwd(kwargs.get("block_rows", 1)), "codes", "scales"),
    "rms_norm_fp8_quantize": lambda kwargs: _public(
        _rms_norm_fp8_quantize_fwd(_given(kwargs, "residual")), "codes", "scales", "h"
    ),
    "swiglu_fp8_quantize": lambda kwargs: _public(_swiglu_fp8_quantize_fwd(), "codes", "scales"),
    "grouped_matmul": lambda kwargs: _public(_grouped_matmul_fwd(), "out"),
    "matmul": lambda kwargs: _public(_matmul_fwd(_given(kwargs, "bias"), _given(kwargs, "residual")), "out"),
    "mla_decode": _mla_decode,
    "moe_route": lambda kwargs: _public(_moe_route_fwd(), "positions", "group_sizes"),
    "moe_permute": lambda kwargs: _public(_moe_permute_fwd(), "xs"),
    "moe_unpermute": lambda kwargs: _public(_moe_unpermute_fwd(), "out"),
    "cross_entropy": lambda kwargs: _public(_cross_entropy_fwd(kwargs.get("reduction", "mean")), "loss"),
    "fused_linear_cross_entropy": lambda kwargs: _public(
        _fused_linear_cross_entropy_fwd(kwargs.get("reduction", "mean")), "loss"
    ),
}


def rule(op: str, kwargs: Mapping[str, Any]) -> Split:
    """The row-local rule of a call of `op` with these (keyword) arguments."""
    if op not in RULES:
        raise KeyError(f"op {op!r} has no row-local rule: add one to tile_kernels.core.sharding.RULES")
    return RULES[op](kwargs)
