"""Every registered op sharded across devices, through JAX (shard_map, sharding in types, jit with NamedSharding) and
torch.distributed (DTensor, FSDP2), against the float64 references and the row-local rules (core.sharding).

The work runs in subprocesses, once per framework per session (distributed_jax.py: XLA needs its 4 CPU devices before
JAX starts; distributed_torch.py: 2 ranks over gloo), grouped on one xdist worker each; the tests here report their
results per op. On a GPU machine (TILE_KERNELS_TEST_DEVICE=gpu) the same scripts use the visible GPUs and NCCL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings

import pytest
from conftest import DEVICE
from drivers import DRIVERS
from sharding_cases import SEQUENTIAL_VMAP, splits_nothing
from subprocesses import ROOTS

from tile_kernels.core import REGISTRY, sharding

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = sorted(REGISTRY)
GPUS = int(os.environ.get("TILE_KERNELS_NUM_GPUS", "0"))
TIMEOUT = 900
# xdist groups: on a CPU the JAX and torch scripts run side by side; on a GPU machine each takes every GPU, so one
# waits for the other
JAX_GROUP = "jax-distributed" if DEVICE == "cpu" else "gpus-distributed"
TORCH_GROUP = "torch-distributed" if DEVICE == "cpu" else "gpus-distributed"


def _environment() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *ROOTS, os.environ.get("PYTHONPATH", "")])}
    # the scripts import the suite's conftest (through test_ops), which pins an xdist worker to one GPU by this name:
    # left in, every subprocess would see GPU 0 only (JAX found one device; torch's rank 1 had no cuda:1 and hung)
    env.pop("PYTEST_XDIST_WORKER", None)
    if DEVICE == "gpu":  # the subprocesses see every GPU (conftest pins this worker to one)
        var = "HIP_VISIBLE_DEVICES" if os.environ.get("TILE_KERNELS_GPU_VENDOR") == "rocm" else "CUDA_VISIBLE_DEVICES"
        env[var] = ",".join(str(i) for i in range(GPUS))
    return env


def _results(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _by_op(results: list[dict], stderr: str) -> dict:
    by_op: dict = {}
    for r in results:
        by_op.setdefault(r["op"], []).append(r)
    by_op["_stderr"] = stderr[-4000:]
    return by_op


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")  # module scope reruns it when xdist interleaves other modules
def jax_results():
    if "jax" not in DRIVERS:
        pytest.skip("jax not installed")
    if DEVICE == "gpu" and GPUS < 2:
        pytest.skip("needs 2 GPUs")
    script = os.path.join(HERE, "distributed_jax.py")
    try:
        done = subprocess.run([sys.executable, script], env=_environment(), capture_output=True, text=True,
                              timeout=TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired as e:  # reported by every test, not rerun by each (a failed fixture would be)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return _by_op(_results(out), f"timed out after {TIMEOUT} s\n" + (e.stderr or b"").decode()[-3000:])
    return _by_op(_results(done.stdout), done.stderr)


@pytest.fixture(scope="session")  # module scope reruns it when xdist interleaves other modules
def torch_results():
    if "torch" not in DRIVERS:
        pytest.skip("torch not installed")
    if DEVICE == "gpu" and GPUS < 2:
        pytest.skip("needs 2 GPUs")
    world, env = 2, _environment()
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world)}
    script = os.path.join(HERE, "distributed_torch.py")
    # each rank writes to files, not pipes: a rank blocked on a full pipe that nobody drains yet would stall the
    # collectives of the other
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(os.path.join(logs, f"{r}.out"), "w+"), open(os.path.join(logs, f"{r}.err"), "w+"))
                 for r in range(world)]  # fmt: skip
        procs = [subprocess.Popen([sys.executable, script], env={**env, "RANK": str(r)}, stdout=out, stderr=err)
                 for r, (out, err) in enumerate(files)]  # fmt: skip
        try:
            for p in procs:
                p.wait(timeout=TIMEOUT)
        finally:
            for p in procs:
                p.kill()
        outs = []
        for out, err in files:
            out.seek(0), err.seek(0)
            outs.append((out.read(), err.read()))
            out.close(), err.close()
    return _by_op([r for out, _ in outs for r in _results(out)], "\n".join(err for _, err in outs))


def _assert_passed(results: dict, op: str, expected_checks: set) -> None:
    got = results.get(op, [])
    failed = [f"[{r['check']} {r['case']}{' rank ' + str(r['rank']) if 'rank' in r else ''}]\n{r['error']}"
              for r in got if not r["ok"]]  # fmt: skip
    assert not failed, f"{len(failed)} of {len(got)} checks failed:\n" + "\n".join(failed)
    for r in got:
        if r["error"].startswith("skipped"):
            warnings.warn(f"{op}: {r['check']} {r['case']} {r['error']}", stacklevel=2)
    assert {r["check"] for r in got} >= expected_checks, (
        f"{op}: ran {sorted({r['check'] for r in got})}, expected {sorted(expected_checks)}; stderr:\n"
        + results["_stderr"]
    )


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_a_row_local_rule(op):
    assert op in sharding.RULES, f"{op}: add its row-local rule to tile_kernels.core.sharding.RULES"


@pytest.mark.xdist_group(JAX_GROUP)
@pytest.mark.parametrize("op", OPS)
def test_jax_sharded(jax_results, op):
    """shard_map over 4 devices (2x2 for two split factors), sharding in types, jit with NamedSharding, and vmap over
    a sharded axis."""
    expected = {"explicit", "auto"} | (set() if splits_nothing(op) else {"shard_map"})
    _assert_passed(jax_results, op, expected | (set() if op in SEQUENTIAL_VMAP else {"vmap"}))


@pytest.mark.skipif("jax" not in DRIVERS or DEVICE != "cpu", reason="jax not installed, or a GPU runs this path anyway")
@pytest.mark.parametrize("op", OPS)
def test_jax_partitioned_calls_on_one_device_match(op):
    """On a GPU every JAX kernel call is wrapped in custom_partitioning; on one device that lowers to the call itself.
    Interpret mode can run that form on one device: jit, eager and gradients match the plain calls exactly."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tile_kernels.jax as tk
    from tile_kernels.jax import _sharding

    info = REGISTRY[op]
    kwargs = info.sample(np.random.default_rng(0), (3, 5, 16), "float32", **{k: v[-1] for k, v in info.options.items()})
    names = [k for k, v in kwargs.items() if isinstance(v, np.ndarray)]
    diff = [k for k in info.grad_args if kwargs.get(k) is not None]

    def objective(*d):
        arrays = {**{k: jnp.asarray(kwargs[k]) for k in names}, **dict(zip(diff, d))}
        outs = getattr(tk, op)(**{**kwargs, **arrays})
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(o.astype(jnp.float32) * (i + 1.5)) for i, o in enumerate(outs))

    def run(partitioned: bool):
        jax.clear_caches()  # traces depend on the switch below
        args = [jnp.asarray(kwargs[k]) for k in diff]
        # an op without a gradient (grad_args empty): its value only
        fn = jax.value_and_grad(objective, argnums=tuple(range(len(diff)))) if diff else lambda: (objective(), ())
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        assert ("custom_partitioning" in jaxpr) == partitioned
        value, grads = jax.jit(fn)(*args)
        return [value, objective(*args), *grads]

    plain = run(False)
    _sharding.PARTITION_IN_INTERPRET_MODE = True
    try:
        partitioned = run(True)
    finally:
        _sharding.PARTITION_IN_INTERPRET_MODE = False
        jax.clear_caches()
    for a, b in zip(plain, partitioned):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.xdist_group(TORCH_GROUP)
@pytest.mark.parametrize("op", OPS)
def test_torch_dtensor(torch_results, op):
    """DTensor inputs sharded along row-local dims, on 2 ranks: no redistribution, right placements and values."""
    _assert_passed(torch_results, op, {"dtensor"})


@pytest.mark.xdist_group(TORCH_GROUP)
def test_torch_fsdp2_llama_step_matches_torch(torch_results):
    """One FSDP2 training step of a tiny Llama-style model from tile-kernels ops equals the torch-ops model's."""
    _assert_passed(torch_results, "fsdp2_llama", {"fsdp2"})
