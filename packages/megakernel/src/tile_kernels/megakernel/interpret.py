"""Reference interpreter: runs the task graph tile by tile on CPU torch tensors, in one legal interleaving of the
schedule's queues (the lowest runnable queue first, or a random runnable queue at every step with `rng`).

Every intermediate buffer and the KV cache row at `position` are poisoned with NaN first, so a task that runs before
the data it reads is written (a missing or wrong dependency) poisons the result instead of passing silently. The math
per task kind is in graph.py's docstring; ATTN writes flash-decoding partials (o = sum_j e^(s_j - m) v_j,
m = max_j s_j, l = sum_j e^(s_j - m)) that COMBINE joins: a = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s."""

from __future__ import annotations

import random

import torch

from .check import describe_stuck, run_queues
from .config import DecoderConfig
from .graph import Kind, Task, TaskGraph, qkv_rows_of_group
from .reference import check_step_inputs, rope_cos_sin
from .schedule import Schedule


class DeadlockError(RuntimeError):
    def __init__(self, stuck: list[str]):
        self.stuck = stuck
        super().__init__("the queues deadlocked:\n  " + "\n  ".join(stuck))


def _rms(c: DecoderConfig, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return v * torch.rsqrt(v.square().mean() + c.rms_eps) * w


def _run_task(c: DecoderConfig, S: int, t: Task, b: dict, kv: torch.Tensor, pos: int, cos, sin) -> None:
    D, G, Hq, H, L = c.head_dim, c.group, c.num_heads, c.hidden, f"[{t.layer}]"
    if t.kind == Kind.QKV:
        n1 = _rms(c, b[f"x{L}"], b[f"w_attn_norm{L}"])
        b[f"qkv{L}"][t.lo : t.hi] = b[f"wqkv{L}"].view(-1, H)[t.lo : t.hi] @ n1 + b[f"wqkv_bias{L}"][t.lo : t.hi]
    elif t.kind == Kind.ATTN:
        g, s = t.lo, t.split
        lo, hi = qkv_rows_of_group(c, g)
        seg = b[f"qkv{L}"][lo:hi].view(G + 2, D)
        x1, x2 = seg[: G + 1, : D // 2], seg[: G + 1, D // 2 :]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # G q heads, then k_g
        q, k_new, v_new = rot[:G], rot[G].to(kv.dtype), seg[G + 1].to(kv.dtype)
        if s == 0:  # the new token: its KV cache row, and its place in split 0 (from registers, not re-read)
            kv[t.layer, 0, pos, g], kv[t.layer, 1, pos, g] = k_new, v_new
        chunk = -(-pos // S)
        a, e = min(pos, s * chunk), min(pos, (s + 1) * chunk)
        keys, vals = kv[t.layer, 0, a:e, g].to(q.dtype), kv[t.layer, 1, a:e, g].to(q.dtype)
        if s == 0:
            keys = torch.cat([keys, k_new.to(q.dtype)[None]])
            vals = torch.cat([vals, v_new.to(q.dtype)[None]])
        scores = q @ keys.T / D**0.5  # (G, positions)
        m = scores.amax(dim=1) if len(keys) else torch.full((G,), -torch.inf, dtype=q.dtype)
        p = torch.exp(scores - m[:, None])
        row = (s * Hq + g * G) * (D + 2)
        b[f"att{L}"][row : row + G * (D + 2)] = torch.cat([p @ vals, m[:, None], p.sum(1)[:, None]], 1).reshape(-1)
    elif t.kind == Kind.COMBINE:
        heads = slice(t.lo * G, t.hi * G)
        part = b[f"att{L}"].view(S, Hq, D + 2)[:, heads]
        o, m, l_ = part[..., :D], part[..., D], part[..., D + 1]
        scale = torch.exp(m - m.amax(dim=0))  # (S, G); an empty split has m = -inf, scale 0
        attn = (scale[..., None] * o).sum(0) / (scale * l_).sum(0)[:, None]
        b[f"ao{L}"].view(Hq, D)[heads] = attn
    elif t.kind == Kind.OPROJ:
        b[f"h{L}"][t.lo : t.hi] = b[f"x{L}"][t.lo : t.hi] + b[f"wo{L}"].view(H, -1)[t.lo : t.hi] @ b[f"ao{L}"]
    elif t.kind == Kind.GATEUP:
        n2, I_ = _rms(c, b[f"h{L}"], b[f"w_mlp_norm{L}"]), c.intermediate
        gate = b[f"wgate{L}"].view(I_, H)[t.lo : t.hi] @ n2
        b[f"act{L}"][t.lo : t.hi] = torch.nn.functional.silu(gate) * (b[f"wup{L}"].view(I_, H)[t.lo : t.hi] @ n2)
    elif t.kind == Kind.DOWN:
        w = b[f"wdown{L}"].view(H, -1)[t.lo : t.hi]
        b[f"x[{t.layer + 1}]"][t.lo : t.hi] = b[f"h{L}"][t.lo : t.hi] + w @ b[f"act{L}"]
    else:
        raise ValueError(f"interpret: unknown task kind {t.kind!r}")


def interpret(
    graph: TaskGraph,
    sched: Schedule,
    packed: dict,
    hidden: torch.Tensor,
    kv_cache: torch.Tensor,
    position: int,
    rng: random.Random | int | None = None,
    dtype: torch.dtype = torch.float64,
    buffers: dict | None = None,
) -> torch.Tensor:
    """Runs one decode step: writes kv_cache[:, :, position] in place, returns the new hidden (shape of `hidden`).
    `packed` is graph.pack_weights' output; everything is computed in `dtype`. Raises DeadlockError, naming each stuck
    queue head and the waits it cannot meet, when the queues cannot finish."""
    c = graph.config
    check_step_inputs(c, hidden, kv_cache, position)
    if hidden.device.type != "cpu" or kv_cache.device.type != "cpu":
        raise ValueError(f"interpret: needs CPU tensors, got hidden on {hidden.device}, kv_cache on {kv_cache.device}")
    if isinstance(rng, int):
        rng = random.Random(rng)
    order, stuck = run_queues(graph, sched.queues, pick=rng.choice if rng is not None else None)
    if stuck:
        raise DeadlockError(describe_stuck(graph, order, stuck))
    bufs = {name: torch.full((size,), torch.nan, dtype=dtype) for name, size in graph.buffers.items()}
    for name, tensor in packed.items():
        if name not in bufs or tensor.numel() != bufs[name].numel():
            raise ValueError(f"interpret: packed weight {name!r} does not match the graph's buffer table")
        bufs[name] = tensor.to(dtype)
    bufs["x[0]"] = hidden.reshape(-1).to(dtype)
    kv_cache[:, :, position] = torch.nan
    cos, sin = rope_cos_sin(c, position, dtype)
    for tid in order:
        _run_task(c, graph.tiling.kv_splits, graph.tasks[tid], bufs, kv_cache, position, cos, sin)
    if buffers is not None:
        buffers.update(bufs)
    return bufs[graph.output].to(hidden.dtype).reshape(hidden.shape)
