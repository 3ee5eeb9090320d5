"""Kernel backends (tile_kernels.core.backends): the registry's choices and errors, what the CPU can check of the
TileLang and CUDA C++ kernels (TileLang lowering to CUDA and HIP source, an nvcc build), and on a GPU the framework
guarantees of the compiled backends (torch.compile, opcheck, JAX jit / vmap / grad) beside the Triton kernels. The
numerics of every backend against the float64 references are in test_ops.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import DEVICE, needs_tilelang, needs_torch
from drivers import DRIVERS
from test_flash_attention import assert_torch_compile_matches_eager
from test_ops import assert_close

from tile_kernels.core import backends
from tile_kernels.core import rms_norm as rms_core
from tile_kernels.core.flash_attention_tilelang import BWD_CONFIGS, CONFIGS

COMPILED = ("tilelang", "cuda")
gpu_only = pytest.mark.skipif(DEVICE != "gpu", reason="runs the compiled kernels")


# ------------------------------------------------------------------------------------------------------- registry


def test_rms_norm_has_three_backends_and_defaults_to_the_table_entry():
    assert backends.backends_of("rms_norm") == ("triton", "tilelang", "cuda")
    assert backends.backends_of("softmax") == ("triton",)
    for platform in backends.PLATFORMS:
        assert backends.resolve("rms_norm", None, platform) == backends.DEFAULTS.get(("rms_norm", platform), "triton")
        assert backends.resolve("rms_norm", "triton", platform) == "triton"


@pytest.mark.parametrize(
    "op, backend, platform, match",
    [
        (
            "rms_norm",
            "nope",
            "cuda",
            "rms_norm: backend must be one of 'triton', 'tilelang', 'cuda' or None, got 'nope'",
        ),
        ("rms_norm", 1, "cuda", "backend must be one of .* got 1"),
        ("softmax", "cuda", "cuda", "softmax: backend 'cuda' is not implemented; softmax has triton"),
        ("rms_norm", "tilelang", "cpu", "rms_norm: backend 'tilelang' cannot run on the CPU: .* no interpreter"),
        ("rms_norm", "cuda", "cpu", "rms_norm: backend 'cuda' cannot run on the CPU: .*backend='triton'"),
        ("rms_norm", "cuda", "rocm", "rms_norm: backend 'cuda' cannot run on a rocm device: .*NVIDIA GPUs only"),
    ],
)
def test_unavailable_backends_raise_naming_op_backend_and_reason(op, backend, platform, match):
    with pytest.raises(ValueError, match=match):
        backends.resolve(op, backend, platform)


def test_a_missing_toolchain_is_named(monkeypatch):
    monkeypatch.setattr(backends, "find_cuda_home", lambda: None)
    monkeypatch.setattr(backends, "_missing_modules", lambda *names: [])
    with pytest.raises(backends.BackendUnavailable, match="backend 'cuda' cannot build its kernels here: no CUDA"):
        backends.resolve("rms_norm", "cuda", "cuda")
    monkeypatch.setattr(backends, "_missing_modules", lambda *names: list(names))
    with pytest.raises(backends.BackendUnavailable, match="tilelang, tvm_ffi not installed"):
        backends.resolve("rms_norm", "tilelang", "cuda")
    monkeypatch.setattr(backends, "find_cuda_home", lambda: "/opt/cuda")
    monkeypatch.setattr(backends, "_missing_modules", lambda *names: [n for n in names if n == "jax_tvm_ffi"])
    assert backends.resolve("rms_norm", "tilelang", "cuda") == "tilelang"
    with pytest.raises(backends.BackendUnavailable, match=r"jax_tvm_ffi not installed \(pip install jax-tvm-ffi\)"):
        backends.resolve("rms_norm", "tilelang", "cuda", needs=("jax_tvm_ffi",))  # as the JAX adapter asks


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU error path")
@pytest.mark.parametrize("framework", sorted(DRIVERS))
@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_backends_raise_a_clear_error_on_cpu(framework, backend):
    driver = DRIVERS[framework]("cpu")
    kwargs = rms_core.INFO.sample(np.random.default_rng(0), (3, 8), "float32")
    with pytest.raises(ValueError, match=f"rms_norm: backend '{backend}' cannot run on the CPU"):
        driver.call("rms_norm", {**kwargs, "backend": backend})


def test_compiled_plans_match_the_triton_plans_buffers():
    """Same inputs and outputs as the Triton plans, so that the adapters wire them alike; empty problems launch
    nothing and zero their outputs."""
    from tile_kernels.core import Target, norms

    kw = dict(x_dtype="bfloat16", weight_dtype="float32")
    for backend in COMPILED:
        for fused in (False, True):
            for rows in (0, 5):
                fwd = rms_core.compiled_forward(backend, 2, rows, 7, has_residual=fused, eps=1e-6, arch=90, **kw)
                ref = norms.forward(2, rows, 7, is_rms=True, has_residual=fused, has_bias=False, eps=1e-6,
                                    target=Target(), **kw)  # fmt: skip
                assert dict(fwd.inputs) == dict(ref.inputs) and fwd.outputs == ref.outputs
                assert all(fwd.buffers[o] == ref.buffers[o] for o in fwd.outputs)
                bwd = rms_core.compiled_backward(backend, 2, rows, 7, has_dh=fused, target=Target(), arch=90, **kw)
                ref = norms.backward(2, rows, 7, is_rms=True, has_bias=False, has_dh=fused, target=Target(), **kw)
                assert dict(bwd.inputs) == dict(ref.inputs) and bwd.outputs == ref.outputs
                assert all(bwd.buffers[o] == ref.buffers[o] for o in bwd.outputs)
                assert (len(fwd.launches) == 0) == (rows == 0) == (len(bwd.launches) == 0)


@needs_torch
def test_torch_runs_a_plan_of_calls_through_one_cached_executor():
    """The torch adapters run a plan of TVM-FFI Calls through `_runtime.executor`: built once per arguments, its
    functions loaded at the first run, then each call passes the tensors and the attrs straight to the function."""
    import torch

    from tile_kernels.core import Plan
    from tile_kernels.core.backends import Call
    from tile_kernels.core.plan import BufferSpec
    from tile_kernels.torch._runtime import executor

    loads = []

    def load():
        loads.append(1)
        return lambda x, out, scale: out.copy_(x * scale)

    def build(n: int, scale: float) -> Plan:
        call = Call("scale_copy", load, ("x",), ("out",), {"scale": scale})
        return Plan({"x": "float32"}, {"out": BufferSpec((n,), "float32")}, (call,), ("out",))

    for _ in range(3):
        x = torch.randn(5)
        (out,) = executor(build, 5, 2.5)(x, device=x.device)
        torch.testing.assert_close(out, x * 2.5, rtol=0, atol=0)
    assert len(loads) == 1


# ------------------------------------------------------------------------------------ what the CPU can build


@needs_tilelang
@pytest.mark.parametrize("kernel", ["rms_norm_fwd", "rms_norm_fwd_residual", "rms_norm_bwd", "rms_norm_bwd_dh",
                                    "rms_norm_colsum"])  # fmt: skip
def test_tilelang_kernels_lower_to_cuda_and_hip_source(kernel):
    from tile_kernels.core import rms_norm_tilelang as tl_kernels

    cuda = tl_kernels.lower(kernel, "bfloat16", "float32", tl_kernels.target(90)).kernel_source
    assert f"{kernel}_kernel" in cuda and "__global__" in cuda
    hip = tl_kernels.lower(kernel, "float16", "float16", {"kind": "hip", "mcpu": "gfx942"}).kernel_source
    assert "hip_runtime" in hip and f"{kernel}_kernel" in hip


@pytest.mark.skipif(backends.missing_toolchain("cuda") is not None, reason="no CUDA toolkit / tvm_ffi / ninja")
def test_cuda_kernels_build_for_sm90_without_a_gpu(tmp_path):
    from tile_kernels.core import rms_norm_cuda

    module = rms_norm_cuda.build("bfloat16", "float32", 90, build_directory=str(tmp_path))
    for name in rms_norm_cuda.FUNCTIONS:
        assert callable(getattr(module, name))
    assert any(p.suffix == ".so" for p in tmp_path.iterdir())


# ------------------------------------------------------------------------------------------- on a GPU: torch


@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_torch_strided_weight(backend):
    """A weight that is a strided view (every other element of a buffer) is read by its strides on every backend."""
    import torch

    import tile_kernels.torch as tk

    if backend != "triton" and DEVICE != "gpu":
        pytest.skip("runs the compiled kernels")
    dev = "cuda" if DEVICE == "gpu" else "cpu"
    x, w = torch.randn(3, 40, device=dev), torch.randn(80, device=dev, requires_grad=True)
    y = tk.rms_norm(x, w[::2], backend=backend)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[::2]
    torch.testing.assert_close(y, want)
    (dw,) = torch.autograd.grad(y.sum(), w)
    torch.testing.assert_close(dw, torch.autograd.grad(want.sum(), w)[0])


def _torch_inputs(shape=(4, 33, 1000), dtype="bfloat16", weight_dtype="float32", seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen).to(getattr(torch, dtype))
    r = torch.randn(shape, device="cuda", generator=gen).to(getattr(torch, dtype))
    w = torch.randn(shape[-1], device="cuda", generator=gen).to(getattr(torch, weight_dtype))
    return x, w, r


@gpu_only
@pytest.mark.parametrize("backend", COMPILED)
def test_torch_compiled_backend_matches_triton_with_mixed_dtypes_and_strided_rows(backend):
    """bf16 activations with an fp32 weight (a mixed-precision model), rows with a padded stride, and the gradients:
    the same numbers as the Triton kernels up to fp32 summation order."""
    import torch

    import tile_kernels.torch as tk

    x, w, r = _torch_inputs()
    padded = torch.cat([x, x[..., :5]], dim=-1)
    outs = {}
    for b in ("triton", backend):
        xs, ws, rs = (t.detach().clone().requires_grad_() for t in (padded, w, r))
        y, h = tk.rms_norm(xs[..., :1000], ws, 1e-5, residual=rs, backend=b)  # rows of stride 1005
        (y.float() * torch.linspace(-1, 1, 1000, device="cuda")).sum().backward(retain_graph=True)
        (h.float().square().sum() * 1e-3).backward()
        outs[b] = (y, h, xs.grad[..., :1000], ws.grad, rs.grad)
    for name, got, want in zip(("y", "h", "dx", "dweight", "dresidual"), outs[backend], outs["triton"]):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=name)


@gpu_only
@pytest.mark.parametrize("backend", COMPILED)
def test_torch_compile_fullgraph_with_a_compiled_backend(backend):
    import torch

    import tile_kernels.torch as tk

    x, w, r = (t.float().requires_grad_() for t in _torch_inputs((2, 64, 256)))

    def block(x, w, r):
        y, h = tk.rms_norm(x, w, 1e-6, residual=r, backend=backend)
        return torch.softmax(y @ y.transpose(-1, -2), -1), h

    torch._dynamo.reset()
    got, want = torch.compile(block, fullgraph=True)(x, w, r), block(x, w, r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    grads = torch.autograd.grad(sum(t.sum() for t in got), (x, w, r))
    for a, b in zip(grads, torch.autograd.grad(sum(t.sum() for t in want), (x, w, r))):
        torch.testing.assert_close(a, b)


@gpu_only
@pytest.mark.parametrize("backend", COMPILED)
def test_torch_opcheck_with_a_compiled_backend(backend):
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    x, w, r = (t.float().requires_grad_() for t in _torch_inputs((5, 3, 48)))
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-6)
    ops = torch.ops.tile_kernels
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in [
        (ops.rms_norm_fwd.default, (x, w, r, 1e-6, backend)),
        (ops.rms_norm_fwd.default, (x, w, None, 1e-5, backend)),
        (ops.rms_norm_bwd.default, (torch.randn_like(x), x.detach(), w.detach(), rstd, None, backend)),
        (ops.rms_norm_fwd_compiled.default, (x.detach(), w.detach(), r.detach(), 1e-6, backend)),
        (ops.rms_norm.default, (x, w, 1e-6, r, backend)),
    ]:
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


# --------------------------------------------------------------------------------------------- on a GPU: JAX


@gpu_only
@pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
@pytest.mark.parametrize("backend", COMPILED)
def test_jax_jit_vmap_grad_with_a_compiled_backend(backend):
    """One FFI call per kernel under vmap (per-example weights folded into the launch), the same values as the
    Triton kernels under jit, and grad through custom_vjp."""
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (5, 7, 300), jnp.float32)
    r = jax.random.normal(keys[1], (5, 7, 300), jnp.float32)
    w = jax.random.normal(keys[2], (5, 300), jnp.float32)

    def f(x, w, r, b):
        return tk.rms_norm(x, w, 1e-6, residual=r, backend=b)

    batched = jax.vmap(lambda x, w, r: f(x, w, r, backend))
    assert str(jax.make_jaxpr(batched)(x, w, r)).count("ffi_call[") == 1
    got = jax.jit(batched)(x, w, r)
    want = jax.vmap(lambda x, w, r: f(x, w, r, "triton"))(x, w, r)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def loss(x, w, b):
        y, h = f(x, w, r[0], b)
        return jnp.sum(y * jnp.arange(300.0)) + jnp.sum(h**2)

    for a, b in zip(jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(x[0], w[0], backend),
                    jax.grad(loss, (0, 1))(x[0], w[0], "triton")):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- flash_attention's TileLang forward


def test_flash_attention_defaults_to_tilelang_on_sm90_where_it_measured_faster_and_can_run():
    """TileLang on sm_90 at head dim 128, and at 64 when a backward follows (its forward alone is slower there)."""
    from tile_kernels.core import flash_attention as fa_core

    assert backends.backends_of("flash_attention") == ("triton", "tilelang")
    for backward in (False, True):
        for dtype in ("bfloat16", "float16"):
            assert fa_core.preferred_backend(90, dtype, 128, backward) == "tilelang"
            assert fa_core.preferred_backend(90, dtype, 64, backward) == ("tilelang" if backward else "triton")
        # arch 0: not a CUDA device
        others = [(90, "float32", 128), (90, "float32", 64), (90, "bfloat16", 96), (90, "bfloat16", 256),
                  (80, "float16", 128), (80, "float16", 64), (0, "float16", 128)]  # fmt: skip
        for arch, dtype, head_dim in others:
            assert fa_core.preferred_backend(arch, dtype, head_dim, backward) == "triton", (arch, dtype, head_dim)
    for platform in backends.PLATFORMS:
        assert backends.resolve("flash_attention", None, platform) == "triton"
        expected = "tilelang" if backends.unavailable("tilelang", platform) is None else "triton"  # else falls back
        assert backends.resolve("flash_attention", None, platform, preferred="tilelang") == expected
    assert backends.resolve("flash_attention", None, "cpu", preferred="cuda") == "triton"  # not one of its backends


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_adapters_ask_the_ops_preferred_backend_on_cuda_only(monkeypatch, framework):
    """Both adapters' resolve_backend: backend=None on a CUDA device calls the op's preferred_backend with the compute
    capability and the call's dims and takes its answer (Triton here, runnable everywhere); on the CPU and for an
    explicit backend it is not asked."""
    pytest.importorskip(framework)
    calls = []

    def preferred(arch, *dims):
        calls.append((arch, *dims))
        return "triton"

    if framework == "torch":
        import torch

        from tile_kernels.torch import _calls

        monkeypatch.setattr(_calls, "cuda_arch", lambda device: 90)
        monkeypatch.setattr(_calls, "platform", lambda device: device.type)
        resolve = functools.partial(_calls.resolve_backend, "flash_attention")
        on_cpu, on_cuda = (torch.device("cpu"),), (torch.device("cuda"),)
    else:
        from tile_kernels.jax import _calls

        monkeypatch.setattr(_calls, "cuda_arch", lambda: 90)
        on_cuda, on_cpu = (), ()
        resolve = functools.partial(_calls.resolve_backend, "flash_attention")
        monkeypatch.setattr(_calls, "platform", lambda op: where[0])
    where = ["cuda"]
    assert resolve(None, *on_cuda, preferred, "bfloat16", 128) == "triton"
    assert calls == [(90, "bfloat16", 128)]
    assert resolve("triton", *on_cuda, preferred, "bfloat16", 128) == "triton"
    where[0] = "cpu"
    assert resolve(None, *on_cpu, preferred, "bfloat16", 128) == "triton"
    assert calls == [(90, "bfloat16", 128)]


def test_the_bench_times_each_flash_attention_backend_beside_the_default():
    from tile_kernels.core.bench import other_backends

    rows = list(other_backends("flash_attention", lambda **kwargs: None, "cuda"))
    assert rows == ["tile-kernels[triton]", "tile-kernels[tilelang]"]


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU error path")
@pytest.mark.parametrize("framework", sorted(DRIVERS))
def test_flash_attention_tilelang_raises_a_clear_error_on_cpu(framework):
    from tile_kernels.core import flash_attention as fa_core

    kwargs = fa_core.INFO.sample(np.random.default_rng(0), (2, 64), "bfloat16")
    with pytest.raises(ValueError, match="flash_attention: backend 'tilelang' cannot run on the CPU: .*no interpreter"):
        DRIVERS[framework]("cpu").call("flash_attention", {**kwargs, "backend": "tilelang"})


def test_flash_attention_tilelang_names_what_it_cannot_run():
    """float32 (its GEMMs would run in TF32) and head dims past 256 raise, naming the backend, the dtype and the way
    out; the test suite's filter (backends.unsupported_inputs) says the same of a call's arguments."""
    from tile_kernels.core import flash_attention as fa_core

    with pytest.raises(ValueError, match="flash_attention: backend 'tilelang' supports q, k, v in float16 / bfloat16 "
                       "only .*got float32; backend='triton' runs it"):  # fmt: skip
        fa_core.check_backend("tilelang", "float32", 64)
    with pytest.raises(ValueError, match="head dims up to 256, got 320"):
        fa_core.check_backend("tilelang", "bfloat16", 320)
    fa_core.check_backend("tilelang", "float16", 40)
    fa_core.check_backend("triton", "float32", 40)
    kwargs = fa_core.INFO.sample(np.random.default_rng(0), (2, 64), "float32")
    assert "float32" in backends.unsupported_inputs("flash_attention", "tilelang", kwargs)
    kwargs = fa_core.INFO.sample(np.random.default_rng(0), (2, 64), "bfloat16")
    assert backends.unsupported_inputs("flash_attention", "tilelang", kwargs) is None
    assert backends.unsupported_inputs("rms_norm", "tilelang", kwargs) is None


@pytest.mark.parametrize("head_dim, kernel", [(64, "flash_fwd_d64"), (40, "flash_fwd_d64_pad"),
                                              (1, "flash_fwd_d64_pad"), (128, "flash_fwd_d128"),
                                              (96, "flash_fwd_d128_pad"), (256, "flash_fwd_d256"),
                                              (200, "flash_fwd_d256_pad")])  # fmt: skip
def test_flash_attention_tilelang_plan_matches_the_triton_forward(head_dim, kernel):
    """The same inputs, outputs and buffers as the Triton forward (its backward reads them); one call with the
    window as runtime ints; the kernel picked by head-dim bucket (padded or not) and softcap; an empty problem calls
    nothing, and Sk = 0 calls the kernel that writes out = 0, lse = +inf."""
    from tile_kernels.core import Target
    from tile_kernels.core import flash_attention as fa_core

    for seqlen_q, seqlen_k, softcap in ((33, 70, 0.0), (33, 70, 2.0), (0, 5, 0.0), (9, 0, 0.0)):
        opts = dict(dtype="bfloat16", causal=True, window=(7, -1), scale=None, softcap=softcap)
        plan = fa_core.compiled_forward("tilelang", 2, seqlen_q, seqlen_k, 6, 3, head_dim, arch=90, **opts)
        ref = fa_core.forward(2, seqlen_q, seqlen_k, 6, 3, head_dim, target=Target(), **opts)
        assert dict(plan.inputs) == dict(ref.inputs) and plan.outputs == ref.outputs == ("out", "lse")
        assert all(plan.buffers[o].shape == ref.buffers[o].shape for o in plan.outputs)
        assert all(plan.buffers[o].dtype == ref.buffers[o].dtype for o in plan.outputs)
        if seqlen_q == 0:
            assert plan.launches == () and all(b.zeroed for b in plan.buffers.values())
            continue
        (call,) = plan.launches
        assert call.writes == ("out", "lse") and not any(b.zeroed for b in plan.buffers.values())
        if seqlen_k == 0:
            assert call.reads == () and call.key == "tile_kernels_tilelang_flash_fwd_no_keys_bfloat16_sm90"
            continue
        assert call.reads == ("q", "k", "v")
        assert call.key == f"tile_kernels_tilelang_{kernel}{'_softcap' if softcap else ''}_bfloat16_sm90"
        assert call.attrs == dict(scale=fa_core.default_scale(head_dim), softcap=softcap or 1.0, left=7, right=0)


@gpu_only
@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window, softcap",
    [
        (2, 1000, 1000, 8, 2, 128, False, (-1, -1), 0.0),  # several key blocks, a ragged last one, GQA 4
        (1, 777, 1500, 4, 4, 128, True, (-1, -1), 0.0),  # bottom-right causal, Sq < Sk
        (2, 300, 130, 6, 3, 64, True, (-1, -1), 0.0),  # Sq > Sk: the first rows (whole blocks) see no key
        (1, 513, 513, 2, 1, 64, False, (100, 20), 0.0),  # a band narrower than a block
        (1, 257, 300, 2, 2, 256, True, (-1, -1), 30.0),  # the 256 bucket, softcap
        (2, 190, 190, 3, 1, 40, False, (-1, 3), 5.0),  # a padded head dim (no TMA)
        (1, 70, 70, 2, 2, 128, False, (0, 0), 0.0),  # each row sees one key
        (1, 1, 1, 1, 1, 64, True, (-1, -1), 0.0),
        (1, 5, 0, 2, 1, 64, False, (-1, -1), 0.0),  # no keys at all
    ],
)
def test_torch_flash_attention_tilelang_matches_triton(
    dtype, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window, softcap
):  # fmt: skip
    """The TileLang forward's out and lse (base 2, +inf where a row sees no key) against the Triton forward's, and the
    gradients through the Triton backward from the TileLang (out, lse) against those of the float64 reference."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.core import flash_attention as fa_core

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + seqlen_k)

    def draw(s, h):
        return torch.randn(batch, s, h, head_dim, device="cuda", generator=gen).to(torch_dtype)

    q, k, v = draw(seqlen_q, heads_q), draw(seqlen_k, heads_k), draw(seqlen_k, heads_k)
    ops = torch.ops.tile_kernels
    scale = head_dim**-0.5
    options = (causal, *window, scale, softcap)
    out, lse = ops.flash_attention_fwd(q, k, v, *options, "tilelang")
    want_out, want_lse = ops.flash_attention_fwd(q, k, v, *options, "triton")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[~torch.isinf(lse)], want_lse[~torch.isinf(want_lse)], rtol=0, atol=2e-3)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = tk.flash_attention(*leaves, causal=causal, window=window, softcap=softcap, backend="tilelang")
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    dout = torch.randn(got.shape, device="cuda", generator=gen).to(torch_dtype)
    grads = torch.autograd.grad(got, leaves, dout)
    arrays = [t.float().cpu().numpy() for t in (q, k, v)]
    kwargs = dict(q=arrays[0], k=arrays[1], v=arrays[2], causal=causal, window=window, softmax_scale=None,
                  softcap=softcap)  # fmt: skip
    assert_close("out", out.double().cpu().numpy(), fa_core.reference(**kwargs)[0], dtype)  # the suite's rule
    ref_grads = fa_core.reference_vjp(kwargs, (dout.float().cpu().numpy(),))
    for name, grad in zip("qkv", grads):
        assert_close(f"d{name}", grad.double().cpu().numpy(), ref_grads[name], dtype)


