"""Mixture-of-experts routing around grouped_matmul: moe_route, moe_permute, moe_unpermute.

A MoE layer routes token t to its top-k experts expert_ids[t, :] (int32 (T, k)) with gates weights[t, :]:

    positions, group_sizes = moe_route(expert_ids, num_experts)   # where each (token, choice) goes, sorted by expert
    xs = moe_permute(x, positions)                                 # (T k, D): xs[positions[t, j]] = x[t]
    ys = f(xs, group_sizes)                                        # e.g. grouped_matmul per expert
    out = moe_unpermute(ys, positions, weights)                    # out[t] = sum_j weights[t, j] ys[positions[t, j]]

moe_route: a stable counting sort of the T k choices by expert: positions[t, j] = start of expert e = expert_ids[t, j]
(the sizes of the experts before it) + the number of choices of e before (t, j) in row-major order; group_sizes[e]
the choices of e. A choice outside [0, num_experts) is dropped: position -1, counted nowhere (an expert-parallel rank
masks other ranks' experts so). Three launches: per-block counts (route_counts_kernel), the experts' starts and each
block's offsets by one program (route_offsets_kernel), each choice's rank in its block by a cumulative sum of one-hot
rows (route_positions_kernel). Not differentiable.

moe_permute / moe_unpermute move rows by positions (-1 skipped): scatter_rows_kernel (a program a token and D block
writes its row to its k places, times a gate where one is given) and gather_rows_kernel (sums the k rows it reads,
times their gates, in fp32, one rounding). Each is the other's gradient; moe_unpermute's gate gradient dweights[t, j]
= dout[t] . ys[positions[t, j]] is row_dots_kernel. Rows of xs no choice lands on are 0. Differentiable: moe_permute
in x, moe_unpermute in ys and weights (float32 or ys's dtype); positions are trusted to come from moe_route (below
the rows of xs / ys: not checked, a host sync). Design limits: route_offsets_kernel is one program walking the blocks
twice (2048 blocks of 32 choices at 8192 tokens x 8 of 256 experts; not yet timed on a GPU); the permute is not fused
into grouped_matmul's loads (a gather there would save xs's round trip through memory).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from . import checks
from .plan import ITEMSIZE, BufferSpec, Launch, Plan, Target, cdiv, in_units, next_power_of_2
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

ONE_HOT_ELEMENTS = 8192  # a route block's (choices x experts) one-hot tile


@triton.jit
def _one_hot(IDS, S, E, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """(slots, hits): this program's BLOCK choices and their (BLOCK, E_PAD) one-hot rows (all 0 when dropped)."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(IDS + s, mask=s < S, other=-1)
    e = tl.arange(0, E_PAD)
    return s, (ids[:, None] == e[None, :]) & (e[None, :] < E)


@triton.jit
def route_counts_kernel(IDS, S, E, COUNTS, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """COUNTS[b, e] = the choices of expert e in block b; grid (cdiv(S, BLOCK),)."""
    _, hits = _one_hot(IDS, S, E, BLOCK, E_PAD)
    tl.store(COUNTS + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD), tl.sum(hits.to(tl.int32), axis=0))


@triton.jit
def route_offsets_kernel(COUNTS, BLOCKS, E, OFFSETS, SIZES, E_PAD: tl.constexpr):
    """SIZES[e] = sum_b COUNTS[b, e]; OFFSETS[b, e] = expert e's start + its choices in blocks before b; grid (1,)."""
    e = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    for b in range(BLOCKS):
        total += tl.load(COUNTS + b * E_PAD + e)
    tl.store(SIZES + e, total, mask=e < E)
    running = tl.cumsum(total, 0) - total
    for b in range(BLOCKS):
        tl.store(OFFSETS + b * E_PAD + e, running)
        running += tl.load(COUNTS + b * E_PAD + e)


