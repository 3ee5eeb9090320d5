"""MoE routing beyond the registry-driven suite: the route is a stable sort with dropped choices (several route
blocks, many experts), and a whole MoE layer (route, permute, grouped_matmul, swiglu, grouped_matmul, unpermute) in
torch and JAX matches a float64 loop over the experts, gradients included; torch opcheck of the ops."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, OPCHECK_UTILS, needs_torch
from drivers import DRIVERS

from tile_kernels.core import moe
from tile_kernels.core.plan import Target

needs_jax = pytest.mark.skipif("jax" not in DRIVERS, reason="jax not installed")
DEV = "cuda" if DEVICE == "gpu" else "cpu"
T, D, F, E, K = 37, 48, 32, 6, 2  # tokens, model dim, expert hidden dim, experts, top-k


@needs_torch
@pytest.mark.parametrize("experts", [3, 64, 300])
def test_route_is_a_stable_sort_across_blocks(experts):
    """1500 tokens x 4 choices span several route blocks (64 and 300 experts: 128- and 16-choice blocks): each
    expert's choices keep their row-major order, dropped ones (-1, E) get -1, the sizes count the rest."""
    import torch

    import tile_kernels.torch as tk

    ids = moe._sample_ids(np.random.default_rng(experts), 1500, 4, experts)
    assert moe.route(1500, 4, experts, target=Target()).launches[0].grid[0] > 1
    positions, sizes = tk.moe_route(torch.from_numpy(ids).to(DEV), experts)
    ref_positions, ref_sizes = moe.reference_route(ids, experts)
    np.testing.assert_array_equal(positions.cpu().numpy(), ref_positions)
    np.testing.assert_array_equal(sizes.cpu().numpy(), ref_sizes)
    flat, kept = positions.cpu().numpy().reshape(-1), ((ids >= 0) & (ids < experts)).reshape(-1)
    assert np.array_equal(np.sort(flat[kept]), np.arange(kept.sum())) and np.all(flat[~kept] == -1)


def _layer_reference(x, ids, gates, w_up, w_down):
    """float64: out[t] = sum_j gates[t, j] swiglu-MLP of expert ids[t, j] applied to x[t] (dropped choices skipped)."""
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if 0 <= e < w_up.shape[0]:
                h = x[t] @ w_up[e]
                gate, up = h[:F], h[F:]
                out[t] += gates[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


def _problem():
    rng = np.random.default_rng(7)
    ids = moe._sample_ids(rng, T, K, E)
    gates = rng.random((T, K)) + 0.1
    return (rng.standard_normal((T, D)), ids, gates / gates.sum(1, keepdims=True),
            rng.standard_normal((E, D, 2 * F)) / np.sqrt(D), rng.standard_normal((E, F, D)) / np.sqrt(F))  # fmt: skip


@needs_torch
def test_torch_moe_layer_matches_a_loop_over_experts():
    import torch

    import tile_kernels.torch as tk

    x, ids, gates, w_up, w_down = _problem()
    args = [torch.tensor(a, device=DEV, dtype=torch.float32, requires_grad=True) for a in (x, gates, w_up, w_down)]
    xt, gt, upt, downt = args
    positions, sizes = tk.moe_route(torch.from_numpy(ids).to(DEV), E)
    h = tk.grouped_matmul(tk.moe_permute(xt, positions), upt, sizes)
    ys = tk.grouped_matmul(tk.swiglu(h[:, :F].contiguous(), h[:, F:].contiguous()), downt, sizes)
    out = tk.moe_unpermute(ys, positions, gt)
    np.testing.assert_allclose(out.detach().cpu().numpy(), _layer_reference(x, ids, gates, w_up, w_down), atol=1e-4)

    cot = np.random.default_rng(8).standard_normal((T, D))
    out.backward(torch.tensor(cot, device=DEV, dtype=torch.float32))
    ref_args = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, gates, w_up, w_down)]
    ref = _torch_reference(torch, ids, *ref_args)
    ref.backward(torch.tensor(cot))
    for name, got, want in zip(("x", "gates", "w_up", "w_down"), args, ref_args):
        np.testing.assert_allclose(got.grad.cpu().numpy(), want.grad.numpy(), atol=2e-4, err_msg=f"d{name}")


def _torch_reference(torch, ids, x, gates, w_up, w_down):
    """The float64 loop in torch (autograd gives the reference gradients)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < E:
                h = x[t] @ w_up[e]
                out[t] = out[t] + gates[t, j] * ((torch.nn.functional.silu(h[:F]) * h[F:]) @ w_down[e])
    return out


@needs_jax
def test_jax_moe_layer_jit_and_grad():
    import jax
    import jax.numpy as jnp

    import tile_kernels.jax as tk

    x, ids, gates, w_up, w_down = _problem()
    ids_j = jnp.asarray(ids)

    def layer(x, gates, w_up, w_down):
        positions, sizes = tk.moe_route(ids_j, E)
        h = tk.grouped_matmul(tk.moe_permute(x, positions), w_up, sizes)
        ys = tk.grouped_matmul(tk.swiglu(h[:, :F], h[:, F:]), w_down, sizes)
        return tk.moe_unpermute(ys, positions, gates)

    arrays = [jnp.asarray(a, jnp.float32) for a in (x, gates, w_up, w_down)]
    out = jax.jit(layer)(*arrays)
    np.testing.assert_allclose(np.asarray(out), _layer_reference(x, ids, gates, w_up, w_down), atol=1e-4)
    grads = jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 1))(*arrays)
    eps = 1e-3  # a central difference of the float64 reference along one gate
    bump = np.zeros_like(gates)
    bump[3, 1] = eps
    loss = [np.sum(_layer_reference(x, ids, gates + s * bump, w_up, w_down) ** 2) for s in (1, -1)]
    np.testing.assert_allclose(float(grads[1][3, 1]), (loss[0] - loss[1]) / (2 * eps), rtol=1e-3)
    assert np.abs(np.asarray(grads[0])).max() > 0


@needs_torch
def test_torch_opcheck():
    import torch

    import tile_kernels.torch  # noqa: F401  (registers the ops)

    kwargs = moe.sample_unpermute(np.random.default_rng(9), (5, 24), "float32", topk=3, experts=4)
    ys, positions, weights = (torch.from_numpy(kwargs[n]).to(DEV) for n in ("ys", "positions", "weights"))
    x = torch.randn(5, 24, device=DEV)
    ids = torch.from_numpy(moe._sample_ids(np.random.default_rng(10), 5, 3, 4)).to(DEV)
    ops = torch.ops.tile_kernels
    for op, args in [(ops.moe_route.default, (ids, 4)), (ops.moe_permute.default, (x, positions)),
                     (ops.moe_unpermute.default, (ys, positions, weights))]:  # fmt: skip
        result = torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
