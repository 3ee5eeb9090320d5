"""Variable-length (packed) FlashAttention: flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0), flash-attn's varlen API.

B sequences packed along the rows: q (total_q, Hq, D), k / v (total_k, Hk, D); sequence b holds query rows
[cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) (int32 (B + 1,), starting
at 0). Each sequence is attended on its own exactly as flash_attention attends one batch entry (causal and windows
aligned bottom-right within the sequence, GQA, softcap; a query that sees no key gives 0). Returns (total_q, Hq, D).

The kernels are flash_attention's, compiled with VARLEN: each program reads its sequence's offset and length from
cu_seqlens, over a grid of cdiv(max_seqlen, BLOCK) blocks a sequence; blocks past the sequence's end return at once.
The caller's contract (flash-attn's; not checked on the device, which would need a host sync): cu_seqlens non-
decreasing with cu_seqlens_q[-1] = total_q and cu_seqlens_k[-1] = total_k, and max_seqlen_q / max_seqlen_k at least
every sequence's length (rows past max_seqlen are left unwritten).
"""

from __future__ import annotations

import numpy as np

from . import checks
from . import flash_attention as fa
from .plan import FLOAT_DTYPES, Plan, Target
from .registry import BadInput, Cost, OpInfo, not_arrays, register, round_to

NAME = "flash_attention_varlen"
_CU = ("cu_seqlens_q", "cu_seqlens_k")


def check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, window=(-1, -1),
          softmax_scale=None, softcap=0.0) -> None:  # fmt: skip
    dtype = checks.check_float(NAME, "q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_array(NAME, name, t)
        if len(t.shape) != 3:
            raise ValueError(f"{NAME}: {name} must be 3-D (total, heads, head_dim), got shape {tuple(t.shape)}")
    checks.check_same_dtype(NAME, "k", k, dtype, "that of q")
    checks.check_same_dtype(NAME, "v", v, dtype, "that of q")
    total_q, heads_q, head_dim = q.shape
    total_k, heads_k, _ = k.shape
    checks.check_shape(NAME, "k", k, (total_k, heads_k, head_dim), "q's head_dim")
    checks.check_shape(NAME, "v", v, tuple(k.shape), "that of k")
    for name, cu in zip(_CU, (cu_seqlens_q, cu_seqlens_k)):
        checks.check_same_dtype(NAME, name, cu, "int32", "sequence offsets")
        if len(cu.shape) != 1 or cu.shape[0] < 1:
            raise ValueError(f"{NAME}: {name} must be 1-D (batch + 1,), got shape {tuple(cu.shape)}")
    checks.check_shape(NAME, "cu_seqlens_k", cu_seqlens_k, tuple(cu_seqlens_q.shape), "that of cu_seqlens_q")
    for name, longest, total in (("max_seqlen_q", max_seqlen_q, total_q), ("max_seqlen_k", max_seqlen_k, total_k)):
        longest = checks.check_int(NAME, name, longest, "an int >= 0")
        if not 0 <= longest < 2**31:
            raise ValueError(f"{NAME}: {name} must be an int in [0, 2^31), got {longest}")
        if total and not longest:
            raise ValueError(f"{NAME}: {name} must be at least the longest sequence's length, got 0 for {total} rows")
    fa.check_heads_and_options(NAME, heads_q, heads_k, head_dim, causal, window, softmax_scale, softcap)


def options(q, causal, window, softmax_scale, softcap) -> tuple[bool, tuple[int, int], float, float]:
    """The call's options as the ops take them (flash_attention.options), once `check` has passed."""
    return fa.options(q, causal, window, softmax_scale, softcap, "triton")


def forward(batch: int, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int, heads_q: int, heads_k: int,
            head_dim: int, **settings) -> Plan:  # fmt: skip
    """flash_attention.forward over `batch` packed sequences (its `packed`): inputs q, k, v, cu_seqlens_q,
    cu_seqlens_k; outputs out (total_q, Hq, D) and lse (Hq, total_q). settings: flash_attention.forward's keywords
    (strides_* as (0, row stride, head stride))."""
    return fa.forward(batch, max_seqlen_q, max_seqlen_k, heads_q, heads_k, head_dim, packed=(total_q, total_k),
                      **settings)  # fmt: skip


def backward(batch: int, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int, heads_q: int,
             heads_k: int, head_dim: int, **settings) -> Plan:  # fmt: skip
    """flash_attention.backward over packed sequences: inputs q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k;
    outputs dq, dk, dv packed as q, k, v."""
    return fa.backward(batch, max_seqlen_q, max_seqlen_k, heads_q, heads_k, head_dim, packed=(total_q, total_k),
                       **settings)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# reference, cost, samples: flash_attention's, sequence by sequence


def _sequences(kwargs):
    """Per sequence: flash_attention's keyword arguments for it (a batch of one) and its query and key row ranges."""
    cu_q, cu_k = (np.asarray(kwargs[name]).astype(np.int64) for name in _CU)
    common = {n: kwargs[n] for n in ("causal", "window", "softmax_scale", "softcap") if n in kwargs}
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = {"q": kwargs["q"][None, rows_q], "k": kwargs["k"][None, rows_k], "v": kwargs["v"][None, rows_k]}
        yield one | common, rows_q, rows_k


def reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, window=(-1, -1),
              softmax_scale=None, softcap=0.0):  # fmt: skip
    kwargs = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal, window=window,
                  softmax_scale=softmax_scale, softcap=softcap)  # fmt: skip
    out = np.zeros(q.shape, np.float64)
    for one, rows_q, _ in _sequences(kwargs):
        out[rows_q] = fa.reference(**one)[0][0]
    return (out,)


