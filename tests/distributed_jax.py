"""Every registered op on JAX devices, sharded as its row-local rule allows (tile_kernels.core.sharding).

Run as a script (tests/test_distributed.py does): on a CPU it gives XLA 4 host devices (XLA_FLAGS, before JAX starts)
and runs the kernels in interpret mode; with TILE_KERNELS_TEST_DEVICE=gpu it uses the visible GPUs (2 or more). For
each case of sharding_cases.py it checks, against the float64 references:
  shard_map  the op inside jax.shard_map: each device's outputs and the gradients (a replicated argument's summed over
             devices) match the reference on that device's pieces; the compiled program has no all-gather,
             all-to-all or collective-permute (the gradient psum of replicated arguments is an all-reduce);
  explicit   jit on arrays sharded in their types (Explicit mesh axes): outputs and gradients match the reference on
             the whole arrays, outputs keep the inputs' sharding, and nothing is gathered unless the case shards a
             factor the rule keeps whole;
  auto       jit on NamedSharding inputs of an Auto mesh (custom_partitioning): the compiled program gathers nothing
             and its outputs keep the sharding; on a GPU it also runs and matches. Interpret mode cannot run it (see
             tile_kernels/jax/_sharding.py), so on a CPU it is compiled only, and a plain run is checked once per op;
  vmap       (once per op) jax.vmap over a leading axis split over the devices, both ways above: the vmapped axis
             folds into the calls' problem axis and stays split; values and gradients per example.
Prints one JSON line per check: {"op", "case", "check", "ok", "error"}. Arguments: op names (default: all).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

DEVICE = os.environ.get("TILE_KERNELS_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("TILE_KERNELS_POISON", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import sharding_cases as sc  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tile_kernels.jax as tk  # noqa: E402
from tile_kernels.core import REGISTRY  # noqa: E402
from tile_kernels.core.registry import round_to, set_bfloat16_rounding  # noqa: E402
from tile_kernels.jax import _sharding  # noqa: E402

if DEVICE == "cpu":
    set_bfloat16_rounding("truncate")  # the interpreter's float32 -> bfloat16 conversion truncates
GATHERS = ("all-gather", "all-to-all", "collective-permute")
DEVICES = 4 if DEVICE == "cpu" else min(len(jax.devices()), 4)


def _tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _np(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _mesh(case, axis_type=None):
    shape = sc.mesh_shape(case, DEVICES)
    devices = np.array(jax.devices()[:DEVICES]).reshape(tuple(shape.values()))
    if axis_type is None:
        return Mesh(devices, tuple(shape))
    return Mesh(devices, tuple(shape), axis_types=(axis_type,) * len(shape))


def _spec(case, factors) -> P:
    return P(*case.axes_of(factors))


def _carries(case) -> list[bool]:
    """Whether each output carries every split factor (it is cut like the inputs) or none (a reduction)."""
    out = []
    for i in range(len(case.rule.outputs)):
        present = [f in case.out_dims(i) for f in case.split]
        assert all(present) or not any(present), f"output {i} carries only some split factors"
        out.append(all(present))
    return out


def _fwd_bwd(case, call):
    """(arrays, cotangents) -> (outputs, gradients of the grad args) for `call(arrays) -> outputs`."""
    diff = case.grad_args()

    def fwd_bwd(arrays, cotangents):
        outs, vjp = jax.vjp(lambda *d: call({**arrays, **dict(zip(diff, d))}), *[arrays[k] for k in diff])
        return outs, vjp(tuple(c.astype(o.dtype) for c, o in zip(cotangents, outs)))  # JAX: the output's dtype

    return fwd_bwd


def _op(case):
    static = {k: v for k, v in case.kwargs.items() if k not in case.arrays()}
    return lambda arrays: _tuple(getattr(tk, case.op)(**static, **arrays))


def _cotangents(case, shapes, seed: int) -> tuple:
    dtype = sc.dtype_of(case)
    rng = np.random.default_rng(seed)
    return tuple(round_to(rng.standard_normal(s), dtype) for s in shapes)


def _no_gathers(what: str, hlo: str) -> None:
    found = [g for g in GATHERS if g in hlo]
    assert not found, f"{what}: the compiled program has {found}"


def check_shard_map(case) -> None:
    mesh = _mesh(case)
    names, carries = case.arrays(), _carries(case)
    everything = tuple(sc.mesh_shape(case, DEVICES))
    in_specs = tuple(_spec(case, case.dims(k)) for k in names)
    out_specs = tuple(_spec(case, case.out_dims(i)) if c else P(everything) for i, c in enumerate(carries))
    op = _op(case)

    def body(*arrays):
        outs = op(dict(zip(names, arrays)))
        return tuple(o if c else o[None] for o, c in zip(outs, carries))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    fwd_bwd = jax.jit(_fwd_bwd(case, lambda arrays: mapped(*[arrays[k] for k in names])))
    arrays = {k: jnp.asarray(case.kwargs[k]) for k in names}
    shapes = [s.shape for s in jax.eval_shape(lambda a: mapped(*[a[k] for k in names]), arrays)]
    cotangents = _cotangents(case, shapes, 1)
    outs, grads = fwd_bwd(arrays, tuple(jnp.asarray(c) for c in cotangents))
    _no_gathers("shard_map", fwd_bwd.lower(arrays, tuple(jnp.asarray(c) for c in cotangents)).compile().as_text())

    info = REGISTRY[case.op]
    expected = [np.zeros(s) for s in shapes]
    expected_grads = {k: np.zeros(case.kwargs[k].shape) for k in case.grad_args()}
    for flat, piece in enumerate(sc.pieces(case, DEVICES)):
        local = sc.local_kwargs(case, piece, DEVICES)
        local_cts = []
        for i, (ref, c) in enumerate(zip(info.reference(**local), carries)):
            where = sc.place(case, case.out_dims(i), piece, DEVICES, shapes[i]) if c else (flat,)
            expected[i][where] = ref
            local_cts.append(cotangents[i][where])
        for k, g in info.reference_vjp(local, tuple(local_cts)).items():
            expected_grads[k][sc.place(case, case.dims(k), piece, DEVICES, case.kwargs[k].shape)] += g
    for i, (out, ref) in enumerate(zip(outs, expected)):
        sc.check(f"shard_map output {i}", _np(out), ref, case)
    for k, g in zip(case.grad_args(), grads):
        sc.check(f"shard_map d{k}", _np(g), expected_grads[k], case, k)


def _check_global(case, what, outs, grads, cotangents) -> None:
    info = REGISTRY[case.op]
    for i, (out, ref) in enumerate(zip(outs, info.reference(**case.kwargs))):
        sc.check(f"{what} output {i}", _np(out), ref, case)
    for k, g in zip(case.grad_args(), grads):
        sc.check(f"{what} d{k}", _np(g), info.reference_vjp(case.kwargs, cotangents)[k], case, k)


def _out_shardings(case) -> list:
    return [_spec(case, case.out_dims(i)) if c else P() for i, c in enumerate(_carries(case))]


def _same(spec, want, ndim) -> bool:
    pad = lambda s: tuple(s) + (None,) * (ndim - len(tuple(s)))  # noqa: E731
    return pad(spec) == pad(want)


def check_explicit(case) -> None:
    mesh = _mesh(case, AxisType.Explicit)
    info = REGISTRY[case.op]
    shapes = [r.shape for r in info.reference(**case.kwargs)]
    cotangents = _cotangents(case, shapes, 2)
    with jax.set_mesh(mesh):
        arrays = {k: jax.device_put(case.kwargs[k], _spec(case, case.dims(k))) for k in case.arrays()}
        cts = tuple(jax.device_put(c, s) for c, s in zip(cotangents, _out_shardings(case)))
        fwd_bwd = jax.jit(_fwd_bwd(case, _op(case)))
        outs, grads = fwd_bwd(arrays, cts)
        hlo = fwd_bwd.lower(arrays, cts).compile().as_text()
    if not case.whole:
        _no_gathers("explicit sharding", hlo)
        for i, (out, want) in enumerate(zip(outs, _out_shardings(case))):
            got = jax.typeof(out).sharding.spec
            assert _same(got, want, out.ndim), f"explicit sharding: output {i} is sharded {got}, expected {want}"
    _check_global(case, "explicit sharding", outs, grads, cotangents)


def check_auto(case, run_whole: bool) -> None:
    mesh = _mesh(case)
    info = REGISTRY[case.op]
    shapes = [r.shape for r in info.reference(**case.kwargs)]
    cotangents = _cotangents(case, shapes, 3)
    arrays = {k: jax.device_put(case.kwargs[k], NamedSharding(mesh, _spec(case, case.dims(k)))) for k in case.arrays()}
    cts = tuple(jax.device_put(c, NamedSharding(mesh, s)) for c, s in zip(cotangents, _out_shardings(case)))
    fwd_bwd = jax.jit(_fwd_bwd(case, _op(case)))
    # compile only (below) on a CPU; the traces made meanwhile must not serve later runs: caches cleared around it
    _sharding.PARTITION_IN_INTERPRET_MODE = DEVICE == "cpu"
    jax.clear_caches()
    try:
        compiled = fwd_bwd.lower(arrays, cts).compile()
    finally:
        _sharding.PARTITION_IN_INTERPRET_MODE = False
        jax.clear_caches()
    if not case.whole:
        _no_gathers("jit with NamedSharding", compiled.as_text())
        out_shardings = compiled.output_shardings[0]
        for i, (s, want) in enumerate(zip(out_shardings, _out_shardings(case))):
            assert _same(s.spec, want, len(shapes[i])), f"jit: output {i} is sharded {s.spec}, expected {want}"
    if DEVICE != "cpu":
        outs, grads = compiled(arrays, cts)
        _check_global(case, "jit with NamedSharding", outs, grads, cotangents)
    elif run_whole:  # interpret mode runs the calls whole (XLA gathers their inputs): still the right values
        outs, grads = jax.jit(_fwd_bwd(case, _op(case)))(arrays, cts)
        _check_global(case, "jit with NamedSharding (interpret mode, calls whole)", outs, grads, cotangents)


def _examples(case, count: int) -> dict:
    """`count` different examples of the case's arrays stacked on a new leading axis: floats scaled, ints rolled
    (but sequence offsets, cu_seqlens_*, which must stay non-decreasing: repeated)."""
    stacked = {}
    for k in case.arrays():
        a = case.kwargs[k]
        if k.startswith("cu_seqlens"):
            stacked[k] = np.stack([a] * count)
        elif a.dtype.kind == "i":
            stacked[k] = np.stack([np.roll(a, i) for i in range(count)])
        else:
            stacked[k] = np.stack([round_to(a.astype(np.float64) * (1 + 0.25 * i), a.dtype.name) for i in range(count)])
    return stacked


def check_vmap(case) -> None:
    """jax.vmap over a leading axis split over the devices (one example each), with sharding in types and under jit
    with NamedSharding: the vmapped axis folds into the calls' problem axis, which splits like rows; no gathers."""
    info, names = REGISTRY[case.op], case.arrays()
    stacked = _examples(case, DEVICES)
    static = {k: v for k, v in case.kwargs.items() if k not in names}
    vmapped = jax.vmap(lambda arrays: _tuple(getattr(tk, case.op)(**static, **arrays)))
    examples = [{**case.kwargs, **{k: stacked[k][i] for k in names}} for i in range(DEVICES)]
    refs = [info.reference(**e) for e in examples]
    cotangents = _cotangents(case, [(DEVICES, *r.shape) for r in refs[0]], 4)
    fwd_bwd = jax.jit(_fwd_bwd(case, vmapped))
    mesh = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:DEVICES])
    with jax.set_mesh(mesh):
        arrays = {k: jax.device_put(v, P("x")) for k, v in stacked.items()}
        cts = tuple(jax.device_put(c, P("x")) for c in cotangents)
        outs, grads = fwd_bwd(arrays, cts)
        _no_gathers("vmap, sharding in types", fwd_bwd.lower(arrays, cts).compile().as_text())
    for i, out in enumerate(outs):
        assert _same(jax.typeof(out).sharding.spec, P("x"), out.ndim), f"vmap: output {i} is not split like the batch"
        sc.check(f"vmap output {i}", _np(out), np.stack([r[i] for r in refs]), case)
    for k, g in zip(case.grad_args(), grads):
        expected = [info.reference_vjp(e, tuple(c[i] for c in cotangents))[k] for i, e in enumerate(examples)]
        sc.check(f"vmap d{k}", _np(g), np.stack(expected), case, k)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("x",))
    arrays = {k: jax.device_put(v, NamedSharding(mesh, P("x"))) for k, v in stacked.items()}
    cts = tuple(jax.device_put(c, NamedSharding(mesh, P("x"))) for c in cotangents)
    _sharding.PARTITION_IN_INTERPRET_MODE = DEVICE == "cpu"  # compile only on a CPU (see check_auto)
    jax.clear_caches()
    try:
        compiled = jax.jit(_fwd_bwd(case, vmapped)).lower(arrays, cts).compile()
    finally:
        _sharding.PARTITION_IN_INTERPRET_MODE = False
        jax.clear_caches()
    _no_gathers("vmap, jit with NamedSharding", compiled.as_text())
    if DEVICE != "cpu":
        outs, _ = compiled(arrays, cts)
        for i, out in enumerate(outs):
            sc.check(f"vmap (jit with NamedSharding) output {i}", _np(out), np.stack([r[i] for r in refs]), case)


