"""fused_linear_cross_entropy beyond the registry suite: the (N, V) logits never exist (in the plans, and in torch's
allocations on the CPU), results do not depend on chunk_size, the JAX GPU executor's handling of GEMM steps, row views
and in-place launches (run on the CPU with interpreted launches), and torch opcheck."""

from __future__ import annotations

import functools
import importlib
import types

import numpy as np
import pytest
from conftest import DEVICE, needs_torch
from drivers import DRIVERS
from test_ops import assert_close

from tile_kernels.core import Target
from tile_kernels.core import fused_linear_cross_entropy as core
from tile_kernels.core.plan import Gemm, Launch

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="runs the kernels in Triton's interpreter")


def _plans(n, v, d, dtype="bfloat16", chunk_size=None):
    kw = dict(dtype=dtype, target_dtype="int64", ignore_index=-100, chunk_size=chunk_size, target=Target())
    return {
        "mean, training": core.forward(n, v, d, reduction="mean", grad_hidden=True, grad_weight=True, **kw),
        "mean, no grad": core.forward(n, v, d, reduction="mean", grad_hidden=False, grad_weight=False, **kw),
        "none, forward": core.forward(n, v, d, reduction="none", grad_hidden=True, grad_weight=True, **kw),
        "none, backward": core.backward(n, v, d, grad_hidden=True, grad_weight=True, **kw),
    }


@pytest.mark.parametrize("n, v, d", [(8192, 131072, 4096), (65536, 32000, 4096), (4096, 256000, 2048), (3000, 50, 64)])
def test_plans_never_hold_the_full_logits(n, v, d):
    """Beside the gradients (dhidden, dweight), the plans allocate one chunk of logits, never all N rows, and small
    per-row vectors: at the issue's shape a 1024-row chunk (1/8 of the logits), and all buffers together stay under a
    quarter of what the unfused version needs."""
    item = 2
    unfused = 3 * n * v * item  # logits, log-softmax and the logits' gradient at the backward's peak
    for what, plan in _plans(n, v, d).items():
        chunk = plan.buffers["logits"].shape[0]
        assert plan.buffers["logits"].shape == (chunk, v), what
        assert chunk <= core.MAX_CHUNK and chunk < n, (what, chunk)
        others = {name: s for name, s in plan.buffers.items() if name not in ("logits", "dhidden", "dweight")}
        assert all(s.nbytes < chunk * v * item for s in others.values()), (what, others)
        extra = sum(s.nbytes for name, s in plan.buffers.items() if name not in ("dhidden", "dweight"))
        assert extra <= chunk * v * item + 64 * n, (what, extra)
        if (n, v, d) == (8192, 131072, 4096):
            assert chunk == 1024
            total = sum(s.nbytes for s in plan.buffers.values())
            assert total <= unfused / 4, (what, total / 2**30)
    steps = [type(s).__name__ for s in _plans(n, v, d)["mean, no grad"].launches]
    assert steps.count("Gemm") == len(core.chunks(n, v, d, None)), "no gradient GEMMs without gradients"


def test_chunking_covers_every_row_once_and_evens_out():
    for n, v, d, chunk_size in [(1, 7, 3, None), (10, 7, 3, 4), (5000, 131072, 4096, None), (9, 5, 2, 100)]:
        ranges = core.chunks(n, v, d, chunk_size)
        assert [r for r0, r1 in ranges for r in range(r0, r1)] == list(range(n))
        sizes = {r1 - r0 for r0, r1 in ranges}
        if chunk_size is None:
            assert max(sizes) - min(sizes) <= 1, sizes
    assert core.chunks(0, 7, 3, None) == []


BENCH_SHAPE = dict(n=8192, d=4096, v=128256)  # the LM-head benchmark: 8192 tokens, Llama-3 vocabulary, bf16


def _unfused_peak(n, v, item):
    """Peak bytes of F.cross_entropy(hidden @ weight.T, target) forward + backward beyond the inputs: three (N, V)
    buffers (logits, log-softmax, dlogits); 6012 MiB measured on the H200 at the benchmark shape, exactly this."""
    return 3 * n * v * item


