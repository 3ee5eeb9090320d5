"""The row-local facts of tile_kernels.core.sharding.KERNELS as DTensor sharding strategies of the kernel-level ops.

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


def _strategies(kernel: sharding.Kernel, args: dict, returns: bool) -> list:
    """(output placements, input placements) pairs for one mesh dim, from the kernel's facts and the op's positional
    arguments by schema name. An argument the facts do not name (an option, an absent optional tensor) has no
    placement; a placeholder (spec None) stays replicated, in and out; an input in `kernel.linear` may stay Partial
    where it lacks the split factor. An op without returns (in place) places its inputs only."""
    specs = {name: kernel.args[name] for name in args if kernel.args.get(name) is not None}
    shapes = {name: tuple(args[name].shape) for name in specs}
    lead = sharding.lead_count(specs, shapes)
    in_dims = {name: sharding.dims(spec, len(shapes[name])) for name, spec in specs.items()}
    outputs = kernel.outputs.values() if returns else ()
    out_dims = [None if spec is None else sharding.output_dims(spec, lead) for spec in outputs]

    def place(name: str, factor: str | None):
        if name not in kernel.args:
            return None
        dims = in_dims.get(name)
        if dims is None or factor is None:
            return Replicate()
        if factor in dims:
            return Shard(dims.index(factor))
        return Partial() if name in kernel.linear else Replicate()

    strategies = [([Replicate()] * len(out_dims), [place(name, None) for name in args])]
    # no strategy splits the rows of a mean (an average of local means is wrong): the public functions sum instead
    split = () if "mean" in kernel.reductions.values() else kernel.split
    for factor in sharding.split_factors(split, [f for dims in in_dims.values() for f in dims]):
        outputs = [Replicate() if d is None else Shard(d.index(factor)) if factor in d else Partial() for d in out_dims]
        strategies.append((outputs, [place(name, factor) for name in args]))
    return strategies


def _values(*names: str) -> Callable:
    """Options passed as the op takes them."""
    return lambda args: {name: args[name] for name in names}


def _given(*names: str) -> Callable:
    """Whether the op was given these optional tensors."""
    return lambda args: {name: args.get(name) is not None for name in names}


def _heads(q: str, k: str) -> Callable:
    """The head counts of q and the keys (each array's next-to-last dim)."""
    return lambda args: dict(heads_q=args[q].shape[-2], heads_k=args[k].shape[-2])


# The options of each op's facts (sharding.KERNELS), read off its arguments by schema name; an op not listed takes
# none. scale_'s gradients are (0, D) placeholders where not asked for.
_OPTIONS = {
    "rms_norm_fwd": _given("residual"),
    "rms_norm_bwd": _given("dh"),
    "layer_norm_fwd": _given("bias", "residual"),
    "layer_norm_bwd": lambda args: dict(bias=args["has_bias"], **_given("dh")(args)),
    "cross_entropy_fwd": _values("reduction"),
    "cross_entropy_bwd": _values("reduction"),
    "fused_linear_cross_entropy_fwd": _values("reduction", "grad_hidden", "grad_weight"),
    "fused_linear_cross_entropy_bwd": _values("grad_hidden", "grad_weight"),
    "fused_linear_cross_entropy_scale_": lambda args: dict(
        reduction=args["reduction"], grad_hidden=args["dhidden"].shape[0] > 0, grad_weight=args["dweight"].shape[0] > 0
    ),
    "flash_attention_fwd": _heads("q", "k"),
    "flash_attention_bwd": _heads("q", "k"),
    "flash_attention_varlen_fwd": _heads("q", "k"),
    "flash_attention_varlen_bwd": _heads("q", "k"),
    "decode_attention_fwd": lambda args: dict(
        **_heads("q", "k_cache")(args), q_ndim=len(args["q"].shape), paged=args["block_table"] is not None
    ),
    "dequant_matmul_fwd": _given("zeros"),
    "matmul_fwd": _given("bias", "residual"),
    "fp8_quantize_fwd": _values("block_rows"),
    "rms_norm_fp8_quantize_fwd": _given("residual"),
    "mla_decode_fwd": lambda args: dict(paged=args["block_table"] is not None),
}


def _register(op, facts: Callable, options: Callable) -> None:
    """Registers as the strategies of `op` its facts: facts(**options(its arguments by name))."""
    names = [argument.name for argument in op._schema.arguments]
    returns = bool(op._schema.returns)

    @register_sharding(op)
    def strategies(*args, **kwargs):
        positional = dict(zip(names, args))
        return _strategies(facts(**options(positional | kwargs)), positional, returns)


def register_rules() -> None:
    """Registers the strategies of every kernel-level op of sharding.KERNELS that the package defines (called by it
    once the ops are defined)."""
    if not AVAILABLE:
        return
    ops = torch.ops.tile_kernels
    for name, facts in sharding.KERNELS.items():
        if hasattr(ops, name):
            _register(getattr(ops, name).default, facts, _OPTIONS.get(name, lambda args: {}))
