"""The row-local facts of tile_kernels.core.sharding.KERNELS, carried into JAX's sharding for the kernel-level calls.

`row_local(op, call, kernel)` wraps a kernel call `call(*arrays) -> list of arrays` whose arrays and outputs the
kernel's facts name dim by dim (factor specs). Arrays sharded along the kernel's split factors stay sharded:
  * sharding in types (a mesh with Explicit axes): the call runs inside a shard_map over the mesh, split factors
    sharded, the rest replicated; an array sharded along another factor is resharded first (a gather, visible in
    the program);
  * jit with NamedSharding inputs (Auto axes): a custom_partitioning whose rule lets XLA keep split factors sharded
    and makes it gather the others; the per-device lowering is the same body as the shard_map's;
  * inside a shard_map, or on one device: the call itself (custom_partitioning lowers to it there).
The per-device body runs the call on the local pieces and sums (psum) every output that lacks a sharded factor (a
norm's dweight); `sharded_body(call, {factor: mesh axes})` may return another body where an op combines its pieces
otherwise (a mean over split rows), or None for the default.
A factor is split only if the mesh axes divide its size evenly: padded pieces would corrupt the sums.

Interpret mode has no custom_partitioning: JAX lowers the per-device body while compiling, after the program's host
callbacks are fixed, so the kernel's callback there would dangle. Under jit with Auto-sharded inputs, interpret-mode
calls therefore stay whole (XLA gathers their inputs: correct, not distributed); shard_map and sharding in types are
fully supported. `PARTITION_IN_INTERPRET_MODE` lets tests compile (never run) the partitioned form on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tile_kernels.core import sharding

from ._runtime import mode, problem_batched

PARTITION_IN_INTERPRET_MODE = False  # tests only: compiling works, running would crash (see above)


@dataclass(frozen=True)
class _Layout:
    """The factors of each input and output dim of one call, the factor sizes and the factors that may split."""

    ins: tuple[tuple[str, ...], ...]
    outs: tuple[tuple[str, ...], ...]
    sizes: dict
    allowed: frozenset

    def rule(self) -> str:
        """The einsum-like sharding rule of the call (for Shardy)."""
        return f"{', '.join(' '.join(f) for f in self.ins)} -> {', '.join(' '.join(f) for f in self.outs)}"

    def whole(self) -> tuple[str, ...]:
        return tuple(f for f in self.sizes if f not in self.allowed)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _padded(spec, ndim: int) -> tuple:
    spec = tuple(spec) if spec is not None else ()
    return spec + (None,) * (ndim - len(spec))


@dataclass(frozen=True)
class _Plan:
    """Which mesh axes shard which factor, and the specs every input and output get."""

    axes: dict  # factor -> mesh axes
    ins: tuple  # PartitionSpec per input
    outs: tuple  # PartitionSpec per output


def _plan(layout: _Layout, specs: Sequence[tuple], axis_sizes: dict) -> _Plan:
    """The first input that shards a split factor decides its axes; the rest follow it, whole otherwise."""
    axes: dict = {}
    used: set = set()
    for factors, spec in zip(layout.ins, specs):
        for factor, entry in zip(factors, spec):
            entry = _axes(entry)
            if not entry or factor not in layout.allowed or factor in axes or used & set(entry):
                continue
            if layout.sizes[factor] % math.prod(axis_sizes[a] for a in entry):
                continue  # uneven pieces would be padded; keep it whole
            axes[factor] = entry
            used |= set(entry)

    def spec_of(factors):
        return P(*(_entry(axes.get(f, ())) for f in factors))

    return _Plan(axes, tuple(spec_of(f) for f in layout.ins), tuple(spec_of(f) for f in layout.outs))


def psum(x, axes):
    """Sums the devices' partial results over `axes`, in fp32 at least (fp16/bf16 partials would lose bits)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def _body(call, layout: _Layout, plan: _Plan, sharded_body):
    """What each device runs on its pieces."""
    if not plan.axes:
        return lambda *local: tuple(call(*local))
    custom = sharded_body(call, plan.axes) if sharded_body is not None else None
    if custom is not None:
        return lambda *local: tuple(custom(*local))

    def body(*local):
        outs = []
        for out, factors in zip(call(*local), layout.outs):
            missing = tuple(a for f, axes in plan.axes.items() if f not in factors for a in axes)
            outs.append(psum(out, missing) if missing else out)
        return tuple(outs)

    return body