@pytest.mark.parametrize("reduction", core.REDUCTIONS)
def test_peak_memory_at_the_benchmark_shape(reduction):
    """Computed from the plans (the shape is too big for the interpreter; test_torch_step_allocates_only_the_plans_
    buffers shows that the torch path allocates exactly these bytes): a training step at N = 8192, D = 4096, V = 128256
    in bf16 holds at most a quarter of what the unfused torch version does, with chunks of 1024 rows (fewer would slow
    the dweight GEMM, twice as many would pass the quarter)."""
    n, d, v = BENCH_SHAPE.values()
    peak = core.peak_bytes(n, v, d, dtype="bfloat16", reduction=reduction)
    grads, chunk_logits = (n + v) * d * 2, 1024 * v * 2
    assert core.chunks(n, v, d, None)[0] == (0, 1024)
    assert grads + chunk_logits <= peak <= grads + chunk_logits + 16 * n, peak - grads - chunk_logits
    assert peak <= _unfused_peak(n, v, 2) / 4, f"{peak / 2**20:.0f} MiB > a quarter of the unfused version"
    assert grads + 2 * chunk_logits > _unfused_peak(n, v, 2) / 4  # 2048-row chunks would not fit


@needs_torch
@cpu_only
def test_torch_step_allocates_only_the_plans_buffers():
    """torch's CPU profiler follows every allocation and free of a training step (forward with autograd recording,
    backward): its peak beyond the inputs (and the cotangent) is core.peak_bytes, the plans' buffers: no copy of a
    gradient (e.g. zero cotangents that autograd creates for outputs nobody differentiates), no matmul output beside
    the plan's buffer, no fp32 copy. float32: torch's CPU matmul converts bf16 operands to fp32 internally (cuBLAS does
    not), which would hide the adapter's own allocations."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    import tile_kernels.torch as tk

    n, d, v, chunk = 64, 32, 500, 8
    hidden = torch.randn(n, d, requires_grad=True)
    weight = (torch.randn(v, d) / 4).requires_grad_()
    target = torch.randint(0, v, (n,))
    target[3] = -100

    def peak(step) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            step()
        live = top = 0
        events = [e for e in p.profiler.kineto_results.events() if e.name() == "[memory]"]
        for e in sorted(events, key=lambda e: e.start_ns()):  # the bytes of an allocation, negative for a free
            live += e.nbytes()
            top = max(top, live)
        return top

    def step(reduction, cotangent):
        loss = tk.fused_linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk_size=chunk)
        gc.collect()  # Triton's interpreter holds a launch's arguments in a reference cycle (compiled launches do not)
        torch.autograd.grad(loss, (hidden, weight), cotangent)

    for reduction in core.REDUCTIONS:
        cotangent = torch.randn(() if reduction != "none" else (n,))
        got = peak(functools.partial(step, reduction, cotangent))
        want = core.peak_bytes(n, v, d, dtype="float32", reduction=reduction, chunk_size=chunk)
        assert want - 64 <= got <= want, (reduction, got, want)


@pytest.mark.parametrize("reduction", core.REDUCTIONS)
def test_results_do_not_depend_on_chunk_size(driver, reduction):
    info = core.INFO
    kwargs = info.sample(np.random.default_rng(7), (23, 50), "float32", reduction=reduction)
    refs = info.reference(**kwargs)
    cotangents = tuple(np.random.default_rng(8).standard_normal(r.shape).astype(np.float32) for r in refs)
    ref_grads = info.reference_vjp(kwargs, cotangents)
    results = {}
    for chunk_size in (1, 4, 22, 23, 1000, None):
        outs, grads = driver.vjp(core.NAME, {**kwargs, "chunk_size": chunk_size}, info.grad_args, cotangents)
        assert_close(f"loss, chunk_size={chunk_size}", outs[0], refs[0], "float32")
        for name in info.grad_args:
            assert_close(f"d{name}, chunk_size={chunk_size}", grads[name], ref_grads[name], "float32")
        results[chunk_size] = (outs[0], grads["hidden"], grads["weight"])
    first = results[1]
    for chunk_size, got in results.items():
        for a, b in zip(got, first):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6, err_msg=f"chunk_size={chunk_size} vs 1")


@pytest.mark.parametrize("reduction", core.REDUCTIONS)
def test_float32_wide_vocabulary_within_the_fp32_gemm_error_bound(driver, reduction):
    """float32 at V = 40000 (streamed rows, gradient written in place), which the registry suite draws only in
    16-bit dtypes: dhidden sums V products in fp32, so it is held to the GEMM's forward error bound, (V + 2) * 2^-24 *
    sum_v |dlogits| |weight| (rounding of dlogits and of the sum), twice; the rest to the suite's tolerance."""
    info = core.INFO
    kwargs = info.sample(np.random.default_rng(11), (5, 17), "float32", reduction=reduction)
    v, d = 40000, kwargs["hidden"].shape[1]
    kwargs["weight"] = (np.random.default_rng(12).standard_normal((v, d)) * 2 / np.sqrt(d)).astype(np.float32)
    kwargs["target"] = np.where(kwargs["target"] < 0, -100, np.random.default_rng(13).integers(0, v, 5))
    kwargs["chunk_size"] = 2
    refs = info.reference(**kwargs)
    cotangents = tuple(np.random.default_rng(14).standard_normal(r.shape).astype(np.float32) for r in refs)
    outs, grads = driver.vjp(core.NAME, kwargs, info.grad_args, cotangents)
    ref_grads = info.reference_vjp(kwargs, cotangents)
    assert_close("loss", outs[0], refs[0], "float32")
    assert_close("dweight", grads["weight"], ref_grads["weight"], "float32")
    # sum_v |dlogits_iv| |weight_v| <= |g_i| (sum_v softmax_iv |weight_v| + |weight_t_i|), |g_i| <= |cotangent_i|
    weight, target = kwargs["weight"].astype(np.float64), kwargs["target"]
    logits = kwargs["hidden"].astype(np.float64) @ weight.T
    probs = np.exp(logits - logits.max(1, keepdims=True))
    magnitude = (probs / probs.sum(1, keepdims=True)) @ np.abs(weight) + np.abs(weight[np.maximum(target, 0)])
    g = np.abs(np.broadcast_to(cotangents[0], (5,)))[:, None]
    bound = 2 * (v + 2) * 2.0**-24 * g * magnitude + 1e-6
    err = np.abs(grads["hidden"] - ref_grads["hidden"])
    assert np.all(err <= bound), f"dhidden: max error / bound {np.max(err / bound):.3g}"


