"""Distributed test cases drawn from the registry and the row-local rules (tile_kernels.core.sharding).

For every registered op: option sets (the last value of every option, then each other value one at a time), float32
plus one bfloat16 set; for each, every factor the rule lets split (whose size the devices divide) sharded alone, two
of them at once on a 2-D mesh, and one factor the rule keeps whole (the adapters must gather it: right values, a
visible collective). Shapes are chosen so that most dims divide by 4 devices. Used by distributed_jax.py and
distributed_torch.py; the frameworks' own checks live there."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from test_ops import assert_close

from tile_kernels.core import REGISTRY
from tile_kernels.core import sharding as rules

# ops whose JAX adapter runs vmapped problems one after another (lax.map: GEMM-bound problems gain nothing from one
# launch): lax.map needs the vmapped axis whole, so vmap over a sharded axis is not distributed for them
SEQUENTIAL_VMAP = {
    "dequant_matmul",
    "fp8_matmul",
    "fp8_quantize",
    "fused_linear_cross_entropy",
    "grouped_matmul",
    "matmul",
    "moe_permute",
    "moe_route",
    "moe_unpermute",
    "rms_norm_fp8_quantize",
    "swiglu_fp8_quantize",
}
# ops whose sharded JAX checks deadlock in interpret mode on a CPU: the four host-device callbacks are entered before
# their (gathered) operands are ready and block reading them, or a device's callback misses a collective's
# rendezvous (JAX's CPU runtime, 4 host devices on 2 cores). GPUs run no host callback. Reported as skipped, not run.
CALLBACKS_DEADLOCK_ON_CPU = {"decode_attention", "mla_decode"}
# flash_attention_varlen with 4 heads: packed sequences split only by heads
SHAPES = {"apply_rotary": (4, 8, 4, 16), "cross_entropy": (16, 40), "fused_linear_cross_entropy": (16, 40),
          "flash_attention_varlen": (4, 8, 4, 24)}  # fmt: skip
SHAPE = (4, 8, 24)


@dataclass
class Case:
    op: str
    name: str
    kwargs: dict  # NumPy arrays and attributes, as OpInfo.sample gives them
    rule: rules.Split
    split: dict  # factor -> mesh axis name
    whole: bool = False  # shards a factor the rule keeps whole

    def arrays(self) -> list[str]:
        return [k for k in self.rule.args if self.kwargs.get(k) is not None]

    def dims(self, name: str) -> tuple[str, ...]:
        return rules.dims(self.rule.args[name], self.kwargs[name].ndim)

    def lead(self) -> int:
        return rules.lead_count(self.rule.args, {k: self.kwargs[k].shape for k in self.arrays()})

    def out_dims(self, i: int) -> tuple[str, ...]:
        return rules.output_dims(self.rule.outputs[i], self.lead())

    def axes_of(self, factors) -> list:
        """Per dim: the mesh axis that shards it (None if none)."""
        return [self.split.get(f) for f in factors]

    def grad_args(self) -> list[str]:
        return [k for k in REGISTRY[self.op].grad_args if self.kwargs.get(k) is not None]


def _option_sets(op: str) -> list[dict]:
    options = REGISTRY[op].options
    last = {k: v[-1] for k, v in options.items()}
    return [last] + [{**last, k: x} for k, values in options.items() for x in values[:-1]]


def cases(op: str, devices: int) -> list[Case]:
    info = REGISTRY[op]
    shape = SHAPES.get(op, SHAPE)
    out = []
    sets = [(o, "float32") for o in _option_sets(op)] + [(_option_sets(op)[0], "bfloat16")]
    for index, (options, dtype) in enumerate(sets):
        kwargs = info.sample(np.random.default_rng(index), shape, dtype, **options)
        rule = rules.rule(op, kwargs)
        base = Case(op, "", kwargs, rule, {})
        sizes = {f: kwargs[k].shape[d] for k in base.arrays() for d, f in enumerate(base.dims(k))}
        factors = [f for f in rules.split_factors(rule.split, sizes) if sizes[f] % devices == 0 and sizes[f] > 0]
        tag = ",".join(f"{k}={v}" for k, v in options.items()) + f",{dtype}"
        first = index == 0
        for f in factors if first else factors[:1]:
            out.append(Case(op, f"{tag}|{f}", kwargs, rule, {f: "x"}))
        if first and devices == 4:
            pair = [f for f in rules.split_factors(rule.split, sizes) if sizes[f] % 2 == 0 and sizes[f] > 0][:2]
            if len(pair) == 2:
                out.append(Case(op, f"{tag}|{pair[0]}+{pair[1]}", kwargs, rule, dict(zip(pair, ("x", "y")))))
        whole = [f for f in sizes if f not in rules.split_factors(rule.split, sizes) and sizes[f] % devices == 0]
        if first and whole:
            out.append(Case(op, f"{tag}|{whole[0]} (whole)", kwargs, rule, {whole[0]: "x"}, whole=True))
    return out


def splits_nothing(op: str) -> bool:
    """The op's rule lets no factor split (moe_route's global sort): only its gathered (whole) cases run."""
    kwargs = REGISTRY[op].sample(np.random.default_rng(0), SHAPES.get(op, SHAPE), "float32")
    return not rules.rule(op, kwargs).split


def mesh_shape(case: Case, devices: int) -> dict:
    """Mesh axis sizes: one axis of all devices, or 2 x (devices / 2) for two split factors."""
    return {"x": devices} if len(case.split) == 1 else {"x": 2, "y": devices // 2}


def pieces(case: Case, devices: int):
    """Every device's index along the mesh axes, in row-major device order."""
    shape = mesh_shape(case, devices)
    return [dict(zip(shape, index)) for index in itertools.product(*(range(n) for n in shape.values()))]


def place(case: Case, factors, piece: dict, devices: int, full_shape) -> tuple:
    """Where one device's piece of an array with dims `factors` (and shape full_shape) sits in the whole."""
    shape = mesh_shape(case, devices)
    index = []
    for f, n in zip(factors, full_shape):
        axis = case.split.get(f)
        step = n // shape[axis] if axis else n
        index.append(slice(piece[axis] * step, (piece[axis] + 1) * step) if axis else slice(None))
    return tuple(index)


def local_kwargs(case: Case, piece: dict, devices: int) -> dict:
    """One device's arguments: every array cut along its split factors."""
    kwargs = dict(case.kwargs)
    for name in case.arrays():
        kwargs[name] = case.kwargs[name][place(case, case.dims(name), piece, devices, case.kwargs[name].shape)]
    return kwargs


def dtype_of(case: Case) -> str:
    return case.kwargs.get("out_dtype") or next(str(case.kwargs[k].dtype) for k in case.arrays())


def check(what: str, out: np.ndarray, ref: np.ndarray, case: Case, name: str | None = None) -> None:
    """The suite's tolerance (tests/test_ops.py), in the dtype of `name` (default: the op's input dtype)."""
    dtype = str(case.kwargs[name].dtype) if name else dtype_of(case)
    assert_close(f"{case.op} [{case.name}] {what}", out, ref, dtype)
