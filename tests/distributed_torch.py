"""Every registered op on DTensors, and an FSDP2 training step, over torch.distributed (one process per rank).

Launched by tests/test_distributed.py as WORLD_SIZE processes (RANK, MASTER_ADDR, MASTER_PORT set): gloo and the
Triton interpreter on a CPU, NCCL and the compiled kernels with TILE_KERNELS_TEST_DEVICE=gpu (one GPU per rank).
For each case of sharding_cases.py (one mesh dim over the ranks) it checks, against the float64 references:
  dtensor  the op on DTensors sharded as the case says: no collective in the forward (an all-reduce only where the
           rule averages over rows) nor in the backward, outputs placed as the rule says (Shard along the split dim,
           Partial for a sum, Replicate for a mean), and their values and the gradients' (full_tensor) match the
           reference on the whole arrays; a case that shards a factor the rule keeps whole checks the values only.
Then fsdp2_llama: one training step (forward, backward, SGD) of a tiny Llama-style model built from tile-kernels ops
(rms_norm with residual, apply_rotary, softmax attention, swiglu, cross_entropy) under fully_shard matches, loss,
gradients and updated parameters, the same model built from torch ops under fully_shard.
Every rank prints one JSON line per check: {"rank", "op", "case", "check", "ok", "error"}. Arguments: op names.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

DEVICE = os.environ.get("TILE_KERNELS_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TILE_KERNELS_POISON", "1")

import numpy as np  # noqa: E402
import sharding_cases as sc  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import tile_kernels.torch as tk  # noqa: E402
from tile_kernels.core import REGISTRY  # noqa: E402
from tile_kernels.core.registry import round_to, set_bfloat16_rounding  # noqa: E402

if DEVICE == "cpu":
    set_bfloat16_rounding("truncate")  # the interpreter's float32 -> bfloat16 conversion truncates


def _tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    host = np.asarray(a.astype(np.float32) if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a)
    return torch.from_numpy(host.copy()).to(device, getattr(torch, a.dtype.name))


def _np(t) -> np.ndarray:
    if isinstance(t, DTensor) and t.dtype == torch.float8_e4m3fn:  # gathered as bytes, as _distribute scatters
        local = t.to_local().view(torch.uint8)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()
        t = t.view(torch.float8_e4m3fn)
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().to("cpu", torch.float64).numpy()


def _distribute(t: torch.Tensor, mesh, placements) -> DTensor:
    """distribute_tensor; a float8 tensor travels as its bytes (gloo's scatter has no float8 types)."""
    if t.dtype != torch.float8_e4m3fn:
        return distribute_tensor(t, mesh, placements)
    d = distribute_tensor(t.view(torch.uint8), mesh, placements)
    return DTensor.from_local(d.to_local().view(t.dtype), mesh, d.placements, shape=d.shape, stride=d.stride())


def _placement(case, factors):
    axis = next((d for d, f in enumerate(factors) if f in case.split), None)
    return Shard(axis) if axis is not None else Replicate()


def _collectives(comm: CommDebugMode) -> dict:
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if n}


def check_dtensor(case, mesh, device) -> None:
    info = REGISTRY[case.op]
    kwargs = dict(case.kwargs)
    for name in case.arrays():
        kwargs[name] = _distribute(_tensor(case.kwargs[name], device), mesh, [_placement(case, case.dims(name))])
    leaves = {k: kwargs[k].requires_grad_() for k in case.grad_args()}
    with CommDebugMode() as comm:
        outs = _tuple(getattr(tk, case.op)(**kwargs))
    refs = info.reference(**case.kwargs)
    means = "mean" in case.rule.reductions.values()
    if not case.whole:
        forward = _collectives(comm)
        allowed = {"all_reduce"} if means else set()
        assert set(forward) <= allowed, f"forward collectives {forward}, expected none beyond {allowed}"
        for i, out in enumerate(outs):
            reduction = case.rule.reductions.get(i)  # a sum stays Partial; a mean too once divided by the count
            want = [(Partial(),), (Replicate(),)] if reduction == "mean" else [(Partial(),)] if reduction else []
            want = want or [(_placement(case, case.out_dims(i)),)]
            assert out.placements in want, f"output {i} placed {out.placements}, expected one of {want}"
    for i, (out, ref) in enumerate(zip(outs, refs)):
        sc.check(f"dtensor output {i}", _np(out), ref, case)
    if not leaves:  # an op without a gradient (grad_args empty): the forward only
        return

    rng = np.random.default_rng(1)
    cotangents = tuple(round_to(rng.standard_normal(r.shape), sc.dtype_of(case)) for r in refs)
    cts = [
        distribute_tensor(_tensor(c, device), mesh, [Replicate() if p.is_partial() else p for p in o.placements])
        for c, o in zip(cotangents, outs)
    ]  # fmt: skip
    with CommDebugMode() as comm:
        grads = torch.autograd.grad(outs, list(leaves.values()), cts)
    if not case.whole:
        assert not _collectives(comm), f"backward collectives {_collectives(comm)}, expected none"
    ref_grads = info.reference_vjp(case.kwargs, cotangents)
    for name, grad in zip(leaves, grads):
        sc.check(f"dtensor d{name}", _np(grad), ref_grads[name], case, name)