def main(ops: list[str]) -> None:
    if DEVICES < 2:  # a one-device mesh would pass every check trivially, or fail them for the wrong reason
        error = f"JAX sees {jax.devices()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): needs 2+"
        for op in ops:
            print(json.dumps({"op": op, "case": "-", "check": "devices", "ok": False, "error": error}), flush=True)
        return
    for op in ops:
        if DEVICE == "cpu" and op in sc.CALLBACKS_DEADLOCK_ON_CPU:
            skipped = "skipped: interpret-mode host callbacks deadlock in JAX's CPU runtime (sharding_cases)"
            for check in ("shard_map", "explicit", "auto", "vmap"):
                print(json.dumps({"op": op, "case": "-", "check": check, "ok": True, "error": skipped}), flush=True)
            continue
        for index, case in enumerate(sc.cases(op, DEVICES)):
            checks = [("explicit", lambda c=case: check_explicit(c))]
            checks.append(("auto", lambda c=case, first=index == 0: check_auto(c, first)))
            if not case.whole:
                checks.insert(0, ("shard_map", lambda c=case: check_shard_map(c)))
            if index == 0 and op not in sc.SEQUENTIAL_VMAP:
                checks.append(("vmap", lambda c=case: check_vmap(c)))
            for name, fn in checks:
                try:
                    fn()
                    result = {"ok": True, "error": ""}
                except Exception as e:  # reported, the next check runs
                    result = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"}
                print(json.dumps({"op": op, "case": case.name, "check": name, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(REGISTRY))