def _explicit(array):
    """(mesh, spec) of an array sharded in its type along some mesh axis, else None."""
    aval_sharding = getattr(jax.typeof(array), "sharding", None)
    if aval_sharding is None or getattr(aval_sharding, "mesh", None) is None or aval_sharding.mesh.empty:
        return None
    spec = _padded(aval_sharding.spec, array.ndim)
    return (aval_sharding.mesh, spec) if any(_axes(e) for e in spec) else None


def _shard_mapped(call, layout, sharded_body, arrays, explicit):
    mesh = next(e[0] for e in explicit if e is not None)
    specs = [e[1] if e is not None else (None,) * a.ndim for a, e in zip(arrays, explicit)]
    plan = _plan(layout, specs, dict(mesh.shape))
    arrays = [
        a if _padded(spec, a.ndim) == _padded(want, a.ndim) else jax.sharding.reshard(a, NamedSharding(mesh, want))
        for a, spec, want in zip(arrays, specs, plan.ins)
    ]  # fmt: skip
    # manual over every mesh axis (the call sees plain per-device arrays, even where nothing splits: array ops on
    # Explicit-sharded values inside the call would have to agree on shardings)
    body = _body(call, layout, plan, sharded_body)
    outs = jax.shard_map(body, mesh=mesh, in_specs=plan.ins, out_specs=plan.outs)(*arrays)
    back = _as_given(layout, specs)  # a gathered factor goes back to the axes it came on, as its type said
    same = [_padded(got, o.ndim) == _padded(want, o.ndim) for o, got, want in zip(outs, plan.outs, back)]
    return [o if s else jax.sharding.reshard(o, NamedSharding(mesh, w)) for o, s, w in zip(outs, same, back)]


def _as_given(layout: _Layout, specs: Sequence[tuple]) -> tuple:
    """Output specs with every factor on the mesh axes the first input that sharded it used (a mesh axis at most once
    per spec)."""
    given: dict = {}
    for factors, spec in zip(layout.ins, specs):
        for factor, entry in zip(factors, spec):
            if _axes(entry):
                given.setdefault(factor, _axes(entry))
    out = []
    for factors in layout.outs:
        used: set = set()
        entries = []
        for factor in factors:
            axes = given.get(factor, ())
            entries.append(None if used & set(axes) else _entry(axes))
            used |= set(axes)
        out.append(P(*entries))
    return tuple(out)


def _partitioned(call, layout, sharded_body, arrays):
    def whole(*arrays):
        return tuple(call(*arrays))

    def plan_for(mesh, arg_shapes):
        specs = [
            _padded(s.sharding.spec, len(s.shape)) if isinstance(s.sharding, NamedSharding) else (None,) * len(s.shape)
            for s in arg_shapes
        ]  # fmt: skip
        return _plan(layout, specs, dict(mesh.shape))

    def partition(mesh, arg_shapes, result_shape):
        plan = plan_for(mesh, arg_shapes)
        named = tuple(NamedSharding(mesh, s) for s in plan.outs), tuple(NamedSharding(mesh, s) for s in plan.ins)
        return mesh, _body(call, layout, plan, sharded_body), *named

    def infer(mesh, arg_shapes, result_shape):
        return tuple(NamedSharding(mesh, s) for s in plan_for(mesh, arg_shapes).outs)

    partitioned = custom_partitioning(whole)
    partitioned.def_partition(
        partition, infer_sharding_from_operands=infer, sharding_rule=layout.rule(),
        need_replication_factors=layout.whole(),
    )  # fmt: skip
    return list(partitioned(*arrays))