def test_flash_attention_program_chunks_divide_the_groups_and_fit_l2():
    """The grid's chunk of groups: a divisor of the groups, the largest whose operands fit L2_CHUNK_BYTES (1 when even
    one does not), never leaving more than 65535 chunks (a grid dimension)."""
    from tile_kernels.core import flash_attention as fa_core

    mib = 2**20
    assert fa_core.program_chunk(12, mib) == 12 and fa_core.program_chunk(12, 10 * mib) == 6
    assert fa_core.program_chunk(12, 70 * mib) == 1 and fa_core.program_chunk(131, 2**10) == 131
    assert fa_core.program_chunk(131, 2 * mib) == 1 and fa_core.program_chunk(2 * 65537, 40 * mib) == 65537
    for groups in (1, 7, 96, 1000, 4096):
        for group_bytes in (1, 3 * mib, 64 * mib):
            chunk = fa_core.program_chunk(groups, group_bytes)
            assert groups % chunk == 0 and (chunk == 1 or chunk * group_bytes <= fa_core.L2_CHUNK_BYTES)
            bigger = range(chunk + 1, groups + 1)
            assert not any(groups % c == 0 and c * group_bytes <= fa_core.L2_CHUNK_BYTES for c in bigger)
    # Llama-3.2-1B's attention (B 4, S 2048, 32 / 8 heads of 64): the TileLang backward's 32 key/value groups (4 MiB
    # of q, dO and the dQ accumulator each) in chunks of 16; not causal, or on a grid past LPT_MAX_PROGRAMS: 1
    assert (
        fa_core.key_chunk(4, 2048, 32, 8, 64, 16, False, True) == 1 == fa_core.key_chunk(4, 8192, 32, 32, 128, 64, True)
    )
    assert fa_core.key_chunk(4, 2048, 32, 8, 64, 16, True, accumulator=True) == 16


