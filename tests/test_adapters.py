"""Framework-specific guarantees of the adapters: JAX jit / vmap-as-one-launch / grad-of-vmap, torch opcheck and
torch.compile, clear device errors, and the import boundaries between core, torch and JAX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
from conftest import DEVICE, needs_torch
from drivers import DRIVERS
from subprocesses import run_python

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
DEVICE_TORCH = "cuda" if DEVICE == "gpu" else "cpu"


# ---------------------------------------------------------------------------------------------------------------- JAX


def _kernel_calls(jaxpr) -> int:
    """Kernel launches in a jaxpr: jax-triton calls on a GPU, host callbacks in interpret mode."""
    text = str(jaxpr)
    return text.count("triton_kernel_call[") + text.count("pure_callback[")


@needs_jax
def test_jax_jit_matches_eager():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    x = jax.random.normal(jax.random.key(0), (4, 33, 96), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (96,), jnp.float32)
    np.testing.assert_array_equal(jax.jit(tk.rms_norm)(x, w), tk.rms_norm(x, w))
    np.testing.assert_array_equal(jax.jit(tk.softmax, static_argnums=1)(x, 1), tk.softmax(x, 1))


@needs_jax
@pytest.mark.parametrize("weight_batched", [False, True])
def test_jax_vmap_is_one_launch_and_matches_a_loop(weight_batched):
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (5, 7, 64), jnp.float32)
    r = jax.random.normal(keys[1], (5, 7, 64), jnp.float32)
    w = jax.random.normal(keys[2], (5, 64) if weight_batched else (64,), jnp.float32)
    w_axis = 0 if weight_batched else None

    def f(x, w, r):
        return tk.rms_norm(x, w, 1e-6, residual=r)

    assert _kernel_calls(jax.make_jaxpr(jax.vmap(f, in_axes=(0, w_axis, 0)))(x, w, r)) == 1
    batched = jax.vmap(f, in_axes=(0, w_axis, 0))(x, w, r)
    for i in range(5):
        single = f(x[i], w[i] if weight_batched else w, r[i])
        for got, want in zip(batched, single):
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)

    b = jax.random.normal(keys[0], (64,), jnp.float32)  # shared bias beside a per-example weight
    ln = jax.vmap(lambda x, w: tk.layer_norm(x, w, b), in_axes=(0, w_axis))
    assert _kernel_calls(jax.make_jaxpr(ln)(x, w)) == 1
    for i in range(5):
        np.testing.assert_allclose(ln(x, w)[i], tk.layer_norm(x[i], w[i] if weight_batched else w, b), atol=1e-5)

    sm = jax.vmap(lambda t: tk.softmax(t, -1))
    assert _kernel_calls(jax.make_jaxpr(sm)(x)) == 1
    np.testing.assert_allclose(sm(x), tk.softmax(x), rtol=1e-6, atol=1e-7)


@needs_jax
@pytest.mark.parametrize("tables_batched", [False, True])
def test_jax_vmap_of_rotary_is_one_launch(tables_batched):
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    x = jax.random.normal(jax.random.key(0), (3, 2, 5, 4, 16), jnp.float32)  # vmapped axis, then (B, S, H, D)
    angles = jax.random.uniform(jax.random.key(1), (3, 5, 8) if tables_batched else (5, 8))
    axes = (0, 0, 0) if tables_batched else (0, None, None)
    f = jax.vmap(lambda x, c, s: tk.apply_rotary(x, c, s, interleaved=True), in_axes=axes)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    assert _kernel_calls(jax.make_jaxpr(f)(x, cos, sin)) == 1
    out = f(x, cos, sin)
    for i in range(3):
        c, s = (cos[i], sin[i]) if tables_batched else (cos, sin)
        np.testing.assert_allclose(out[i], tk.apply_rotary(x[i], c, s, interleaved=True), rtol=1e-6, atol=1e-6)


@needs_jax
def test_jax_per_example_weight_grads_under_vmap():
    """vmap(grad) gives each example its own weight gradient (the batch is folded per problem, not summed)."""
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    x = jax.random.normal(jax.random.key(0), (3, 4, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32,), jnp.float32)

    def loss(x, w):
        return jnp.sum(tk.rms_norm(x, w) * jnp.arange(32.0))

    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(x, w)
    for i in range(3):
        dx, dw = jax.grad(loss, argnums=(0, 1))(x[i], w)
        np.testing.assert_allclose(per_example[0][i], dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(per_example[1][i], dw, rtol=1e-5, atol=1e-6)


@needs_jax
@pytest.mark.skipif(DEVICE != "cpu", reason="interpret mode is the CPU path")
def test_jax_interpret_mode_needs_no_torch():
    out = run_python(
        code="""
        import sys

        class NoTorch:  # any import of torch now fails
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("torch is not installed")

        sys.meta_path.insert(0, NoTorch())
        import jax, jax.numpy as jnp, tile_kernels.jax as tk
        x = jax.random.normal(jax.random.key(0), (3, 40))
        y, h = jax.jit(lambda x: tk.rms_norm(x, jnp.ones(40), residual=x))(x)
        g = jax.grad(lambda x: tk.softmax(x).max())(x)
        print("OK", float(jnp.abs(h - 2 * x).max()), g.shape, "torch" in sys.modules)
        """,
        TRITON_INTERPRET="1",
    )
    assert "OK 0.0 (3, 40) False" in out.stdout, out.stdout + out.stderr


# -------------------------------------------------------------------------------------------------------------- torch


def _torch_device():
    return "cuda" if DEVICE == "gpu" else "cpu"


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = _torch_device()
    # on CPU the ops stay graph nodes under AOT dispatch (torch/_runtime.py), which run the interpreted kernels
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    x = torch.randn(5, 3, 48, device=dev, requires_grad=True)
    w = torch.randn(48, device=dev, requires_grad=True)
    r = torch.randn(5, 3, 48, device=dev, requires_grad=True)
    ops = torch.ops.tile_kernels
    y = torch.softmax(x.detach(), -1)
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-6)
    for op, args in [
        (ops.rms_norm_bwd.default, (torch.randn_like(y), x.detach(), w.detach(), rstd, torch.randn_like(y))),
        (ops.rms_norm_fwd.default, (x, w, r, 1e-6)),
        (ops.rms_norm_fwd.default, (x, w, None, 1e-5)),
        (ops.softmax_fwd.default, (x,)),
        (ops.softmax_bwd.default, (y, torch.randn_like(y))),
        (ops.layer_norm_fwd.default, (x, w, torch.randn_like(w), r, 1e-5)),
        (ops.layer_norm_fwd.default, (x, w, None, None, 1e-5)),
        (ops.rms_norm.default, (x, w, 1e-6, r)),  # the public composite ops
        (ops.layer_norm.default, (x, w, None, 1e-5, r)),
        (ops.softmax.default, (x, 1)),
    ]:
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
def test_torch_compact_plans_are_keyed_by_layout():
    """compact_key: contiguous tensors only (their plan follows from op, shapes, dtypes, device); compact_run stores
    and finds an Executor under it; softmax of a non-contiguous input, after its compact twin, keeps the input's
    shape and values (it takes the general path)."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.torch import _runtime

    x = torch.randn(3, 5, device=DEVICE_TORCH)
    key = _runtime.compact_key(test_torch_compact_plans_are_keyed_by_layout, x)
    assert key == _runtime.compact_key(test_torch_compact_plans_are_keyed_by_layout, torch.randn(3, 5, device=x.device))
    assert key != _runtime.compact_key(test_torch_compact_plans_are_keyed_by_layout, x.double())
    assert _runtime.compact_key(test_torch_compact_plans_are_keyed_by_layout, x, x.t()) is None
    assert _runtime.compact_run(None) is None and _runtime.compact_run(key) is None
    marker = object()
    assert _runtime.compact_run(key, marker) is marker and _runtime.compact_run(key) is marker
    y = torch.randn(5, 3, device=x.device)
    for z in (y.t().contiguous(), y.t()):  # the compact call first, then the transposed view of the same shape
        torch.testing.assert_close(tk.softmax(z), torch.softmax(z, -1))