@triton.jit
def route_positions_kernel(IDS, OFFSETS, S, E, POS, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """POS[s] = OFFSETS[b, e] + the choices of e before s in block b (a cumulative sum down the one-hot rows), -1
    for a dropped choice; grid (cdiv(S, BLOCK),)."""
    s, hits = _one_hot(IDS, S, E, BLOCK, E_PAD)
    ranks = tl.cumsum(hits.to(tl.int32), 0) - 1 + tl.load(OFFSETS + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD))
    pos = tl.sum(tl.where(hits, ranks, 0), axis=1)
    tl.store(POS + s, tl.where(tl.sum(hits.to(tl.int32), axis=1) > 0, pos, -1), mask=s < S)


@triton.jit
def scatter_rows_kernel(SRC, POS, W, K, D, OUT, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr, UNIT: tl.constexpr):
    """OUT[POS[t, j]] = W[t, j] SRC[t] (W 1 without) for each j with POS[t, j] >= 0; grid (T, cdiv(D, BLOCK_D))."""
    D = D * UNIT  # plan.in_units
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(SRC + t.to(tl.int64) * D + d, mask=d < D, other=0.0).to(tl.float32)
    for j in range(K):
        p = tl.load(POS + t * K + j)
        value = row * tl.load(W + t * K + j).to(tl.float32) if HAS_W else row
        kept = d < tl.where(p >= 0, D, 0)  # no column of a dropped choice
        tl.store(OUT + tl.maximum(p, 0).to(tl.int64) * D + d, value.to(OUT.dtype.element_ty), mask=kept)


@triton.jit
def gather_rows_kernel(SRC, POS, W, K, D, OUT, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr, UNIT: tl.constexpr):
    """OUT[t] = sum_j W[t, j] SRC[POS[t, j]] (W 1 without) over j with POS[t, j] >= 0, in fp32; grid as scatter's."""
    D = D * UNIT  # plan.in_units
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(K):
        p = tl.load(POS + t * K + j)
        kept = d < tl.where(p >= 0, D, 0)  # no column of a dropped choice
        row = tl.load(SRC + tl.maximum(p, 0).to(tl.int64) * D + d, mask=kept, other=0.0).to(tl.float32)
        acc += row * tl.load(W + t * K + j).to(tl.float32) if HAS_W else row
    tl.store(OUT + t.to(tl.int64) * D + d, acc.to(OUT.dtype.element_ty), mask=d < D)