# ------------------------------------------------------------------------------------------- JAX GPU executor on CPU


def _interpreted_triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, zeroed_outputs=(),
                             input_output_aliases=None, **constexprs):  # fmt: skip
    """jax_triton.triton_call's contract (array operands, then the outputs; aliased outputs share their input's
    memory, zeroed ones start at 0, others at NaN), run by Triton's interpreter inside a host callback."""
    import jax
    import jax.numpy as jnp

    from tile_kernels.core.host import HostBuffer

    aliases = dict(input_output_aliases or {})
    is_array = [not isinstance(a, (int, float, np.integer, np.floating)) for a in args]

    def run(*host):
        inputs = [np.array(h, order="C") for h in host]  # writable copies
        outs = []
        for i, spec in enumerate(out_shape):
            source = next((k for k, o in aliases.items() if o == i), None)
            fill = 0 if i in zeroed_outputs else np.nan if jnp.issubdtype(spec.dtype, jnp.floating) else -1
            outs.append(inputs[source] if source is not None else np.full(spec.shape, fill, spec.dtype))
        pending = iter(inputs)
        call = [HostBuffer(next(pending)) if arr else float(a) if isinstance(a, np.floating) else a
                for a, arr in zip(args, is_array)]  # fmt: skip
        kernel[grid](*call, *(HostBuffer(o) for o in outs), **constexprs, num_warps=num_warps)
        return outs

    return jax.pure_callback(run, list(out_shape), *(a for a, arr in zip(args, is_array) if arr))


