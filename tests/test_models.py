"""Drop-in use in models: tile_kernels.torch.nn modules against their torch / Hugging Face counterparts, and a
transformers decoder patched with apply_to against the stock model (logits, loss, every parameter's gradient, a few
optimizer steps). On the CPU the kernels run in Triton's interpreter in float32; on a GPU in bfloat16."""

import copy
import importlib.util

import pytest
from conftest import DEVICE

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="needs transformers and torch",
)


def _setup():
    import torch

    device = "cuda" if DEVICE == "gpu" else "cpu"
    dtype = torch.bfloat16 if DEVICE == "gpu" else torch.float32
    return torch, device, dtype


def _relative_error(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@needs_torch
def test_nn_modules_match_torch_and_load_their_state_dicts():
    torch, device, dtype = _setup()
    import tile_kernels.torch as tk

    torch.manual_seed(0)
    x = torch.randn(3, 5, 48, device=device, dtype=dtype)
    ref = torch.nn.RMSNorm(48, eps=1e-5, device=device, dtype=dtype)
    torch.nn.init.uniform_(ref.weight, -2, 2)
    norm = tk.nn.RMSNorm(48, eps=1e-5, device=device, dtype=dtype)
    norm.load_state_dict(ref.state_dict())
    assert _relative_error(norm(x), ref(x)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)

    ref_ln = torch.nn.LayerNorm(48, device=device, dtype=dtype)
    torch.nn.init.uniform_(ref_ln.weight, -2, 2)
    torch.nn.init.uniform_(ref_ln.bias, -1, 1)
    ln = tk.nn.LayerNorm(48, device=device, dtype=dtype)
    ln.load_state_dict(ref_ln.state_dict())
    assert _relative_error(ln(x), ref_ln(x)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)

    mlp = tk.nn.SwiGLUMLP(48, 80, device=device, dtype=dtype)
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert _relative_error(mlp(x), want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)

    rotary = tk.nn.Rotary(16, base=500.0, device=device)
    q = torch.randn(2, 7, 3, 16, device=device, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15]], device=device)
    angles = positions.double()[..., None] * rotary.inv_freq.double()  # (B, S, D/2)
    c, s = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    a, b = q.double()[..., :8], q.double()[..., 8:]
    want = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    assert _relative_error(rotary(q, positions), want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_torch
def test_rms_norm_and_input_joins_the_gradients_of_its_input():
    torch, device, dtype = _setup()
    from tile_kernels.torch.norms import rms_norm_and_input

    torch.manual_seed(0)
    x = torch.randn(3, 5, 48, device=device, dtype=dtype).transpose(0, 1).requires_grad_()  # non-contiguous
    w = (torch.rand(48, device=device, dtype=dtype) + 0.5).requires_grad_()
    y, x_out = rms_norm_and_input(x, w, 1e-5)
    assert torch.equal(x_out, x)
    cy, cx = torch.randn_like(y), torch.randn_like(y)
    ((y * cy).sum() + (x_out * cx).sum()).backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    ((y64 * cy.double()).sum() + (x64 * cx.double()).sum()).backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _relative_error(y, y64) < tol
    assert _relative_error(x.grad, x64.grad) < tol and _relative_error(w.grad, w64.grad) < tol
    x.grad = None
    rms_norm_and_input(x, w, 1e-5)[1].sum().backward()  # only the input used: its gradient passes through
    assert torch.equal(x.grad, torch.ones_like(x))


@needs_torch
def test_shared_input_linear_matches_separate_linears():
    torch, device, dtype = _setup()
    import tile_kernels.torch as tk

    torch.manual_seed(0)
    linears = [torch.nn.Linear(48, n, bias=bias, device=device, dtype=dtype) for n, bias in ((40, True), (24, False),
                                                                                             (24, True))]  # fmt: skip
    group = tk.nn.SharedInputLinear.group(*linears)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    x = torch.randn(3, 5, 48, device=device, dtype=dtype).transpose(0, 1)  # non-contiguous input
    cotangents = [torch.randn(5, 3, m.out_features, device=device, dtype=dtype) for m in linears]
    for used in ((0, 1, 2), (2, 0)):  # any order; an output that does not reach the loss gets no gradient
        grads = []
        for modules in (linears, group):
            x_ = x.detach().requires_grad_()
            for p in (p for m in linears for p in m.parameters()):
                p.grad = None
            outs = {i: modules[i](x_) for i in used}
            loss = sum((outs[i].double() * cotangents[i].double()).sum() for i in used)
            loss.backward()
            grads.append([x_.grad] + [p.grad for m in linears for p in m.parameters()])
            if modules is group:
                assert (group[0]._pending == [None, []]) == (len(used) == 3)  # kept until every one is handed out
                want_outs = {i: linears[i](x) for i in used}
                assert all(_relative_error(outs[i], want_outs[i]) < tol for i in used)
        for got, want in zip(*grads):
            assert (got is None) == (want is None)
            if want is not None:
                assert _relative_error(got, want) < tol
    # a member called with another input computes its group again
    y = torch.randn(2, 48, device=device, dtype=dtype)
    assert _relative_error(group[0](x), linears[0](x)) < tol and _relative_error(group[1](y), linears[1](y)) < tol


def _node(grad_fn, name: str):
    """The first autograd node called `name` upstream of grad_fn."""
    todo = [grad_fn]
    while todo:
        node = todo.pop()
        if node.name() == name:
            return node
        todo += [n for n, _ in node.next_functions if n is not None]
    raise AssertionError(f"no {name} node")


@needs_torch
def test_shared_input_linear_recomputes_a_norm_output_instead_of_keeping_it():
    torch, device, dtype = _setup()
    import tile_kernels.torch as tk

    torch.manual_seed(0)
    norm = tk.nn.RMSNorm(48, eps=1e-5, device=device, dtype=dtype)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    mlp = tk.nn.SwiGLUMLP(48, 80, device=device, dtype=dtype)
    a, b = (torch.randn(5, 3, 48, device=device, dtype=dtype) for _ in range(2))
    cotangent = torch.randn(5, 3, 48, device=device, dtype=dtype)
    grads, kept = [], []
    for variant in ("noted", "a copy", "modified"):
        params = [norm.weight, *mlp.parameters()]
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        y, h = norm(a_, residual=b_)
        if variant == "a copy":  # not the norm's output: kept
            y = y.clone()
        elif variant == "modified":  # modified after the norm: no longer its output, kept
            y = y.mul_(1.0)
        out = mlp(y)
        node = _node(out.grad_fn, "_SharedInputLinearBackward")  # gate_proj's and up_proj's
        kept.append(node.saved_tensors[0].data_ptr() == (h if variant == "noted" else y).data_ptr())
        torch.autograd.backward([out, h], [cotangent, cotangent])
        grads.append([t.grad for t in (a_, b_, *params)])
        for p in params:
            p.grad = None
    assert kept == [True, True, True]
    assert all(g is not None for g in grads[0])
    for got in grads[1:]:  # recomputing the norm's output gives the same gradients, bit for bit
        assert all(torch.equal(g, w) for g, w in zip(got, grads[0]))
    y, h = norm(a.clone().requires_grad_(), residual=b)
    out = mlp(y)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@needs_torch
def test_swiglu_over_inputs_writes_its_gradients_over_gate_and_up():
    torch, device, dtype = _setup()
    import tile_kernels.torch as tk
    from tile_kernels.torch.swiglu import swiglu_over_inputs

    torch.manual_seed(0)
    x = torch.randn(5, 3, 48, device=device, dtype=dtype, requires_grad=True)
    w_gate, w_up = (torch.randn(72, 48, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    dy = torch.randn(5, 3, 72, device=device, dtype=dtype)
    leaves, results = (x, w_gate, w_up), []
    for op in (tk.swiglu, swiglu_over_inputs):
        gate, up = x @ w_gate.t(), x @ w_up.t()
        before = gate.detach().double(), up.detach().double()
        y = op(gate, up)
        (y * dy).sum().backward(retain_graph=True)
        results.append((y, [t.grad for t in leaves]))
        for t in leaves:
            t.grad = None
    (want_y, want_grads), (y, grads) = results
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.equal(y, want_y)
    assert all(_relative_error(got, want) < tol for got, want in zip(grads, want_grads))
    g64, u64 = before
    s = torch.sigmoid(g64)  # gate and up now hold their gradients
    assert _relative_error(gate, dy.double() * u64 * s * (1 + g64 * (1 - s))) < tol
    assert _relative_error(up, dy.double() * g64 * s) < tol
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y * dy).sum().backward()  # the saved gate and up are gone: a second backward is refused
    # a non-contiguous gate (its buffer may be someone's): the plain swiglu, the inputs untouched
    gate = torch.randn(72, 15, device=device, dtype=dtype).t().requires_grad_()
    up = torch.randn(15, 72, device=device, dtype=dtype, requires_grad=True)
    kept = gate.detach().clone(), up.detach().clone()
    swiglu_over_inputs(gate, up).sum().backward()
    assert torch.equal(gate.detach(), kept[0]) and torch.equal(up.detach(), kept[1]) and gate.grad is not None
    # one tensor as both inputs: the plain swiglu (its two gradients would be written over one buffer)
    both = torch.randn(4, 72, device=device, dtype=dtype).requires_grad_()
    kept = both.detach().clone()
    (swiglu_over_inputs(both, both) * dy.reshape(-1, 72)[:4].to(dtype)).sum().backward()
    b64 = kept.double()
    s = torch.sigmoid(b64)
    want = dy.reshape(-1, 72)[:4].double() * (b64 * s * (1 + b64 * (1 - s)) + b64 * s)
    assert torch.equal(both.detach(), kept) and _relative_error(both.grad, want) < tol


def _tiny_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type, vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip


def _models(model_type: str, attention=True):
    torch, device, dtype = _setup()
    import transformers

    import tile_kernels.torch as tk

    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(_tiny_config(model_type)).to(device, dtype)
    for p in stock.parameters():  # norm weights away from 1, so that a dropped weight shows
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    patched = tk.apply_to(copy.deepcopy(stock), attention=attention)
    return torch, stock, patched, device


# attention=True: flash_attention's default backend; "tilelang" (padded head dim 16 -> 64 kernels) on a GPU only
@needs_transformers
@pytest.mark.parametrize(
    "model_type, attention",
    [("llama", True), ("qwen3", True),
     pytest.param("llama", "tilelang", marks=pytest.mark.skipif(DEVICE != "gpu", reason="TileLang runs on GPUs"))],
)  # fmt: skip
def test_patched_model_matches_the_stock_model(model_type, attention):
    torch, stock, patched, device = _models(model_type, attention)
    import tile_kernels.torch as tk

    layer = patched.model.layers[0]
    assert type(layer.input_layernorm) is tk.nn.RMSNorm and type(layer.mlp) is tk.nn.SwiGLUMLP
    assert layer.forward.__func__ is tk.models.decoder_layer_forward  # the post-attention residual in the norm
    assert all(type(getattr(layer.self_attn, p)) is tk.nn.SharedInputLinear for p in ("q_proj", "k_proj", "v_proj"))
    layers = patched.model.layers  # each layer's output add computes the norm that reads it
    assert layer._following_norm is layers[1].input_layernorm and layers[-1]._following_norm is patched.model.norm
    assert patched.config._attn_implementation == ("tile_kernels" if attention is True else f"tile_kernels_{attention}")
    fp32 = stock.dtype == torch.float32
    tol = 2e-4 if fp32 else 3e-2

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 160, (2, 24), generator=generator).to(device)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored tokens
    positions = torch.stack([torch.arange(24), torch.arange(24) + 7]).to(device)  # a table per sequence

    with torch.no_grad():
        assert _relative_error(patched(ids).logits, stock(ids).logits) < tol
        per_sequence = patched(ids, position_ids=positions).logits, stock(ids, position_ids=positions).logits
        assert _relative_error(*per_sequence) < tol

    out, want = patched(ids, labels=labels), stock(ids, labels=labels)
    assert out.loss.dtype == torch.float32 and out.logits is None  # the logits are never formed
    assert abs(out.loss.item() - want.loss.item()) <= tol * abs(want.loss.item())
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(patched.named_parameters(), stock.parameters()):
        assert p.grad is not None, name
        assert _relative_error(p.grad, q.grad) < (1e-3 if fp32 else 5e-2), name
    assert all(m._ahead is None for m in patched.modules() if isinstance(m, tk.nn.RMSNorm))  # every one taken


@needs_transformers
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_patched_model_under_gradient_checkpointing(use_reentrant):
    torch, stock, patched, device = _models("llama")
    ids = torch.randint(0, 160, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    losses = []
    for model in (stock, patched):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    tol = 2e-4 if stock.dtype == torch.float32 else 3e-2
    assert abs(losses[1] - losses[0]) <= tol * abs(losses[0])
    for (name, p), q in zip(patched.named_parameters(), stock.parameters()):
        assert _relative_error(p.grad, q.grad) < (1e-3 if stock.dtype == torch.float32 else 5e-2), name


@needs_transformers
def test_patched_model_trains_like_the_stock_model():
    torch, stock, patched, device = _models("llama")
    ids = torch.randint(0, 160, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)
    losses = []
    for model in (stock, patched):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for _ in range(3):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        losses.append(curve)
    (stock_curve, patched_curve), fp32 = losses, stock.dtype == torch.float32
    assert stock_curve[-1] < stock_curve[0]
    for a, b in zip(stock_curve, patched_curve):
        assert abs(a - b) <= (1e-3 if fp32 else 5e-2) * abs(a), (stock_curve, patched_curve)


@needs_transformers
def test_apply_to_names_what_it_cannot_patch():
    torch, _, _ = _setup()
    import tile_kernels.torch as tk

    with pytest.raises(ValueError, match="apply_to: model must be a transformers model of type llama"):
        tk.apply_to(torch.nn.Linear(2, 2))
    import transformers

    stock = transformers.AutoModelForCausalLM.from_config(_tiny_config("llama"))
    with pytest.raises(ValueError, match="apply_to: attention must be True, False or one of .*got 'cudnn'"):
        tk.apply_to(stock, attention="cudnn")


def _assert_gradients_match(patched, stock, fp32):
    for (name, p), q in zip(patched.named_parameters(), stock.parameters()):
        assert p.grad is not None, name
        assert _relative_error(p.grad, q.grad) < (1e-3 if fp32 else 5e-2), name


@needs_transformers
def test_patched_model_matches_the_stock_model_on_a_padded_batch():
    """A left-padded and a right-padded sequence with an attention mask (the patch unpads them into
    flash_attention_varlen): the tokens' logits, the loss and every gradient as the stock model's."""
    torch, stock, patched, device = _models("llama")
    fp32 = stock.dtype == torch.float32
    tol = 2e-4 if fp32 else 3e-2
    ids = torch.randint(0, 160, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones(2, 16, dtype=torch.long, device=device)
    mask[0, :5] = 0
    mask[1, 13:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100  # the first token is predicted from padding
    with torch.no_grad():
        got, want = patched(ids, attention_mask=mask).logits, stock(ids, attention_mask=mask).logits
    tokens = mask.bool()
    assert _relative_error(got[tokens], want[tokens]) < tol
    out, ref = patched(ids, attention_mask=mask, labels=labels), stock(ids, attention_mask=mask, labels=labels)
    assert abs(out.loss.item() - ref.loss.item()) <= tol * abs(ref.loss.item())
    out.loss.backward()
    ref.loss.backward()
    _assert_gradients_match(patched, stock, fp32)


@needs_transformers
def test_patched_model_matches_the_stock_model_on_packed_sequences():
    """Three sequences packed in one row, told apart by position_ids that restart (or by transformers' cu_seq_lens
    kwargs): the logits, and the loss and gradients of a summed loss, as the stock model's on each sequence alone."""
    torch, stock, patched, device = _models("llama")
    fp32 = stock.dtype == torch.float32
    tol = 2e-4 if fp32 else 3e-2
    lengths = (10, 6, 8)
    ids = torch.randint(0, 160, (1, sum(lengths)), generator=torch.Generator().manual_seed(4)).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = torch.tensor([0, 10, 16, 24], dtype=torch.int32, device=device)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10)
    pieces = ids.split(lengths, dim=1)
    with torch.no_grad():
        want = torch.cat([stock(piece).logits for piece in pieces], dim=1)
        assert _relative_error(patched(ids, position_ids=positions).logits, want) < tol
        assert _relative_error(patched(ids, position_ids=positions, **flash_kwargs).logits, want) < tol
    labels = torch.cat([piece.clone().index_fill_(1, torch.tensor([0], device=device), -100) for piece in pieces], 1)
    loss = patched(ids, position_ids=positions, labels=labels, num_items_in_batch=sum(lengths) - 3).loss
    ref = sum(stock(piece, labels=piece).loss * (piece.shape[1] - 1) for piece in pieces) / (sum(lengths) - 3)
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    loss.backward()
    ref.backward()
    _assert_gradients_match(patched, stock, fp32)


# ---------------------------------------------------------------------------------------------------------------- JAX

needs_flax = pytest.mark.skipif(
    importlib.util.find_spec("flax") is None or importlib.util.find_spec("jax") is None, reason="needs flax and jax"
)


@needs_flax
def test_flax_nnx_modules_match_flax_and_train_under_jit():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tile_kernels.jax import nnx as tnnx

    x = jax.random.normal(jax.random.key(0), (3, 5, 48), jnp.float32)
    ref, ours = nnx.RMSNorm(48, epsilon=1e-5, rngs=nnx.Rngs(0)), tnnx.RMSNorm(48, epsilon=1e-5)
    scale = jax.random.uniform(jax.random.key(1), (48,), jnp.float32, 0.5, 1.5)
    ref.scale, ours.scale = nnx.Param(scale), nnx.Param(scale)
    np.testing.assert_allclose(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    ref_ln, ours_ln = nnx.LayerNorm(48, epsilon=1e-5, rngs=nnx.Rngs(0)), tnnx.LayerNorm(48, epsilon=1e-5)
    scale, bias = jnp.linspace(0.5, 1.5, 48), jnp.linspace(-0.25, 0.25, 48)
    ref_ln.scale, ref_ln.bias, ours_ln.scale, ours_ln.bias = (nnx.Param(a) for a in (scale, bias, scale, bias))
    np.testing.assert_allclose(ours_ln(x), ref_ln(x), rtol=1e-5, atol=1e-5)

    mlp = tnnx.SwiGLUMLP(48, 80, rngs=nnx.Rngs(2))
    want = mlp.down_proj(jax.nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    np.testing.assert_allclose(mlp(x), want, rtol=1e-5, atol=1e-5)

    rotary = tnnx.Rotary(16, base=500.0)
    q = jax.random.normal(jax.random.key(3), (2, 7, 3, 16), jnp.float32)
    angles = np.arange(7)[:, None] * np.asarray(rotary.inv_freq, np.float64)
    c, s, a, b = np.cos(angles)[:, None], np.sin(angles)[:, None], np.asarray(q[..., :8]), np.asarray(q[..., 8:])
    np.testing.assert_allclose(rotary(q), np.concatenate([a * c - b * s, b * c + a * s], -1), rtol=1e-5, atol=1e-5)

    class Block(nnx.Module):  # norm -> MLP, as in a decoder layer
        def __init__(self):
            self.norm, self.mlp = tnnx.RMSNorm(48), tnnx.SwiGLUMLP(48, 80, rngs=nnx.Rngs(4))

        def __call__(self, x):
            return self.mlp(self.norm(x))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    def reference_loss(model, x):  # the same parameters through jnp
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + model.norm.epsilon) * model.norm.scale[...]
        m = model.mlp
        return jnp.mean(m.down_proj(jax.nn.silu(m.gate_proj(h)) * m.up_proj(h)) ** 2)

    block = Block()
    got = nnx.jit(nnx.grad(loss))(block, x)
    want = nnx.grad(reference_loss)(block, x)
    for g, w in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want))):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@needs_torch
def test_torch_ops_under_autocast_follow_its_dtypes():
    """Under autocast a float32 residual stream beside bfloat16 activations is added in float32 (as x + residual),
    and the fused LM-head loss runs its matmul in autocast's dtype with float32 master weights, returning float32."""
    torch, device, _ = _setup()
    import tile_kernels.torch as tk

    x = torch.randn(6, 32, device=device).to(torch.bfloat16)
    residual = torch.randn(6, 32, device=device, requires_grad=True)
    weight = torch.rand(32, device=device, requires_grad=True)
    hidden = torch.randn(6, 32, device=device, requires_grad=True)
    lm_head = torch.randn(40, 32, device=device, requires_grad=True)
    target = torch.randint(0, 40, (6,), device=device)
    with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
        y, h = tk.rms_norm(x, weight, residual=residual)
        loss = tk.fused_linear_cross_entropy(hidden, lm_head, target)
    assert y.dtype == h.dtype == torch.float32
    torch.testing.assert_close(h, x.float() + residual)
    assert loss.dtype == torch.float32
    want = torch.nn.functional.cross_entropy((hidden.bfloat16() @ lm_head.bfloat16().T).float(), target)
    assert abs(loss.item() - want.item()) < 2e-2 * abs(want.item())
    (loss + y.sum()).backward()
    assert lm_head.grad.dtype == torch.float32 and residual.grad.dtype == torch.float32


needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")


@needs_jax
def test_jax_decoder_with_tile_kernels_ops_matches_jnp_loss_and_gradients(monkeypatch):
    """benchmarks/train_step_jax.py's decoder (tiny shape): tile_kernels.jax's ops against plain JAX under one jit of
    value_and_grad, loss and every parameter's gradient."""
    import functools
    import pathlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    benchmarks = pathlib.Path(__file__).parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # as when the script runs: it imports train_step beside it
    spec = importlib.util.spec_from_file_location("train_step_jax", benchmarks / "train_step_jax.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gpu = DEVICE == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    params = bench.init("tiny", dtype, seed=3)
    *_, vocab, batch, seq = bench.SHAPES["tiny"]
    ids = jax.random.randint(jax.random.key(4), (batch, seq), 0, vocab)
    labels = jax.random.randint(jax.random.key(5), (batch, seq), 0, vocab)
    results = {}
    for variant in ("jnp", "tile-kernels"):
        loss = functools.partial(bench.loss_fn, bench.VARIANTS[variant](), "tiny")
        results[variant] = jax.jit(jax.value_and_grad(loss))(params, ids, labels)
    (want_loss, want), (got_loss, got) = results["jnp"], results["tile-kernels"]
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-2 if gpu else 1e-5)
    assert float(want_loss) > 4.0  # random init: about log(vocab), not a degenerate zero
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(w) > 0
        assert np.linalg.norm(g - w) <= (5e-2 if gpu else 1e-4) * np.linalg.norm(w)