def reference_vjp(kwargs, cotangents):
    grads = {name: np.zeros(kwargs[name].shape, np.float64) for name in ("q", "k", "v")}
    for one, rows_q, rows_k in _sequences(kwargs):
        part = fa.reference_vjp(one, (cotangents[0][None, rows_q],))
        grads["q"][rows_q] = part["q"][0]
        grads["k"][rows_k] = part["k"][0]
        grads["v"][rows_k] = part["v"][0]
    return grads


def cost(kwargs) -> tuple[Cost, Cost]:
    """flash_attention's cost summed over the sequences."""
    parts = [fa.cost(one) for one, _, _ in _sequences(kwargs)]
    return tuple(Cost(sum(p[i].bytes for p in parts), sum(p[i].flops for p in parts)) for i in (0, 1))


def sample(rng: np.random.Generator, shape, dtype: str, causal=False, window=False, gqa=1, cross=False,
           softcap=False) -> dict:  # fmt: skip
    """B = shape[0] sequences (at most 4; 1 without leading dims), heads and head dim as flash_attention.sample;
    lengths = shape[1] each if it is 0 or >= flash_attention.LONG_SEQUENCE (a benchmark's shape), else drawn in
    [0, 40] (empty sequences included); key lengths the same unless `cross` (then drawn in [0, 48]); max_seqlen the
    longest length, plus up to 2 when drawn (an upper bound is enough)."""
    lead = tuple(shape[:-1])
    fixed = fa.sample(rng, (1, 1, *lead[2:3], shape[-1]), dtype, causal, window, gqa, False, softcap)
    batch = min(lead[0], 4) if lead else 1
    given = len(lead) > 1 and (lead[1] == 0 or lead[1] >= fa.LONG_SEQUENCE)
    lengths_q = np.full(batch, lead[1]) if given else rng.integers(0, 41, batch)
    lengths_k = rng.integers(0, 49, batch) if cross and not given else lengths_q
    _, heads_q, head_dim = fixed["q"].shape[1:]
    heads_k = fixed["k"].shape[2]
    out = {}
    for suffix, lengths in (("q", lengths_q), ("k", lengths_k)):
        out[f"cu_seqlens_{suffix}"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        slack = 0 if given else int(rng.integers(0, 3))
        out[f"max_seqlen_{suffix}"] = int(lengths.max(initial=0)) + slack if lengths.sum() else 0

    def draw(total, heads):
        return round_to(rng.standard_normal((total, heads, head_dim)), dtype)

    total_q, total_k = int(lengths_q.sum()), int(lengths_k.sum())
    qkv = {"q": draw(total_q, heads_q), "k": draw(total_k, heads_k), "v": draw(total_k, heads_k)}
    options = {n: fixed[n] for n in ("causal", "window", "softmax_scale", "softcap")}
    return qkv | out | options


def bad_inputs(kwargs) -> list[BadInput]:
    q, k, v, cu_q, cu_k = (kwargs[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    return [
        BadInput({"q": q[None]}, ValueError, f"{NAME}: q must be 3-D"),
        BadInput({"q": q.astype(np.int32)}, TypeError, f"{NAME}: q must have dtype"),
        BadInput({"k": k.astype(np.float16)}, TypeError, f"{NAME}: k must have dtype"),
        BadInput({"v": v[:, :, :-1]}, ValueError, f"{NAME}: v must have shape"),
        BadInput({"q": np.concatenate([q, q[:, :1]], axis=1)}, ValueError, f"{NAME}: q's heads must be"),
        BadInput({"cu_seqlens_q": cu_q.astype(np.int16)}, TypeError, f"{NAME}: cu_seqlens_q must have dtype int32"),
        BadInput({"cu_seqlens_k": cu_k.astype(np.float32)}, TypeError, f"{NAME}: cu_seqlens_k must have dtype int32"),
        BadInput({"cu_seqlens_q": cu_q[None]}, ValueError, f"{NAME}: cu_seqlens_q must be 1-D"),
        BadInput({"cu_seqlens_k": cu_k[:-1]}, ValueError, f"{NAME}: cu_seqlens_k must have shape"),
        BadInput({"max_seqlen_q": 2.5}, TypeError, f"{NAME}: max_seqlen_q must be an int"),
        BadInput({"max_seqlen_k": -1}, ValueError, f"{NAME}: max_seqlen_k must be an int in"),
        BadInput({"max_seqlen_q": 0}, ValueError, f"{NAME}: max_seqlen_q must be at least"),
        BadInput({"window": (-2, 0)}, ValueError, f"{NAME}: window must be a pair"),
        BadInput({"softcap": -1.0}, ValueError, f"{NAME}: softcap must be"),
        *not_arrays(NAME, "q", "k", "v", *_CU),
    ]


def plans(target: Target):
    """The packed kernels of every dtype, head-dim bucket (padded or not) and softcap, in their default
    configurations."""
    for dtype in FLOAT_DTYPES:
        for head_dim in (16, 32, 40, 64, 96, 128, 192, 256):
            for softcap in (0.0, 1.0):
                for build in (forward, backward):
                    yield build(2, 200, 200, 128, 128, 2, 1, head_dim, dtype=dtype, causal=True, window=(-1, -1),
                                scale=None, softcap=softcap, target=target)  # fmt: skip


INFO = register(
    OpInfo(
        name=NAME,
        sample=sample,
        options=fa.INFO.options,  # sample's options are flash_attention's
        reference=reference,
        reference_vjp=reference_vjp,
        grad_args=("q", "k", "v"),
        cost=cost,
        bad_inputs=bad_inputs,
        plans=plans,
    )
)