@triton.jit
def row_dots_kernel(DOUT, Y, POS, K, D, DW, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr):
    """DW[t, j] = sum_d DOUT[t, d] Y[POS[t, j], d] (0 where POS[t, j] < 0), in fp32; grid (T,)."""
    D = D * UNIT  # plan.in_units
    t = tl.program_id(0)
    jj = tl.arange(0, BLOCK_K)
    p = tl.load(POS + t * K + jj, mask=jj < K, other=-1)
    rows = Y + tl.maximum(p, 0).to(tl.int64)[:, None] * D
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        g = tl.load(DOUT + t.to(tl.int64) * D + d, mask=d < D, other=0.0).to(tl.float32)
        y = tl.load(rows + d[None, :], mask=(p >= 0)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(y * g[None, :], axis=1)
    tl.store(DW + t * K + jj, acc.to(DW.dtype.element_ty), mask=jj < K)


# ---------------------------------------------------------------------------------------------------------------------
# validation


def check_route(expert_ids, num_experts) -> None:
    checks.check_same_dtype("moe_route", "expert_ids", expert_ids, "int32", "each token's top-k experts")
    if len(expert_ids.shape) != 2:
        raise ValueError(f"moe_route: expert_ids must be 2-D (T, k), got shape {tuple(expert_ids.shape)}")
    if checks.check_int("moe_route", "num_experts", num_experts) < 1:
        raise ValueError(f"moe_route: num_experts must be at least 1, got {num_experts}")


def _check_positions(op: str, positions, tokens: int, owner: str) -> None:
    checks.check_same_dtype(op, "positions", positions, "int32", "moe_route's")
    if len(positions.shape) != 2 or positions.shape[0] != tokens:
        raise ValueError(f"{op}: positions must be 2-D (T, k) with T = {tokens} ({owner}), got shape "
                         f"{tuple(positions.shape)}")  # fmt: skip


def check_permute(x, positions) -> None:
    checks.check_float("moe_permute", "x", x)
    if len(x.shape) != 2:
        raise ValueError(f"moe_permute: x must be 2-D (T, D), got shape {tuple(x.shape)}")
    _check_positions("moe_permute", positions, x.shape[0], "x's rows")


def check_unpermute(ys, positions, weights) -> None:
    dtype = checks.check_float("moe_unpermute", "ys", ys)
    if len(ys.shape) != 2:
        raise ValueError(f"moe_unpermute: ys must be 2-D (T k, D), got shape {tuple(ys.shape)}")
    checks.check_array("moe_unpermute", "weights", weights)
    if len(weights.shape) != 2:
        raise ValueError(f"moe_unpermute: weights must be 2-D (T, k), got shape {tuple(weights.shape)}")
    w_dtype = checks.check_float("moe_unpermute", "weights", weights)
    if w_dtype not in (dtype, "float32"):
        raise TypeError(f"moe_unpermute: weights must have dtype float32 or {dtype} (ys's), got {w_dtype}")
    _check_positions("moe_unpermute", positions, weights.shape[0], "weights' rows")
    checks.check_shape("moe_unpermute", "positions", positions, tuple(weights.shape), "that of weights")


# ---------------------------------------------------------------------------------------------------------------------
# plans


def route(t: int, k: int, num_experts: int, *, target: Target) -> Plan:
    """Input expert_ids (T, k) int32 compact. Outputs positions (T, k) and group_sizes (E,) int32."""
    e_pad = max(16, next_power_of_2(num_experts))
    block = max(16, min(1024, ONE_HOT_ELEMENTS // e_pad))
    s, blocks = t * k, cdiv(t * k, block)
    buffers = {"positions": BufferSpec((t, k), "int32", zeroed=not s),
               "group_sizes": BufferSpec((num_experts,), "int32", zeroed=not s),
               "counts": BufferSpec((blocks, e_pad), "int32"),
               "offsets": BufferSpec((blocks, e_pad), "int32")}  # fmt: skip
    launches = ()
    if s:
        consts = dict(BLOCK=block, E_PAD=e_pad)
        warps = 8 if block * e_pad >= 4096 else 4
        launches = (
            Launch(route_counts_kernel, (blocks,), ("expert_ids", s, num_experts), ("counts",), consts, warps, 1),
            Launch(
                route_offsets_kernel,
                (1,),
                ("counts", blocks, num_experts),
                ("offsets", "group_sizes"),
                dict(E_PAD=e_pad),
                4,
                1,
            ),  # fmt: skip
            Launch(
                route_positions_kernel,
                (blocks,),
                ("expert_ids", "offsets", s, num_experts),
                ("positions",),
                consts,
                warps,
                1,
            ),  # fmt: skip
        )
    else:
        buffers = {n: b for n, b in buffers.items() if n in ("positions", "group_sizes")}
    return Plan({"expert_ids": "int32"}, buffers, launches, ("positions", "group_sizes"))


def _rows_launch(kernel, src: str, weights: str | None, out: str, t: int, k: int, d: int) -> Launch:
    block_d = min(1024, max(16, next_power_of_2(d)))
    grid = (t, cdiv(d, block_d))
    launch = Launch(kernel, grid, (src, "positions", weights, k, d), (out,),
                    dict(BLOCK_D=block_d, HAS_W=weights is not None), 4 if block_d <= 512 else 8, 1)  # fmt: skip
    return in_units(launch, "D", units=(16, 8))


def permute(t: int, k: int, d: int, *, dtype: str, target: Target) -> Plan:
    """Inputs x (T, D) and positions (T, k), compact. Output xs (T k, D) compact in x's dtype, zeroed first."""
    buffers = {"xs": BufferSpec((t * k, d), dtype, zeroed=True)}
    launches = (_rows_launch(scatter_rows_kernel, "x", None, "xs", t, k, d),) if t and k and d else ()
    return Plan({"x": dtype, "positions": "int32"}, buffers, launches, ("xs",))


def permute_backward(t: int, k: int, d: int, *, dtype: str, target: Target) -> Plan:
    """Inputs dxs (T k, D) and positions (T, k). Output dx (T, D): the sum of the rows each token was copied to."""
    buffers = {"dx": BufferSpec((t, d), dtype, zeroed=not (t and d))}
    launches = (_rows_launch(gather_rows_kernel, "dxs", None, "dx", t, k, d),) if t and d else ()
    return Plan({"dxs": dtype, "positions": "int32"}, buffers, launches, ("dx",))


def unpermute(t: int, k: int, rows: int, d: int, *, dtype: str, weights_dtype: str, target: Target) -> Plan:
    """Inputs ys (rows, D), positions (T, k), weights (T, k). Output out (T, D) in ys's dtype."""
    inputs = {"ys": dtype, "positions": "int32", "weights": weights_dtype}
    buffers = {"out": BufferSpec((t, d), dtype, zeroed=not (t and d))}
    launches = (_rows_launch(gather_rows_kernel, "ys", "weights", "out", t, k, d),) if t and d else ()
    return Plan(inputs, buffers, launches, ("out",))


def unpermute_backward(t: int, k: int, rows: int, d: int, *, dtype: str, weights_dtype: str, target: Target) -> Plan:
    """Inputs dout (T, D), ys (rows, D), positions (T, k), weights (T, k). Outputs dys (rows, D) (zeroed first:
    rows no choice reads get 0) and dweights (T, k) in weights' dtype."""
    inputs = {"dout": dtype, "ys": dtype, "positions": "int32", "weights": weights_dtype}
    buffers = {"dys": BufferSpec((rows, d), dtype, zeroed=True),
               "dweights": BufferSpec((t, k), weights_dtype, zeroed=not (t and k))}  # fmt: skip
    launches = ()
    if t and k and d:
        launches += (_rows_launch(scatter_rows_kernel, "dout", "weights", "dys", t, k, d),)
    if t and k:
        block_k = max(2, next_power_of_2(k))
        block_d = min(max(16, next_power_of_2(d)), max(16, 4096 // block_k))
        dots = Launch(row_dots_kernel, (t,), ("dout", "ys", "positions", k, d), ("dweights",),
                      dict(BLOCK_K=block_k, BLOCK_D=block_d), 4, 1)  # fmt: skip
        launches += (in_units(dots, "D", units=(16, 8)),)
    return Plan(inputs, buffers, launches, ("dys", "dweights"))


# ---------------------------------------------------------------------------------------------------------------------
# references, costs, samples


def reference_route(expert_ids, num_experts):
    """Stable sort of the choices by expert (dropped ones last, position -1)."""
    ids = np.asarray(expert_ids).reshape(-1)
    kept = (ids >= 0) & (ids < num_experts)
    order = np.argsort(np.where(kept, ids, num_experts), kind="stable")[: kept.sum()]
    positions = np.full(ids.size, -1, np.int64)
    positions[order] = np.arange(order.size)
    sizes = np.bincount(ids[kept], minlength=num_experts)
    return positions.reshape(expert_ids.shape).astype(np.float64), sizes.astype(np.float64)


def _choices(positions):
    """(t, j, position) of every kept choice."""
    t, j = np.nonzero(np.asarray(positions) >= 0)
    return t, j, np.asarray(positions)[t, j]


def reference_permute(x, positions):
    xs = np.zeros((positions.size, x.shape[1]))
    t, _, p = _choices(positions)
    xs[p] = x[t].astype(np.float64)
    return (xs,)


def reference_permute_vjp(kwargs, cotangents):
    dxs, positions = np.asarray(cotangents[0], np.float64), kwargs["positions"]
    dx = np.zeros(kwargs["x"].shape)
    t, _, p = _choices(positions)
    np.add.at(dx, t, dxs[p])
    return {"x": dx}


def reference_unpermute(ys, positions, weights):
    out = np.zeros((positions.shape[0], ys.shape[1]))
    t, j, p = _choices(positions)
    np.add.at(out, t, weights[t, j].astype(np.float64)[:, None] * ys[p].astype(np.float64))
    return (out,)


def reference_unpermute_vjp(kwargs, cotangents):
    dout = np.asarray(cotangents[0], np.float64)
    ys, positions, weights = kwargs["ys"].astype(np.float64), kwargs["positions"], kwargs["weights"]
    dys, dweights = np.zeros(ys.shape), np.zeros(weights.shape)
    t, j, p = _choices(positions)
    np.add.at(dys, p, weights[t, j].astype(np.float64)[:, None] * dout[t])
    dweights[t, j] = np.sum(dout[t] * ys[p], axis=1)
    return {"ys": dys, "weights": dweights}


def _sample_ids(rng: np.random.Generator, t: int, k: int, experts: int) -> np.ndarray:
    """Distinct experts per token where there are enough (top-k), about one choice in 10 dropped (-1 or past E)."""
    ids = np.argsort(rng.random((t, max(experts, k))), axis=1)[:, :k] % experts
    dropped = rng.random((t, k)) < 0.1
    return np.where(dropped, rng.choice([-1, experts], (t, k)), ids).astype(np.int32)


def _dims(rng, shape, topk, experts):
    """(T, k, E, D): T the product of the leading dims, D the last; k in 1 .. 4 and E in 1 .. 8 or 64 unless given."""
    shape = tuple(shape)
    k = topk or int(rng.integers(1, 5))
    e = experts or int(rng.choice([1, 2, 3, 5, 8, 64]))
    return int(np.prod(shape[:-1])), k, e, shape[-1]


def sample_route(rng, shape, dtype, topk=None, experts=None) -> dict:
    """dtype unused (the ids are int32)."""
    t, k, e, _ = _dims(rng, shape, topk, experts)
    return {"expert_ids": _sample_ids(rng, t, k, e), "num_experts": e}


def sample_permute(rng, shape, dtype, topk=None, experts=None) -> dict:
    t, k, e, d = _dims(rng, shape, topk, experts)
    positions = reference_route(_sample_ids(rng, t, k, e), e)[0].astype(np.int32)
    return {"x": round_to(rng.standard_normal((t, d)), dtype), "positions": positions}


def sample_unpermute(rng, shape, dtype, topk=None, experts=None, fp32_weights=False) -> dict:
    t, k, e, d = _dims(rng, shape, topk, experts)
    positions = reference_route(_sample_ids(rng, t, k, e), e)[0].astype(np.int32)
    gates = rng.random((t, k)) + 0.1
    return {"ys": round_to(rng.standard_normal((t * k, d)), dtype), "positions": positions,
            "weights": round_to(gates / gates.sum(1, keepdims=True), "float32" if fp32_weights else dtype)}  # fmt: skip


def cost_route(kwargs) -> tuple[Cost, Cost]:
    ids = kwargs["expert_ids"]
    return Cost(4 * (2 * ids.size + kwargs["num_experts"]), 0), Cost(0, 0)


def cost_permute(kwargs) -> tuple[Cost, Cost]:
    """x read once and written k times; the backward reads k rows a token and writes one."""
    x, k = kwargs["x"], kwargs["positions"].shape[1]
    rows = x.size * ITEMSIZE[str(x.dtype)]
    return Cost(rows * (1 + k), 0), Cost(rows * (1 + k), 0)


def cost_unpermute(kwargs) -> tuple[Cost, Cost]:
    """ys read once, out written; the backward reads ys and dout, writes dys."""
    ys, t = kwargs["ys"], kwargs["positions"].shape[0]
    item = ITEMSIZE[str(ys.dtype)]
    out = t * ys.shape[1] * item
    return Cost(ys.size * item + out, 2 * ys.size), Cost(2 * ys.size * item + out, 4 * ys.size)


def bad_route(kwargs) -> list[BadInput]:
    ids = kwargs["expert_ids"]
    return [
        BadInput({"expert_ids": ids.astype(np.float32)}, TypeError, "moe_route: expert_ids must have dtype int32"),
        BadInput({"expert_ids": ids.reshape(-1)}, ValueError, "moe_route: expert_ids must be 2-D"),
        BadInput({"num_experts": 0}, ValueError, "moe_route: num_experts must be at least 1"),
        BadInput({"num_experts": 2.0}, TypeError, "moe_route: num_experts must be"),
        *not_arrays("moe_route", "expert_ids"),
    ]


def bad_permute(kwargs) -> list[BadInput]:
    x, positions = kwargs["x"], kwargs["positions"]
    return [
        BadInput({"x": x.astype(np.int32)}, TypeError, "moe_permute: x must have dtype"),
        BadInput({"x": x[None]}, ValueError, "moe_permute: x must be 2-D"),
        BadInput({"positions": positions.astype(np.float32)}, TypeError, "moe_permute: positions must have dtype"),
        BadInput({"positions": positions[:-1]}, ValueError, "moe_permute: positions must be 2-D"),
        *not_arrays("moe_permute", "x", "positions"),
    ]


def bad_unpermute(kwargs) -> list[BadInput]:
    ys, positions, weights = kwargs["ys"], kwargs["positions"], kwargs["weights"]
    other = np.float16 if ys.dtype != np.float16 else np.float64
    return [
        BadInput({"ys": ys.astype(np.int32)}, TypeError, "moe_unpermute: ys must have dtype"),
        BadInput({"ys": ys[None]}, ValueError, "moe_unpermute: ys must be 2-D"),
        BadInput({"weights": weights.astype(other)}, TypeError, "moe_unpermute: weights must have dtype"),
        BadInput({"weights": weights[:, :0]}, ValueError, "moe_unpermute: positions must have shape"),
        BadInput({"positions": positions.astype(np.float32)}, TypeError, "moe_unpermute: positions must have dtype"),
        *not_arrays("moe_unpermute", "ys", "positions", "weights"),
    ]


def plans_route(target: Target):
    """DeepSeek-V3's routing (8 of 256 experts) and Mixtral's (2 of 8) over 8192 tokens."""
    yield route(8192, 8, 256, target=target)
    yield route(8192, 2, 8, target=target)


def plans_permute(target: Target):
    for dtype in ("float32", "float16", "bfloat16"):
        yield permute(8192, 8, 7168, dtype=dtype, target=target)
        yield permute_backward(8192, 8, 7168, dtype=dtype, target=target)


def plans_unpermute(target: Target):
    for dtype in ("float32", "float16", "bfloat16"):
        for weights_dtype in dict.fromkeys((dtype, "float32")):
            yield unpermute(8192, 8, 65536, 7168, dtype=dtype, weights_dtype=weights_dtype, target=target)
            yield unpermute_backward(8192, 8, 65536, 7168, dtype=dtype, weights_dtype=weights_dtype, target=target)


ROUTE = register(OpInfo("moe_route", sample_route, {}, reference_route, lambda kwargs, cotangents: {}, (), cost_route,
                        bad_route, plans_route))  # fmt: skip
PERMUTE = register(OpInfo("moe_permute", sample_permute, {}, reference_permute, reference_permute_vjp, ("x",),
                          cost_permute, bad_permute, plans_permute))  # fmt: skip
UNPERMUTE = register(OpInfo("moe_unpermute", sample_unpermute, {"fp32_weights": (True, False)}, reference_unpermute,
                            reference_unpermute_vjp, ("ys", "weights"), cost_unpermute, bad_unpermute,
                            plans_unpermute))  # fmt: skip