@needs_torch
def test_torch_compile_fullgraph_matches_eager():
    """Inductor on a GPU; on CPU aot_eager (the ops stay graph nodes that run the interpreted kernels)."""
    import torch

    import tile_kernels.torch as tk

    def block(x, w, r):
        y, h = tk.rms_norm(x, w, 1e-6, residual=r)
        return tk.softmax(y @ y.transpose(-1, -2), -1), h

    dev = _torch_device()
    x = torch.randn(2, 64, 256, device=dev, requires_grad=True)
    w = torch.randn(256, device=dev, requires_grad=True)
    r = torch.randn(2, 64, 256, device=dev)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="inductor" if DEVICE == "gpu" else "aot_eager")
    got, want = compiled(x, w, r), block(x, w, r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    (got[0].sum() + got[1].sum()).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (want[0].sum() + want[1].sum()).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU error path")
@pytest.mark.parametrize(
    "framework, call",
    [("torch", "tk.rms_norm(torch.ones(2, 3), torch.ones(3))"), ("jax", "tk.softmax(jnp.ones((2, 3)))")],
)
def test_cpu_call_without_interpreter_raises_clear_error(framework, call):
    if framework not in DRIVERS:
        pytest.skip(f"{framework} not installed")
    imports = {
        "torch": "import torch, tile_kernels.torch as tk",
        "jax": "import jax.numpy as jnp, tile_kernels.jax as tk",
    }
    attempt = f"try:\n    {call}\nexcept ValueError as e:\n    print('ERR', e)"
    set_late = "import os; os.environ['TRITON_INTERPRET'] = '1'"  # too late: the kernels were defined compiled
    out = run_python(code=f"{imports[framework]}\n{attempt}\n{set_late}\n{attempt}", TRITON_INTERPRET="0")
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERR ")]
    assert len(errors) == 2, out.stdout + out.stderr
    assert "set TRITON_INTERPRET=1 before importing tile_kernels" in errors[0], errors
    assert "TRITON_INTERPRET=1 was set after tile_kernels was imported" in errors[1], errors


@needs_torch
def test_torch_ops_name_an_argument_that_is_not_a_tensor():
    import numpy as np
    import torch

    import tile_kernels.torch as tk

    with pytest.raises(TypeError, match="rms_norm: x must be a torch.Tensor, got ndarray"):
        tk.rms_norm(np.ones((2, 3), np.float32), torch.ones(3))
    with pytest.raises(TypeError, match="softmax: x must be a torch.Tensor, got ndarray"):
        tk.softmax(np.ones((2, 3), np.float32))


@needs_torch
def test_torch_checks_passed_once_still_reject_what_differs():
    """The torch ops check a call signature once (_runtime.validated): an equal scalar of another type, or a tensor
    of another dtype or shape, beside arguments that passed, is still checked."""
    import torch

    import tile_kernels.torch as tk

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    x, w = torch.randn(3, 8, device=dev), torch.randn(8, device=dev)
    tk.rms_norm(x, w, eps=1)
    with pytest.raises(TypeError, match="rms_norm: eps must be a finite number > 0, got True"):
        tk.rms_norm(x, w, eps=True)
    with pytest.raises(ValueError, match="rms_norm: weight must have shape"):
        tk.rms_norm(x, w[:-1], eps=1)
    labels = torch.tensor([0, 1, 2], device=dev)
    tk.cross_entropy(x, labels, ignore_index=1)
    with pytest.raises(TypeError, match="cross_entropy: ignore_index must be an int, got True"):
        tk.cross_entropy(x, labels, ignore_index=True)
    with pytest.raises(TypeError, match="cross_entropy: target must have dtype int32 or int64"):
        tk.cross_entropy(x, labels.float(), ignore_index=1)


@needs_torch
@pytest.mark.skipif(DEVICE != "cpu", reason="simulates the GPU launch path in the interpreter")
def test_torch_bound_launch_gets_each_pointer_as_its_address(monkeypatch):
    """The eager GPU path (_runtime._LaunchStep.run), run on the CPU: an aligned call goes to the bound launcher with
    each pointer as the address of the tensor the plan names (a view of buffer rows at its offset, an absent pointer
    as the launch's written buffer), then the scalars and the constexprs; a call with a misaligned input goes through
    Triton's own launch (here the interpreter), which computes the right result."""
    import inspect
    import types

    import torch
    import triton
    import triton.language as tl

    from tile_kernels.core import Plan
    from tile_kernels.core.plan import BufferSpec, Launch, Rows
    from tile_kernels.torch import _runtime

    @triton.jit
    def scaled_rows(x_ptr, scale, unused_ptr, y_ptr, N: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, N)
        tl.store(y_ptr + row * N + cols, tl.load(x_ptr + row * N + cols) * scale)

    # what the GPU path reads of a compiled (not interpreted) kernel
    scaled_rows.params = [types.SimpleNamespace(name=n, default=p.default)
                          for n, p in inspect.signature(scaled_rows.fn).parameters.items()]  # fmt: skip
    monkeypatch.setattr(_runtime, "_INTERPRETING", False)
    monkeypatch.setattr(_runtime, "_current_device", lambda: 0)
    monkeypatch.setattr(_runtime, "_stream", lambda index: 7)
    launch = Launch(scaled_rows, (2,), reads=("x", 2.0, None), writes=(Rows("y", 1, 3),), constexprs={"N": 8})
    plan = Plan({"x": "float32"}, {"y": BufferSpec((4, 8), "float32", zeroed=True)}, (launch,), ("y",))
    run = _runtime.Executor(plan)
    calls = []
    run.steps[0].bound[(0, True)] = (lambda *args: calls.append(args), "function", "metadata")

    x = torch.randn(2, 8)
    (y,) = run(x, device=torch.device("cpu"))
    view = y[1:3].data_ptr()
    assert calls == [(2, 1, 1, 7, "function", "metadata", None, None, None, x.data_ptr(), 2.0, view, view, 8)]
    assert view == y.data_ptr() + 8 * 4 and not y.any()  # the launch was only recorded

    misaligned = torch.randn(17)[1:].view(2, 8)  # 4 bytes past an allocation
    (y,) = run(misaligned, device=torch.device("cpu"))
    assert len(calls) == 1
    torch.testing.assert_close(y[1:3], misaligned * 2.0, rtol=0, atol=0)
    assert not y[0].any() and not y[3].any()


@needs_torch
@pytest.mark.skipif(DEVICE != "cpu", reason="simulates the GPU trace path in the interpreter")
def test_torch_traced_launch_gives_an_absent_pointer_a_tensor_of_its_own(monkeypatch):
    """The GPU path under torch.compile (_runtime._LaunchStep.trace), run on the CPU: the launch goes to wrap_triton
    with a fresh 1-element tensor for an absent pointer (where torch.compile cannot analyze a kernel it counts every
    pointer as written and functionalizes each separately: a stand-in aliasing the written buffer would put its old
    contents back) and the kernel's PDL constexpr off (a traced launch is a plain one; the gdc calls' inline asm
    would stop that analysis)."""
    import inspect
    import types

    import torch
    import triton
    import triton.language as tl

    from tile_kernels.core import Plan
    from tile_kernels.core.plan import BufferSpec, Launch
    from tile_kernels.torch import _runtime

    @triton.jit
    def scaled(x_ptr, scale, unused_ptr, y_ptr, N: tl.constexpr, PDL: tl.constexpr = False):
        cols = tl.arange(0, N)
        tl.store(y_ptr + cols, tl.load(x_ptr + cols) * scale)

    scaled.params = [types.SimpleNamespace(name=n, default=p.default)
                     for n, p in inspect.signature(scaled.fn).parameters.items()]  # fmt: skip
    launches = []

    def wrap_triton(kernel):
        return {(2, 1, 1): lambda *args, **options: launches.append((kernel, args, options))}  # [grid](...)

    monkeypatch.setattr(_runtime, "_INTERPRETING", False)
    monkeypatch.setattr(_runtime, "wrap_triton", wrap_triton)
    launch = Launch(scaled, (2,), reads=("x", 2.0, None), writes=("y",), constexprs={"N": 8, "PDL": True}, pdl=True)
    plan = Plan({"x": "float32"}, {"y": BufferSpec((8,), "float32")}, (launch,), ("y",))

    class Traced(torch.Tensor):  # not a plain tensor: the Executor traces, as under torch.compile's fake tensors
        pass

    x = torch.randn(8).as_subclass(Traced)
    (y,) = _runtime.Executor(plan)(x, device=torch.device("cpu"))
    [(kernel, args, options)] = launches
    assert kernel is scaled and options == {"N": 8, "PDL": False, "num_warps": 4, "num_stages": 2}
    assert args[0] is x and args[1] == 2.0 and args[3] is y
    assert args[2].numel() == 1 and args[2].untyped_storage().data_ptr() not in (
        x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr())  # fmt: skip


@needs_torch
def test_torch_mixed_devices_raise():
    import torch

    import tile_kernels.torch as tk

    if DEVICE != "gpu":
        pytest.skip("needs a second device kind")
    with pytest.raises(ValueError, match="rms_norm: all tensors must be on one device"):
        tk.rms_norm(torch.ones(2, 3, device="cuda"), torch.ones(3))


# ---------------------------------------------------------------------------------------------------------- packaging


def test_core_imports_neither_torch_nor_jax():
    out = run_python(
        code='import sys, tile_kernels.core; print("LOADED", "torch" in sys.modules, "jax" in sys.modules)'
    )
    assert "LOADED False False" in out.stdout, out.stdout + out.stderr


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(DEVICE != "cpu", reason="packaging is checked by the CPU suite (GPU machines may have no index)")
@pytest.mark.parametrize("extra, forbidden", [("torch", "jax"), ("jax", "torch")])
def test_an_extra_does_not_pull_the_other_framework(extra, forbidden, tmp_path):
    """pip install tile-kernels[torch] must not install jax, and [jax] must not install torch (resolution only)."""
    root = os.path.join(os.path.dirname(__file__), "..")
    report, constraints = tmp_path / "report.json", tmp_path / "constraints.txt"
    # resolve against the frameworks installed here, so that no multi-GB build of them is looked up
    constraints.write_text("\n".join(f"{n}=={v}" for n in ("torch", "jax", "jaxlib") if (v := _installed_version(n))))
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "-c", str(constraints)]
    run = subprocess.run([*pip, "--report", str(report), f"{root}[{extra}]"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "tile-kernels" in names and forbidden not in names and f"{forbidden}lib" not in names, sorted(names)


@pytest.mark.parametrize("framework", sorted(DRIVERS))
def test_numpy_scalar_arguments_are_accepted(framework):
    """Scalars often come out of NumPy configs: an np.int64 ignore_index and np.float32 label_smoothing, softmax_scale
    and softcap give the results of the Python scalars."""
    driver = DRIVERS[framework](DEVICE)
    ops, rng = driver.ops, np.random.default_rng(0)
    logits = driver.array(rng.standard_normal((5, 7)).astype(np.float32))
    target = driver.array(np.array([0, 3, -100, 6, 2], np.int64 if framework == "torch" else np.int32))
    python = ops.cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.25)
    numpy = ops.cross_entropy(logits, target, ignore_index=np.int64(-100), label_smoothing=np.float32(0.25))
    np.testing.assert_allclose(driver.numpy(numpy), driver.numpy(python), rtol=1e-6)
    q, k, v = (driver.array(rng.standard_normal((1, 9, 2, 16)).astype(np.float32)) for _ in range(3))
    python = ops.flash_attention(q, k, v, softmax_scale=0.3, softcap=5.0)
    numpy = ops.flash_attention(q, k, v, softmax_scale=np.float32(0.3), softcap=np.float32(5.0))
    np.testing.assert_allclose(driver.numpy(numpy), driver.numpy(python), rtol=1e-6, atol=1e-7)


@needs_torch
@pytest.mark.skipif(DEVICE != "cpu", reason="runs the kernels in Triton's interpreter")
@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm_backward_with_rows_ahead_matches_float64(monkeypatch, op, residual, ahead):
    """The in-register norm backward with one or two rows' loads in flight (norms.BACKWARD_ROWS_AHEAD: its kernel's
    ROWS_AHEAD), over more rows than programs (each program's prefetch crosses its last row), with and without the
    residual's gradient, against float64."""
    import torch
    import torch.nn.functional as F

    import tile_kernels.torch as tk
    from tile_kernels.core import norms
    from tile_kernels.torch import _runtime

    monkeypatch.setattr(norms, "BACKWARD_ROWS_AHEAD", ahead)
    _runtime._cached_executor.cache_clear()  # plans built with another value
    _runtime._COMPACT_RUNS.clear()
    g = torch.Generator().manual_seed(3)
    rows, n = 301, 96  # more rows than the CPU target's 128 programs: a program takes 2-3
    x, r, dy, dh = (torch.randn(rows, n, generator=g) for _ in range(4))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    wide = [t.double().requires_grad_() for t in (x, r, w, b)]
    for (xx, rr, ww, bb), ours in ((leaves, True), (wide, False)):
        h = xx + rr if residual and not ours else xx
        if ours:
            out = (tk.rms_norm(xx, ww, residual=rr if residual else None) if op == "rms_norm"
                   else tk.layer_norm(xx, ww, bb, residual=rr if residual else None))  # fmt: skip
        else:
            y = F.rms_norm(h, (n,), ww, 1e-6) if op == "rms_norm" else F.layer_norm(h, (n,), ww, bb, 1e-5)
            out = (y, h) if residual else y
        y, hh = out if residual else (out, None)
        loss = (y * dy.to(y.dtype)).sum() + ((hh * dh.to(hh.dtype)).sum() if residual else 0)
        loss.backward()
    _runtime._cached_executor.cache_clear()
    _runtime._COMPACT_RUNS.clear()
    for name, got, want in zip(("x", "residual", "weight", "bias"), leaves, wide, strict=True):
        if want.grad is None:
            continue
        np.testing.assert_allclose(got.grad.numpy(), want.grad.numpy(), rtol=2e-4, atol=2e-4, err_msg=f"d{name}")