def test_flash_attention_tilelang_backward_plan_matches_the_triton_backward():
    """The same inputs and outputs as the Triton backward: delta (and lse with rows padded to whole query blocks), the
    dK / dV kernel with dQ summed in place into a zeroed fp32 accumulator (read and written by one call), dQ from it;
    head dims past 128 keep the Triton backward (a clear error if asked for directly); an empty problem calls
    nothing."""
    from tile_kernels.core import Target
    from tile_kernels.core import flash_attention as fa_core
    from tile_kernels.core import flash_attention_tilelang as fa_tl

    for head_dim, kernel in ((64, "flash_bwd_d64"), (40, "flash_bwd_d64_pad"), (128, "flash_bwd_d128"),
                             (96, "flash_bwd_d128_pad")):  # fmt: skip
        for seqlen_q, seqlen_k, softcap in ((33, 70, 0.0), (33, 70, 2.0), (0, 5, 0.0), (9, 0, 0.0)):
            opts = dict(dtype="float16", causal=True, window=(7, -1), scale=None, softcap=softcap)
            plan = fa_core.compiled_backward("tilelang", 2, seqlen_q, seqlen_k, 6, 3, head_dim, arch=90, **opts)
            ref = fa_core.backward(2, seqlen_q, seqlen_k, 6, 3, head_dim, target=Target(), **opts)
            assert dict(plan.inputs) == dict(ref.inputs) and plan.outputs == ref.outputs == ("dq", "dk", "dv")
            assert all(plan.buffers[o].shape == ref.buffers[o].shape for o in plan.outputs)
            assert all(plan.buffers[o].dtype == ref.buffers[o].dtype for o in plan.outputs)
            block_m = fa_tl.BWD_CONFIGS["sm90"][fa_tl.bucket(head_dim)][0][0]
            rows = -(-seqlen_q // block_m) * block_m
            assert plan.buffers["dq_acc"].shape == (2, 6, rows, fa_tl.bucket(head_dim))
            assert plan.buffers["dq_acc"].zeroed and plan.buffers["lse_pad"].shape == (2, 6, rows)
            if seqlen_q == 0 or seqlen_k == 0:
                assert plan.launches == () and all(plan.buffers[o].zeroed for o in plan.outputs)
                continue
            pre, main, post = plan.launches
            assert (pre.reads, pre.writes) == (("out", "dout", "lse"), ("delta", "lse_pad"))
            assert pre.key == f"tile_kernels_tilelang_{kernel.replace('bwd', 'bwd_pre')}_float16_sm90"  # D static
            assert post.key == f"tile_kernels_tilelang_{kernel.replace('bwd', 'bwd_post')}_float16_sm90"
            assert main.reads == ("q", "k", "v", "dout", "lse_pad", "delta", "dq_acc")
            assert main.writes == ("dk", "dv", "dq_acc")
            assert main.key == f"tile_kernels_tilelang_{kernel}{'_softcap' if softcap else ''}_float16_sm90"
            # the 6 (key/value head, batch entry) groups stream less than L2 holds: one chunk
            assert main.attrs == dict(scale=fa_core.default_scale(head_dim), softcap=softcap or 1.0, left=7, right=0,
                                      chunk=6)  # fmt: skip
            assert (post.reads, post.writes, post.attrs) == (("dq_acc",), ("dq",), {"scale": main.attrs["scale"]})
    assert fa_tl.backward_unsupported("bfloat16", 128) is None
    assert "sm_90a only, got sm_80" in fa_tl.backward_unsupported("bfloat16", 128, 80)
    assert len(fa_tl.sm90_variants(["float16", "bfloat16", "float32"])) == 2 * 16
    assert fa_core.compiled_backward_unsupported("triton", "float32", 256) is None
    assert "head dims up to 128, got 200" in fa_tl.backward_unsupported("bfloat16", 200)
    assert fa_core.compiled_backward_unsupported("tilelang", "bfloat16", 128) is None  # autograd takes it
    with pytest.raises(ValueError, match="flash_attention: backend 'tilelang' backward supports head dims up to 128, "
                       "got 256; its forward runs with the Triton backward"):  # fmt: skip
        fa_core.compiled_backward("tilelang", 1, 8, 8, 1, 1, 256, dtype="bfloat16", causal=False, window=(-1, -1),
                                  scale=None, softcap=0.0, arch=90)  # fmt: skip
    assert fa_tl.kernel_name(128, True, "bwd", 2) == "flash_bwd_d128_softcap_c2"
    assert fa_tl._parse("flash_bwd_d64_pad_softcap_c1") == (64, False, True, 1)


@needs_tilelang
def test_tilelang_flash_attention_backward_lowers_to_hopper_code():
    """The head-dim-64 backward for sm_90a: TMA loads, wgmma with P^T / dS^T from registers, the dQ tile as one TMA
    reduce-add, and warp specialization (producer registers released, consumers' raised)."""
    lower = backends.module("flash_attention", "tilelang").lower
    source = lower("flash_bwd_d64", "bfloat16", "bfloat16", {"kind": "cuda", "arch": "sm_90a"}).kernel_source
    wanted = ("tl::tma_load(", "wgmma_ss<", "wgmma_rs<", "tl::tma_store_add(", "warpgroup_reg_alloc",
              "warpgroup_reg_dealloc")  # fmt: skip
    assert [w for w in wanted if w not in source] == []
    # its pre kernel with the head dim static: 16-byte loads, a row's delta summed over the 8 threads holding it
    pre = lower("flash_bwd_pre_d64", "bfloat16", "bfloat16", {"kind": "cuda", "arch": "sm_90a"}).kernel_source
    assert "*(uint4*)(OUT" in pre and "AllReduce<tl::SumOp, 8," in pre and "__syncthreads" not in pre
    pad = lower("flash_bwd_pre_d64_pad", "bfloat16", "bfloat16", {"kind": "cuda", "arch": "sm_90a"}).kernel_source
    assert "int D," in pad  # a padded head dim: the dynamic kernel


@gpu_only
@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window, softcap",
    [
        (2, 1000, 1000, 8, 2, 128, False, (-1, -1), 0.0),  # several key blocks, a ragged last one, GQA 4
        (1, 777, 1500, 4, 4, 128, True, (-1, -1), 0.0),  # bottom-right causal, Sq < Sk
        (2, 300, 130, 6, 3, 64, True, (-1, -1), 0.0),  # Sq > Sk: the first rows (whole blocks) see no key
        (1, 513, 513, 2, 1, 64, False, (100, 20), 0.0),  # a band narrower than a block, MQA
        (1, 257, 300, 2, 2, 128, True, (-1, -1), 30.0),  # softcap
        (2, 190, 190, 3, 1, 40, False, (-1, 3), 5.0),  # a padded head dim (no TMA), softcap
        (1, 333, 129, 4, 2, 96, True, (50, -1), 0.0),  # the padded 128 bucket, windowed causal
        (1, 70, 70, 2, 2, 128, False, (0, 0), 0.0),  # each row sees one key
        (3, 1, 1, 1, 1, 64, True, (-1, -1), 0.0),
        (1, 5, 0, 2, 1, 64, False, (-1, -1), 0.0),  # no keys at all: dq = 0
    ],
)
def test_torch_flash_attention_tilelang_backward_matches_reference(
    dtype, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window, softcap
):  # fmt: skip
    """The TileLang backward's dq, dk, dv (the _bwd_compiled op) against the float64 reference (the suite's tolerance
    rule), beside the Triton backward's from the same (out, lse), and as autograd runs it."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.core import flash_attention as fa_core

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 11 + seqlen_k + head_dim)

    def draw(s, h):
        return torch.randn(batch, s, h, head_dim, device="cuda", generator=gen).to(torch_dtype)

    q, k, v = draw(seqlen_q, heads_q), draw(seqlen_k, heads_k), draw(seqlen_k, heads_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = tk.flash_attention(*leaves, causal=causal, window=window, softcap=softcap, backend="tilelang")
    dout = torch.randn(got.shape, device="cuda", generator=gen).to(torch_dtype)
    grads = torch.autograd.grad(got, leaves, dout)
    arrays = [t.float().cpu().numpy() for t in (q, k, v)]
    kwargs = dict(q=arrays[0], k=arrays[1], v=arrays[2], causal=causal, window=window, softmax_scale=None,
                  softcap=softcap)  # fmt: skip
    ref_grads = fa_core.reference_vjp(kwargs, (dout.float().cpu().numpy(),))
    ops = torch.ops.tile_kernels
    options = (causal, *window, head_dim**-0.5, softcap)
    out, lse = ops.flash_attention_fwd(q, k, v, *options, "tilelang")
    direct = ops.flash_attention_bwd_compiled(dout, q, k, v, out, lse, *options, "tilelang")
    triton = ops.flash_attention_bwd(dout, q, k, v, out, lse, *options)
    for name, grad in zip("qkv", direct):
        assert not torch.isnan(grad).any(), name
        assert_close(f"d{name}", grad.double().cpu().numpy(), ref_grads[name], dtype)
    for name, a, b, c in zip("qkv", grads, direct, triton):
        # dQ's atomics sum in any order: autograd and a direct call agree to rounding
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2,
                                   msg=f"d{name}: autograd vs the backward it runs")  # fmt: skip
        torch.testing.assert_close(b.float(), c.float(), rtol=5e-2, atol=5e-2, msg=f"d{name}: vs Triton")


@gpu_only
@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
@pytest.mark.parametrize("head_dim, config", [(d, i) for d in (64, 128) for i in range(1, len(BWD_CONFIGS["sm90"][d]))])
@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, heads_q, heads_k, causal, window",
    [
        (2, 1000, 1000, 8, 2, False, (-1, -1)),  # several key blocks, a ragged last one, GQA 4
        (1, 777, 1500, 4, 4, True, (-1, -1)),  # bottom-right causal, Sq < Sk
        (1, 513, 513, 2, 1, False, (99, 20)),  # a band narrower than a block, MQA
    ],
)
def test_torch_flash_attention_tilelang_backward_configurations_match_reference(
    head_dim, config, batch, seqlen_q, seqlen_k, heads_q, heads_k, causal, window
):  # fmt: skip
    """Each non-default backward configuration of BWD_CONFIGS (the sweep's candidates, the synchronous ones): dq,
    dk, dv against the float64 reference, bf16."""
    import torch

    from tile_kernels.core import flash_attention as fa_core
    from tile_kernels.torch._runtime import Executor

    gen = torch.Generator(device="cuda").manual_seed(seqlen_q + 7 * config + head_dim)
    q, k, v = (torch.randn(batch, s, h, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
               for s, h in ((seqlen_q, heads_q), (seqlen_k, heads_k), (seqlen_k, heads_k)))  # fmt: skip
    options = (causal, *window, head_dim**-0.5, 0.0)
    out, lse = torch.ops.tile_kernels.flash_attention_fwd(q, k, v, *options, "tilelang")
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(torch.bfloat16)
    plan = fa_core.compiled_backward("tilelang", batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
                                     dtype="bfloat16", causal=causal, window=window, scale=None, softcap=0.0,
                                     arch=90, config=config)  # fmt: skip
    got = Executor(plan)(q, k, v, out, dout, lse, device=q.device)
    kwargs = dict(q=q.float().cpu().numpy(), k=k.float().cpu().numpy(), v=v.float().cpu().numpy(), causal=causal,
                  window=window, softmax_scale=None, softcap=0.0)  # fmt: skip
    ref = fa_core.reference_vjp(kwargs, (dout.float().cpu().numpy(),))
    for name, grad in zip("qkv", got):
        assert not torch.isnan(grad).any(), name
        assert_close(f"d{name}", grad.double().cpu().numpy(), ref[name], "bfloat16")


@gpu_only
@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
@pytest.mark.parametrize("head_dim, config", [(d, i) for d, cs in CONFIGS["sm90"].items() for i in range(1, len(cs))])
@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, heads_q, heads_k, causal, window, softcap",
    [
        (2, 1000, 1000, 8, 2, False, (-1, -1), 0.0),  # several key blocks, a ragged last one, GQA 4
        (1, 777, 1500, 4, 4, True, (-1, -1), 0.0),  # bottom-right causal, Sq < Sk
        (1, 513, 513, 2, 1, False, (99, 20), 0.0),  # a band narrower than a block (rows that see no key), MQA
        (3, 1, 100, 2, 2, False, (-1, -1), 30.0),  # one query, one key block: the schedule's prologue and epilogue
        (1, 300, 300, 2, 1, True, (-1, -1), 30.0),  # softcap
    ],
)
def test_torch_flash_attention_tilelang_forward_configurations_match_reference(
    head_dim, config, batch, seqlen_q, seqlen_k, heads_q, heads_k, causal, window, softcap
):  # fmt: skip
    """Each non-default forward configuration of CONFIGS (the sweep's candidates, the OVERLAP schedule among them): out
    against the float64 reference, lse against the Triton forward's, bf16; head dim 96 pads (the default kernel)."""
    import torch

    from tile_kernels.core import flash_attention as fa_core
    from tile_kernels.torch._runtime import Executor

    for dim in (head_dim, 96) if head_dim == 128 else (head_dim,):
        gen = torch.Generator(device="cuda").manual_seed(seqlen_q + 7 * config + dim)
        q, k, v = (torch.randn(batch, s, h, dim, device="cuda", generator=gen).to(torch.bfloat16)
                   for s, h in ((seqlen_q, heads_q), (seqlen_k, heads_k), (seqlen_k, heads_k)))  # fmt: skip
        plan = fa_core.compiled_forward("tilelang", batch, seqlen_q, seqlen_k, heads_q, heads_k, dim,
                                        dtype="bfloat16", causal=causal, window=window, scale=None, softcap=softcap,
                                        arch=90, config=config)  # fmt: skip
        out, lse = Executor(plan)(q, k, v, device=q.device)
        want_lse = torch.ops.tile_kernels.flash_attention_fwd(q, k, v, causal, *window, dim**-0.5, softcap, "triton")[1]
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and not torch.isnan(lse).any()
        torch.testing.assert_close(lse[~torch.isinf(lse)], want_lse[~torch.isinf(want_lse)], rtol=0, atol=2e-3)
        kwargs = dict(q=q.float().cpu().numpy(), k=k.float().cpu().numpy(), v=v.float().cpu().numpy(), causal=causal,
                      window=window, softmax_scale=None, softcap=softcap)  # fmt: skip
        assert not torch.isnan(out).any()
        assert_close("out", out.double().cpu().numpy(), fa_core.reference(**kwargs)[0], "bfloat16")


@gpu_only
@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
@pytest.mark.parametrize("head_dim, chunk_bytes, chunk", [(64, 1, 1), (64, 3 * 2**20, 2), (128, 1, 1),
                                                       (128, 5 * 2**20, 2), (96, 5 * 2**20, 2)])  # fmt: skip
def test_torch_flash_attention_tilelang_backward_program_order_leaves_results_unchanged(
    monkeypatch, head_dim, chunk_bytes, chunk
):  # fmt: skip
    """The backward grid's chunks of groups (key_chunk) only order the programs: with L2_CHUNK_BYTES lowered to give
    chunks of 1 group (each group's key blocks in turn) or of 2, dk and dv equal those of one chunk of all 4 groups
    bit for bit, dq (fp32 atomics in another order) to rounding; causal, GQA 3."""
    import torch

    from tile_kernels.core import flash_attention as fa_core
    from tile_kernels.torch._runtime import Executor

    batch, seqlen, heads_q, heads_k = 2, 700, 6, 2
    gen = torch.Generator(device="cuda").manual_seed(head_dim + chunk)
    q, k, v, dout = (torch.randn(batch, seqlen, h, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
                     for h in (heads_q, heads_k, heads_k, heads_q))  # fmt: skip
    shape = (batch, seqlen, seqlen, heads_q, heads_k, head_dim)
    opts = dict(dtype="bfloat16", causal=True, window=(-1, -1), scale=None, softcap=0.0, arch=90)
    out, lse = Executor(fa_core.compiled_forward("tilelang", *shape, **opts))(q, k, v, device=q.device)

    def backward():
        plan = fa_core.compiled_backward("tilelang", *shape, **opts)
        return plan.launches[1].attrs["chunk"], Executor(plan)(q, k, v, out, dout, lse, device=q.device)

    whole, want = backward()
    monkeypatch.setattr(fa_core, "L2_CHUNK_BYTES", chunk_bytes)
    got_chunk, got = backward()
    assert (whole, got_chunk) == (4, chunk)
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2, msg="dq")
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@gpu_only
@pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
def test_torch_flash_attention_tilelang_refuses_float32_and_passes_opcheck_and_compile():
    import torch

    import tile_kernels.torch as tk

    q = torch.randn(2, 17, 4, 64, device="cuda")
    with pytest.raises(ValueError, match="flash_attention: backend 'tilelang' supports q, k, v in float16"):
        tk.flash_attention(q, q, q, backend="tilelang")
    q, k, v = (torch.randn(2, 130, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    ops = torch.ops.tile_kernels
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in [
        (ops.flash_attention_fwd.default, (q, k, v, True, 8, -1, 0.125, 0.0, "tilelang")),
        (ops.flash_attention_fwd.default, (q, k, v, True, 8, -1, 0.125, 0.0, "triton", "tilelang")),
        (ops.flash_attention_fwd_compiled.default, (q.detach(), k.detach(), v.detach(), False, -1, -1, 0.2, 2.0,
                                                    "tilelang")),
        (ops.flash_attention.default, (q, k, v, True, [4, 0], None, 0.0, "tilelang")),
    ]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(r == "SUCCESS" for r in result.values()), (op, result)
    out, lse = ops.flash_attention_fwd(q.detach(), k.detach(), v.detach(), True, 8, -1, 0.125, 0.0, "tilelang")
    for op, args in [
        (ops.flash_attention_bwd_compiled.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out,
                                                    lse, True, 8, -1, 0.125, 0.0, "tilelang")),
    ]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(r == "SUCCESS" for r in result.values()), (op, result)
    assert_torch_compile_matches_eager(q, k, v, causal=True, window=(100, -1), backend="tilelang")


@gpu_only
def test_flash_attention_default_runs_each_pass_on_its_fastest_backend(monkeypatch):
    """backend=None with a gradient wanted, head dim 64 on sm_90: Triton's forward (faster there), TileLang's backward
    reading its out and lse; the gradients are the Triton backward's. Head dim 128: TileLang for both."""
    import importlib

    import torch

    import tile_kernels.torch as tk

    adapter = importlib.import_module("tile_kernels.torch.flash_attention")  # the package's name is the op
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang backward runs on sm_90a")
    ran = []
    for name in ("flash_attention_fwd_compiled", "flash_attention_bwd_compiled"):
        op = getattr(adapter, name)
        monkeypatch.setattr(adapter, name, lambda *args, op=op, name=name: ran.append(name) or op(*args))
    torch.manual_seed(0)
    for head_dim, want_ran in ((64, ["flash_attention_bwd_compiled"]),
                               (128, ["flash_attention_fwd_compiled", "flash_attention_bwd_compiled"])):  # fmt: skip
        q, k, v = (torch.randn(2, 300, h, head_dim, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
        dout = torch.randn_like(q)
        grads = []
        for backend in (None, "triton"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ran.clear()
            out = tk.flash_attention(*leaves, causal=True, backend=backend)
            grads.append(torch.autograd.grad(out, leaves, dout))
            assert ran == (want_ran if backend is None else []), (head_dim, backend)
        for got, want in zip(*grads):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@gpu_only
@pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
def test_jax_flash_attention_tilelang_jit_vmap_grad():
    """One FFI call under vmap (the vmapped axis joins the batch), the Triton forward's values under jit, and grad
    through custom_vjp into the TileLang backward (the Triton backward's values)."""
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (3, 2, 200, 4, 64), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (3, 2, 150, 2, 64), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (3, 2, 150, 2, 64), jnp.float32).astype(jnp.bfloat16)

    def f(q, k, v, b):
        return tk.flash_attention(q, k, v, causal=True, window=(60, -1), backend=b)

    batched = jax.vmap(lambda q, k, v: f(q, k, v, "tilelang"))
    assert str(jax.make_jaxpr(batched)(q, k, v)).count("ffi_call[") == 1
    got = jax.jit(batched)(q, k, v)
    want = jax.vmap(lambda q, k, v: f(q, k, v, "triton"))(q, k, v)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)

    def loss(q, k, v, b):
        return jnp.sum(f(q, k, v, b).astype(jnp.float32) ** 2)

    # the TileLang backward: delta, dK / dV (+ dQ summed in place), dQ: three FFI calls beside the forward's
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)), static_argnums=3)(q[0], k[0], v[0], "tilelang"))
    assert jaxpr.count("ffi_call[") == 4
    got = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(q[0], k[0], v[0], "tilelang")
    for a, b in zip(got, jax.grad(loss, (0, 1, 2))(q[0], k[0], v[0], "triton")):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-2, atol=5e-2)