def _varying_axes(x) -> frozenset:
    """The manual (shard_map) axes x varies over, as its type records them."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # the manual axis types of JAX 0.10; earlier versions name them vma
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _varying(call: Callable) -> Callable:
    """Inside a shard_map, JAX types each value with the manual axes it varies over; a kernel call (a host callback)
    comes back typed invariant, so its outputs are marked to vary over every axis its inputs vary over (else
    gradients fail JAX's type check)."""

    def typed(*arrays, **options):
        vary = frozenset().union(*map(_varying_axes, arrays))
        outs = []
        for out in call(*arrays, **options):
            missing = tuple(sorted(vary - _varying_axes(out)))
            outs.append(jax.lax.pcast(out, missing, to="varying") if missing else out)
        return outs

    return typed


def vary_alike(*arrays):
    """Inside a shard_map, marks the arrays (None passes) to vary over every manual axis any of them varies over: an
    op's custom_vjp then takes a replicated weight beside sharded rows as per-device, returns per-device partial
    gradients for it, and JAX sums them over the devices on the way out (the transpose of the mark). Outside a
    shard_map it returns the arrays unchanged. The public functions apply it before their custom_vjp."""
    vary = frozenset().union(*(_varying_axes(a) for a in arrays if a is not None))

    def mark(a):
        missing = () if a is None else tuple(sorted(vary - _varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(map(mark, arrays))


PROBLEMS, SHARED = "p", "q"  # the problem axis of every call (a vmap folds into it), and that of a shareable argument


def _problems(factors: tuple, shape: tuple, problems: int) -> tuple:
    """A shareable argument (a weight, rotary tables) has one entry for all problems or one per problem: in the
    latter case its leading factor is the problem axis itself, cut with the other arrays'."""
    if factors[:1] == (SHARED,) and shape[0] == problems > 1:
        return (PROBLEMS,) + factors[1:]
    return factors


def row_local(op: str, call: Callable, kernel: sharding.Kernel, sharded_body: Callable | None = None) -> Callable:
    """`call`, which takes the kernel's arrays in its order and returns its outputs but the placeholders, with the
    kernel's row-local rule applied to sharded arrays, as the module docstring describes. Factor p is the problem axis
    a vmap folds into (problems are independent: it may always split); q leads a shareable argument (one entry, or
    one per problem)."""
    ins = tuple(kernel.args.values())
    outs = tuple(spec for spec in kernel.outputs.values() if spec is not None)
    call = _varying(call)

    def wrapped(*arrays):
        shapes = {i: a.shape for i, a in enumerate(arrays)}
        lead = sharding.lead_count(dict(enumerate(ins)), shapes)
        in_dims = tuple(sharding.dims(s, a.ndim) for s, a in zip(ins, arrays, strict=True))
        problems = next((a.shape[0] for d, a in zip(in_dims, arrays) if d[:1] == (PROBLEMS,)), 0)
        in_dims = tuple(_problems(d, a.shape, problems) for d, a in zip(in_dims, arrays))
        sizes = {f: n for factors, a in zip(in_dims, arrays) for f, n in zip(factors, a.shape)}
        allowed = frozenset(sharding.split_factors(kernel.split + (PROBLEMS,), sizes))
        layout = _Layout(in_dims, tuple(sharding.output_dims(s, lead) for s in outs), sizes, allowed)
        explicit = [_explicit(a) for a in arrays]
        if any(e is not None for e in explicit):
            return _shard_mapped(call, layout, sharded_body, arrays, explicit)
        if mode(op) == "gpu" or PARTITION_IN_INTERPRET_MODE:
            return _partitioned(call, layout, sharded_body, arrays)
        return list(call(*arrays))

    return wrapped


def batched_row_local(
    op: str, call: Callable, kernel: sharding.Kernel, shared: tuple[str, ...] = (),
    sharded_body: Callable | None = None,
) -> Callable:  # fmt: skip
    """row_local of a call whose arrays and outputs all lead with the problem axis p, in `problem_batched`'s
    custom_vmap (a vmap folds into p). The arrays named in `shared` lead with q instead (one entry for all problems,
    or one per problem: a weight); the count, one number a problem, is p itself."""

    def led(spec: str | None, axis: str = PROBLEMS) -> str | None:
        return None if spec is None else PROBLEMS if spec == sharding.COUNT else f"{axis} {spec}".rstrip()

    args = {name: led(spec, SHARED if name in shared else PROBLEMS) for name, spec in kernel.args.items()}
    outputs = {name: led(spec) for name, spec in kernel.outputs.items()}
    rule = row_local(op, call, dataclasses.replace(kernel, args=args, outputs=outputs), sharded_body)
    return problem_batched(rule, shareable=tuple(name in shared for name in args))