@needs_jax
@cpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", core.REDUCTIONS)
def test_jax_gpu_executor_with_interpreted_launches(monkeypatch, dtype, reduction):
    """The GPU path of jax/_runtime.run_plan (jnp GEMMs, row slices and updates, aliased in-place launches, inputs
    updated in place) with each Triton launch interpreted on the host in place of jax-triton."""
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk
    from tile_kernels.jax import _runtime

    adapter = importlib.import_module("tile_kernels.jax.fused_linear_cross_entropy")  # the package's name is the op
    fake = types.SimpleNamespace(triton_call=_interpreted_triton_call)
    monkeypatch.setattr(_runtime, "_import_jax_triton", lambda: fake)
    monkeypatch.setattr(adapter, "mode", lambda op: "gpu")
    monkeypatch.setattr(adapter, "target", lambda kind: Target())
    info = core.INFO
    kwargs = info.sample(np.random.default_rng(3), (19, 70), dtype, reduction=reduction)
    kwargs["chunk_size"] = 7  # chunks of 7, 7, 5
    refs = info.reference(**kwargs)
    cotangents = tuple(np.random.default_rng(4).standard_normal(r.shape).astype(np.float32) for r in refs)
    ref_grads = info.reference_vjp(kwargs, cotangents)
    labels = jnp.asarray(kwargs["target"])

    def f(hidden, weight):
        return tk.fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=7)

    args = (jnp.asarray(kwargs["hidden"]), jnp.asarray(kwargs["weight"]))
    jaxpr = str(jax.make_jaxpr(lambda h, w: jax.vjp(f, h, w)[1](jnp.asarray(cotangents[0], jnp.float32)))(*args))
    assert "dot_general" in jaxpr and "dynamic_update_slice" in jaxpr and "pure_callback" in jaxpr
    loss, vjp = jax.vjp(jax.jit(f), *args)
    dhidden, dweight = vjp(jnp.asarray(cotangents[0], loss.dtype))
    assert_close("loss", np.asarray(loss, np.float64), refs[0], dtype)
    assert_close("dhidden", np.asarray(dhidden, np.float64), ref_grads["hidden"], dtype)
    assert_close("dweight", np.asarray(dweight, np.float64), ref_grads["weight"], dtype)
    assert_close("loss without grad", np.asarray(f(*args), np.float64), refs[0], dtype)


# -------------------------------------------------------------------------------------------------------------- torch


def _traced_ops_run_their_kernels():
    """On the CPU, the config under which AOTAutograd (opcheck's AOT-dispatch test, torch.compile) keeps the triton ops
    as graph nodes that run in the interpreter when called: decomposed (the default, and the GPU path), they would be
    traced with fake tensors, on which the interpreter launches nothing, and the graph would hold no kernel at all."""
    import contextlib

    import torch

    if DEVICE == "gpu":
        return contextlib.nullcontext()
    return torch._functorch.config.patch(decompose_custom_triton_ops=False)


@needs_torch
def test_torch_opcheck():
    """Including the AOT-dispatch test on the CPU too: it compares eager outputs and gradients with an AOTAutograd
    graph's, and so catches an op whose backward changes tensors its caller holds (it failed on the H200 when the
    _fwd op's autograd scaled its own dhidden output in place; on the CPU the partitioner rejected that graph)."""
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    hidden = torch.randn(9, 8, device=dev, requires_grad=True)
    weight = torch.randn(13, 8, device=dev, requires_grad=True)
    target = torch.randint(0, 13, (9,), device=dev)
    target[0] = -100
    ops = torch.ops.tile_kernels
    plain = (hidden.detach(), weight.detach())  # the _fwd op is not differentiable itself: the public op is
    lse = ops.fused_linear_cross_entropy_fwd(*plain, target, -100, "none", 4, False, False)[1]
    with _traced_ops_run_their_kernels():
        for op, args in [
            (ops.fused_linear_cross_entropy_fwd.default, (*plain, target, -100, "mean", 4, True, True)),
            (ops.fused_linear_cross_entropy_fwd.default, (*plain, target, -100, "none", None, False, False)),
            (ops.fused_linear_cross_entropy_bwd.default, (torch.randn(9, device=dev), *plain, target, lse, -100, 4,
                                                          True, True)),
            (ops.fused_linear_cross_entropy_scale_.default, (torch.tensor(1.5, device=dev),
                                                             torch.tensor([7.0], device=dev),
                                                             torch.randn(9, 8, device=dev),
                                                             torch.randn(13, 8, device=dev), "mean")),
            *((ops.fused_linear_cross_entropy.default, (hidden, weight, target, -100, reduction, chunk))
              for reduction, chunk in (("sum", 5), ("mean", 4), ("none", None))),
        ]:  # fmt: skip
            result = torch.library.opcheck(op, args, test_utils=utils)
            assert all(v == "SUCCESS" for v in result.values()), (op, result)