@gpu_only
@pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
def test_jax_flash_attention_default_runs_each_pass_on_its_fastest_backend():
    """backend=None under grad, head dim 64 on sm_90: Triton's forward (no FFI call), TileLang's backward (three FFI
    calls) reading its out and lse, with the Triton backward's gradients; head dim 128: TileLang for both."""
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    if jax.devices()[0].compute_capability != "9.0":
        pytest.skip("the TileLang backward runs on sm_90a")

    def loss(q, k, v, b):
        return jnp.sum(tk.flash_attention(q, k, v, causal=True, backend=b).astype(jnp.float32) ** 2)

    grad = jax.grad(loss, (0, 1, 2))
    for head_dim, ffi_calls in ((64, 3), (128, 4)):
        keys = jax.random.split(jax.random.key(head_dim), 3)
        q, k, v = (jax.random.normal(key, (2, 300, h, head_dim), jnp.float32).astype(jnp.bfloat16)
                   for key, h in zip(keys, (4, 2, 2)))  # fmt: skip
        assert str(jax.make_jaxpr(grad, static_argnums=3)(q, k, v, None)).count("ffi_call[") == ffi_calls
        got = jax.jit(grad, static_argnums=3)(q, k, v, None)
        for a, b in zip(got, grad(q, k, v, "triton")):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-2, atol=5e-2)
