"""The row-local rules of tile_kernels.core.sharding as DTensor sharding strategies of the kernel-level ops.

Each `tile_kernels::*_fwd` / `*_bwd` op gets, through `register_sharding`, the strategies its rule allows: all
replicated, and for every factor that may split, that factor sharded (Shard of its dim) in every input and output that
carries it, inputs that lack it replicated, and outputs that lack it `Partial` (the local results are partial sums:
a norm's dweight, a summed loss). DTensor picks the strategy that needs no redistribution when the inputs are sharded
along a row-local dim, and redistributes (visibly, by its own rules) otherwise. A mean over rows has no such strategy
(an average of local means is wrong once pieces count different rows): the public `cross_entropy` and
`fused_linear_cross_entropy` compute it from the summed loss and the summed count when given DTensors (one all-reduce
of the count).

FSDP2 needs nothing from here: it gathers parameters into plain tensors before the forward and scatters the gradients
after the backward, so the ops see local tensors. Nothing is registered where torch.distributed is absent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tile_kernels.core import sharding

AVAILABLE = torch.distributed.is_available()

if AVAILABLE:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding


def is_dtensor(t) -> bool:
    return AVAILABLE and isinstance(t, DTensor)


def replicated(t: DTensor) -> DTensor:
    """t made whole on every rank (partial sums added up), once, so that autograd saves the whole value."""
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)


def _strategies(ins: list, outs: list, split: tuple[str, ...], args: tuple, linear: tuple = ()) -> list:
    """(output placements, input placements) pairs for one mesh dim; a spec of None is a non-tensor argument (or an
    absent optional one) among the inputs, and a placeholder output (an empty tensor) that stays replicated. Inputs
    in `linear` (indices) may stay Partial where they lack the split factor: the kernel does not read them, or only
    scales them in place (a partial sum scaled is the scaled sum's part)."""
    shapes = {i: tuple(a.shape) for i, (a, s) in enumerate(zip(args, ins)) if s is not None}
    lead = sharding.lead_count({i: s for i, s in enumerate(ins) if s is not None}, shapes)
    in_dims = [None if s is None else sharding.dims(s, len(shapes[i])) for i, s in enumerate(ins)]
    out_dims = [None if s is None else sharding.output_dims(s, lead) for s in outs]
    strategies = [([Replicate()] * len(outs), [None if d is None else Replicate() for d in in_dims])]
    for factor in sharding.split_factors(split, [f for d in in_dims if d is not None for f in d]):
        out_placements = [
            Replicate() if d is None else Shard(d.index(factor)) if factor in d else Partial() for d in out_dims
        ]  # fmt: skip
        in_placements = [
            None if d is None else Shard(d.index(factor)) if factor in d else Partial() if i in linear else Replicate()
            for i, d in enumerate(in_dims)
        ]  # fmt: skip
        strategies.append((out_placements, in_placements))
    return strategies


def row_local(op, rule: Callable) -> None:
    """Registers `rule(*args) -> (input specs, output specs, split factors[, linear inputs])` (factor specs as in
    core.sharding, one per schema argument and per output) as the DTensor strategies of `op`."""
    if not AVAILABLE:
        return

    @register_sharding(op)
    def strategies(*args, **kwargs):
        ins, outs, split, *linear = rule(*args, **kwargs)
        return _strategies(ins, outs, split, args, *linear)


def _opt(tensor, spec: str):
    return None if tensor is None else spec


def register_rules() -> None:
    """Registers the strategies of every op (called by the package once the ops are defined)."""
    ops = torch.ops.tile_kernels
    rows = ("...",)
    # norms: rows split, the width whole; dweight / dbias lack the rows and come out Partial
    row_local(
        ops.rms_norm_fwd.default,
        lambda x, weight, residual, eps: (
            ["... n", "n", _opt(residual, "... n"), None],
            ["... n", _opt(residual, "... n"), "..."],
            rows,
        ),
    )
    row_local(
        ops.rms_norm_bwd.default,
        lambda dy, h, weight, rstd, dh: (["... n", "... n", "n", "...", _opt(dh, "... n")], ["... n", "n"], rows),
    )
    row_local(
        ops.layer_norm_fwd.default,
        lambda x, weight, bias, residual, eps: (
            ["... n", "n", _opt(bias, "n"), _opt(residual, "... n"), None],
            ["... n", _opt(residual, "... n"), "...", "..."],
            rows,
        ),
    )
    row_local(
        ops.layer_norm_bwd.default,
        lambda dy, h, weight, mean, rstd, dh, has_bias: (
            ["... n", "... n", "n", "...", "...", _opt(dh, "... n"), None],
            ["... n", "n", "n"],
            rows,
        ),
    )
    # softmax over the last dim: every other dim is row-local (other dims reach it moved last)
    row_local(ops.softmax_fwd.default, lambda x: (["... n"], ["... n"], rows))
    row_local(ops.softmax_bwd.default, lambda y, dy: (["... n", "... n"], ["... n"], rows))
    # swiglu is elementwise: every dim
    row_local(ops.swiglu_fwd.default, lambda gate, up: (["...", "..."], ["..."], rows))
    row_local(ops.swiglu_bwd.default, lambda dy, gate, up: (["..."] * 3, ["..."] * 2, rows))
    # rotary: batch, sequence (with the tables cut the same way) and heads; the head dim whole
    for op in (ops.apply_rotary_fwd.default, ops.apply_rotary_bwd.default):
        row_local(op, lambda x, cos, sin, interleaved: (["b s h d", "s e", "s e", None], ["b s h d"], ("b", "s", "h")))

    # cross_entropy: rows split, classes whole; a summed loss and the count (c: its one element) come out Partial;
    # no strategy splits the rows of a mean (the public function sums instead); the backward is row-local given the
    # whole count
    def ce_fwd(logits, target, ignore_index, reduction, label_smoothing):
        loss = "r" if reduction == "none" else ""
        return ["r v", "r", None, None, None], [loss, "r", "c"], () if reduction == "mean" else ("r",)

    def ce_bwd(dloss, logits, target, lse, count, ignore_index, reduction, label_smoothing):
        dloss_spec = "r" if reduction == "none" else ""
        linear = () if reduction == "mean" else (4,)  # only a mean reads the count
        return [dloss_spec, "r v", "r", "r", "c", None, None, None], ["r v"], ("r",), linear

    row_local(ops.cross_entropy_fwd.default, ce_fwd)
    row_local(ops.cross_entropy_bwd.default, ce_bwd)
    if hasattr(ops, "fused_linear_cross_entropy_fwd"):
        _register_fused_linear_cross_entropy(ops)
    if hasattr(ops, "flash_attention_fwd"):
        _register_flash_attention(ops)
    if hasattr(ops, "decode_attention_fwd"):
        _register_decode_attention(ops)
    if hasattr(ops, "mla_decode_fwd"):
        _register_mla_decode(ops)


def _register_flash_attention(ops) -> None:
    """Batch, and heads when q and k/v have as many (core.sharding); lse (B, Hq, Sq) follows q."""

    def specs(q, k):
        mha = q.shape[2] == k.shape[2]
        return "b t h d" if mha else "b t g d", ("b", "h") if mha else ("b",)

    def fwd(q, k, v, *options):
        kv, split = specs(q, k)
        return ["b s h d", kv, kv] + [None] * len(options), ["b s h d", "b h s"], split

    def bwd(dout, q, k, v, out, lse, *options):
        kv, split = specs(q, k)
        ins = ["b s h d", "b s h d", kv, kv, "b s h d", "b h s"] + [None] * len(options)
        return ins, ["b s h d", kv, kv], split

    row_local(ops.flash_attention_fwd.default, fwd)
    row_local(ops.flash_attention_bwd.default, bwd)


def _register_decode_attention(ops) -> None:
    """core.sharding's rule: batch (contiguous caches) and heads when q and the caches have as many; a paged pool is
    shared by the batch, so there only heads split."""

    def fwd(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale):
        rule = sharding.rule("decode_attention", {"q": q, "k_cache": k_cache, "block_table": block_table})
        ins = [rule.args[n] for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
        return ins + [rule.args.get("block_table"), None], list(rule.outputs), rule.split

    row_local(ops.decode_attention_fwd.default, fwd)


def _register_mla_decode(ops) -> None:
    """core.sharding's rule: heads, and the batch with contiguous caches; lse (B, H) follows q."""

    def fwd(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, softmax_scale):
        rule = sharding.rule("mla_decode", {"block_table": block_table, "return_lse": True})
        ins = [rule.args[n] for n in ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens")]
        return ins + [rule.args.get("block_table"), None], list(rule.outputs), rule.split

    row_local(ops.mla_decode_fwd.default, fwd)


def _register_fused_linear_cross_entropy(ops) -> None:
    """Rows split; the weight whole, so dweight comes out Partial; no strategy splits the rows of a mean (the public
    function sums instead). The forward of sum/mean returns the unscaled gradients (placeholders, z, when not asked
    for), which the in-place scale op multiplies as they are placed: dhidden by rows, dweight as partial sums."""

    def fwd(hidden, weight, target, ignore_index, reduction, chunk_size, grad_hidden, grad_weight):
        reduced = reduction != "none"
        grads = ["r k" if reduced and grad_hidden else None, "v k" if reduced and grad_weight else None]
        outs = ["" if reduced else "r", "r", "c", *grads]
        return ["r k", "v k", "r", None, None, None, None, None], outs, () if reduction == "mean" else ("r",)

    def bwd(dloss, hidden, weight, target, lse, ignore_index, chunk_size, grad_hidden, grad_weight):
        ins = ["r", "r k", "v k", "r", "r", None, None, None, None]
        return ins, ["r k" if grad_hidden else None, "v k" if grad_weight else None], ("r",)

    def scale(dloss, count, dhidden, dweight, reduction):
        hidden_spec = "r k" if dhidden.shape[0] else "z k"
        linear = (3,) if dweight.shape[0] else ()
        linear += () if reduction == "mean" else (1,)
        return ["", "c", hidden_spec, "v k" if dweight.shape[0] else "z k", None], [], ("r",), linear

    row_local(ops.fused_linear_cross_entropy_fwd.default, fwd)
    row_local(ops.fused_linear_cross_entropy_bwd.default, bwd)
    row_local(ops.fused_linear_cross_entropy_scale_.default, scale)