@needs_torch
def test_torch_fwd_op_refuses_backward():
    """Differentiating through the _fwd helper is an error (its gradients come from the public op), not a silent
    zero."""
    import torch

    import tile_kernels.torch  # noqa: F401

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    hidden = torch.randn(5, 4, device=dev, requires_grad=True)
    weight = torch.randn(6, 4, device=dev)
    loss = torch.ops.tile_kernels.fused_linear_cross_entropy_fwd(hidden, weight, torch.randint(0, 6, (5,), device=dev),
                                                                 -100, "sum", None, True, False)[0]  # fmt: skip
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        loss.backward()


@needs_torch
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_torch_second_backward_is_refused(reduction):
    """sum / mean: the backward scales the gradients kept by the forward in place, so a second backward through the
    same graph (retain_graph) is refused by autograd's saved-tensor version check, not computed from scaled buffers."""
    import torch

    import tile_kernels.torch as tk

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    hidden = torch.randn(5, 4, device=dev, requires_grad=True)
    weight = torch.randn(6, 4, device=dev, requires_grad=True)
    loss = tk.fused_linear_cross_entropy(hidden, weight, torch.randint(0, 6, (5,), device=dev), reduction=reduction)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_torch
@pytest.mark.parametrize("reduction", core.REDUCTIONS)
def test_torch_compile_matches_eager(reduction):
    """torch.compile(fullgraph=True), forward and backward, gives eager's loss and gradients (on the CPU through
    AOTAutograd with the ops as graph nodes, backend aot_eager; on a GPU through Inductor, kernels decomposed)."""
    import torch

    import tile_kernels.torch as tk

    dev = "cuda" if DEVICE == "gpu" else "cpu"
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, 8, generator=gen).to(dev).requires_grad_()
    weight = torch.randn(13, 8, generator=gen).to(dev).requires_grad_()
    target = torch.randint(0, 13, (11,), generator=gen).to(dev)
    target[2] = -100

    def f(hidden, weight):
        return tk.fused_linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk_size=4)

    def step(fn):
        loss = fn(hidden, weight)
        cotangent = torch.linspace(-1, 2, loss.numel(), device=dev).view(loss.shape)
        return (loss, *torch.autograd.grad(loss, (hidden, weight), cotangent))

    torch._dynamo.reset()
    with _traced_ops_run_their_kernels():
        compiled = step(torch.compile(f, fullgraph=True, backend="inductor" if DEVICE == "gpu" else "aot_eager"))
    for name, got, want in zip(("loss", "dhidden", "dweight"), compiled, step(f)):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


@needs_torch
@cpu_only
def test_torch_no_grad_forward_skips_the_gradients(monkeypatch):
    """Under no_grad (or for inputs that need no gradient) the forward runs only the logits GEMMs."""
    import torch

    import tile_kernels.torch as tk
    from tile_kernels.torch import _runtime

    seen = []
    real = _runtime.Executor.__call__

    def spy(executor, *inputs, device):
        seen.append(executor.plan)
        return real(executor, *inputs, device=device)

    monkeypatch.setattr(_runtime.Executor, "__call__", spy)
    hidden, weight = torch.randn(10, 4, requires_grad=True), torch.randn(6, 4)  # weight needs no gradient
    target = torch.randint(0, 6, (10,))
    with torch.no_grad():
        tk.fused_linear_cross_entropy(hidden, weight, target, chunk_size=4)
    tk.fused_linear_cross_entropy(hidden, weight, target, chunk_size=4).backward()
    gemms = [[s for s in plan.launches if isinstance(s, Gemm)] for plan in seen[:2]]
    assert len(gemms[0]) == 3  # logits only, 3 chunks
    assert len(gemms[1]) == 6 and not any(g.out == "dweight" for g in gemms[1])  # + dhidden, no dweight
    assert weight.grad is None and hidden.grad.shape == hidden.shape
    assert all(isinstance(s, Launch) for s in seen[2].launches)  # the backward: the in-place scaling only