# ------------------------------------------------------------------------------------------------- FSDP2 Llama step

VOCAB, DIM, HEADS, HEAD_DIM, FFN, LAYERS, SEQ, BATCH = 64, 32, 4, 8, 64, 2, 8, 2


class TorchOps:
    """The model's fused ops written with torch ops (the baseline)."""

    @staticmethod
    def rms_norm(x, weight, eps=1e-6, residual=None):
        h = x if residual is None else x + residual
        y = F.rms_norm(h, (h.shape[-1],), weight, eps)
        return y if residual is None else (y, h)

    @staticmethod
    def apply_rotary(x, cos, sin):  # GPT-NeoX halves
        a, b = x.chunk(2, dim=-1)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    softmax = staticmethod(lambda x, dim=-1: F.softmax(x, dim))
    swiglu = staticmethod(lambda gate, up: F.silu(gate) * up)
    cross_entropy = staticmethod(lambda logits, target: F.cross_entropy(logits, target))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.Parameter(torch.rand(DIM) + 0.5), nn.Parameter(torch.rand(DIM) + 0.5)
        self.qkv = nn.Linear(DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.gate_up = nn.Linear(DIM, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, h, cos, sin, ops):
        b, s, _ = h.shape
        q, k, v = self.qkv(ops.rms_norm(h, self.attn_norm)).view(b, s, 3, HEADS, HEAD_DIM).unbind(2)
        q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / HEAD_DIM**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
        p = ops.softmax(scores.masked_fill(causal, float("-inf")), -1)
        attn = self.out((p @ v.transpose(1, 2)).transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))
        x, h = ops.rms_norm(attn, self.mlp_norm, residual=h)  # h = attn + h, x = rms_norm(h)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return h + self.down(ops.swiglu(gate.contiguous(), up.contiguous()))


class Llama(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.rand(DIM) + 0.5)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        angles = torch.arange(SEQ)[:, None] * (10000.0 ** (-torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))[None]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, self.cos, self.sin, self.ops)
        logits = self.head(self.ops.rms_norm(h, self.norm))
        return self.ops.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def check_fsdp2_llama(mesh, device) -> None:
    rank = dist.get_rank()
    models = {}
    for name, ops in (("tile_kernels", tk), ("torch", TorchOps)):
        torch.manual_seed(0)  # the same initial weights on every rank and for both models
        model = Llama(ops).to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        models[name] = fully_shard(model, mesh=mesh)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator).to(device)
    results = {}
    for name, model in models.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizer.step()
        results[name] = loss.detach(), grads, {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    (loss, grads, params), (loss_ref, grads_ref, params_ref) = results["tile_kernels"], results["torch"]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss: {m}")
    assert grads.keys() == grads_ref.keys() and len(grads) == 3 + 6 * LAYERS
    for n in grads:
        assert grads[n].abs().max() > 0, f"gradient of {n} is zero: the test would not see a wrong one"
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"d{n}: {m}")
        torch.testing.assert_close(params[n], params_ref[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def _report(rank, op, case, check, fn) -> None:
    try:
        fn()
        result = {"ok": True, "error": ""}
    except Exception as e:  # reported, the next check runs
        result = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"}
    print(json.dumps({"rank": rank, "op": op, "case": case, "check": check, **result}), flush=True)


def main(ops: list[str]) -> None:
    gpu = DEVICE == "gpu"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    try:
        for op in ops:
            for case in sc.cases(op, world):
                if not gpu and case.whole and any(case.kwargs[k].dtype.name == "float8_e4m3fn" for k in case.arrays()):
                    skipped = "skipped: gloo's collectives have no float8 types; the gather runs on GPUs (NCCL)"
                    print(json.dumps({"rank": rank, "op": op, "case": case.name, "check": "dtensor", "ok": True,
                                      "error": skipped}), flush=True)  # fmt: skip
                    continue
                _report(rank, op, case.name, "dtensor", lambda c=case: check_dtensor(c, mesh, device))
        _report(rank, "fsdp2_llama", "2 layers, SGD step", "fsdp2", lambda: check_fsdp2_llama(mesh, device))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(REGISTRY))