@needs_torch
@cpu_only
@pytest.mark.parametrize("reduction", core.REDUCTIONS)
def test_torch_gradients_carry_no_graph(reduction):
    """The sum/mean backward hands out the forward's (scaled) gradient buffers: they must not drag the forward's
    graph along (leaf .grad without grad_fn)."""
    import torch

    import tile_kernels.torch as tk

    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    loss = tk.fused_linear_cross_entropy(hidden, weight, torch.randint(0, 6, (5,)), reduction=reduction, chunk_size=2)
    loss.sum().backward()
    for grad in (hidden.grad, weight.grad):
        assert grad is not None and not grad.requires_grad and grad.grad_fn is None


@needs_torch
@cpu_only
@pytest.mark.parametrize("online", [False, True], ids=["per-lane", "per-row"])
@pytest.mark.parametrize("smoothing, masked_chunk", [(0.1, False), (0.0, True)], ids=["smoothing", "masked-chunk"])
def test_streamed_chunk_forward_matches_float64(online, smoothing, masked_chunk):
    """The chunk forward fused_linear_cross_entropy runs on rows wider than one block (lse, and the unit-cotangent
    gradient written over the logits in place), with its running max / sum kept per lane or per row (BLOCK_ONLINE),
    against float64; masked-chunk: a row whose first block is all -inf (no finite logit yet: no -inf - -inf)."""
    import dataclasses

    import torch

    from tile_kernels.core import cross_entropy
    from tile_kernels.core.plan import BufferSpec, Plan
    from tile_kernels.torch._runtime import Executor

    rows, v = 3, cross_entropy.STREAM_BLOCK * 2 + 37
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((rows, v)).astype(np.float32) * 3
    if masked_chunk:
        logits[0, : cross_entropy.STREAM_BLOCK + 5] = -np.inf
    labels = np.array([v - 1, 7, -100])
    launch = cross_entropy.forward_launch(1, rows, v, logits="logits", labels="target", loss="loss", lse="lse",
                                          valid="valid", dlogits="logits", ignore_index=-100,
                                          label_smoothing=smoothing, target=Target())  # fmt: skip
    assert not launch.constexprs["ONE_BLOCK"]
    launch = dataclasses.replace(launch, constexprs={**launch.constexprs, "BLOCK_ONLINE": online})
    buffers = {n: BufferSpec((1, rows), "float32") for n in ("loss", "lse", "valid")}
    plan = Plan({"logits": "float32", "target": "int64"}, buffers, (launch,), ("lse", "logits", "loss"))
    lse, grad, loss = Executor(plan)(torch.from_numpy(logits.copy()), torch.from_numpy(labels), device="cpu")
    x = logits.astype(np.float64)
    m = x.max(1, keepdims=True)
    want_lse = (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]
    onehot = np.zeros_like(x)
    onehot[[0, 1], labels[:2]] = 1.0
    want_grad = np.exp(x - want_lse[:, None]) - (1 - smoothing) * onehot - smoothing / v
    want_grad[2] = 0.0  # ignored row
    want_loss = (1 - smoothing) * (want_lse - x[np.arange(rows), np.maximum(labels, 0)])
    if smoothing:
        want_loss += smoothing * (want_lse - x.mean(1))
    want_loss[2] = 0.0
    np.testing.assert_allclose(lse.numpy()[0], want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss.numpy()[0], want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-4, atol=1e-6)
