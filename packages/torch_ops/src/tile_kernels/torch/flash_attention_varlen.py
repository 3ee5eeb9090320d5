"""torch adapter of tile_kernels.core.flash_attention_varlen: ops tile_kernels::flash_attention_varlen_fwd / _bwd with
autograd. The forward op returns (out, lse); lse (Hq, total_q) fp32 is saved for the backward, not returned by the
public function."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import flash_attention_varlen as core

from ._runtime import eager_op, executor, register_public_op, target, unit_last, validated


def _settings(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, left, right, scale, softcap):
    """(the plan's sizes, its settings, its inputs q, k, v, cu_seqlens_q, cu_seqlens_k): packed arrays at any row and
    head strides (copied only without a unit head-dim stride)."""
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    sizes = (cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1],
             q.shape[2])  # fmt: skip
    strides = {f"strides_{n}": (0, t.stride(0), t.stride(1)) for n, t in (("q", q), ("k", k), ("v", v))}
    settings = dict(dtype=dtype_name(q.dtype), causal=causal, window=(left, right), scale=scale, softcap=softcap,
                    target=target(q.device), **strides)  # fmt: skip
    return sizes, settings, (q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous())


def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, window_left: int, window_right: int, softmax_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (out (total_q, Hq, D), lse (Hq, total_q) fp32)."""
    sizes, settings, inputs = _settings(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                        window_left, window_right, softmax_scale, softcap)  # fmt: skip
    out, lse = executor(core.forward, *sizes, **settings)(*inputs, device=q.device)
    return out, lse


def _bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    window_left: int, window_right: int, softmax_scale: float, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (dq, dk, dv), packed as q, k, v."""
    sizes, settings, (q, k, v, cu_q, cu_k) = _settings(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                       max_seqlen_k, causal, window_left, window_right,
                                                       softmax_scale, softcap)  # fmt: skip
    run = executor(core.backward, *sizes, **settings)
    dq, dk, dv = run(q, k, v, out.contiguous(), dout.contiguous(), lse.contiguous(), cu_q, cu_k, device=q.device)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    ctx.options = options
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.set_materialize_grads(False)  # lse gets no zero-filled cotangent


def _backward(ctx, dout, _dlse):
    dq, dk, dv = flash_attention_varlen_bwd(dout, *ctx.saved_tensors, *ctx.options)
    return dq, dk, dv, *[None] * 9


flash_attention_varlen_bwd = eager_op("flash_attention_varlen_bwd", _bwd)
flash_attention_varlen_fwd = eager_op("flash_attention_varlen_fwd", _fwd, _setup_context, _backward)


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool = False, window: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """flash_attention over B packed sequences: q (total_q, Hq, D), k / v (total_k, Hk, D), sequence b in rows
    [cu_seqlens[b], cu_seqlens[b + 1]) (int32 (B + 1,), from 0 to the total), max_seqlen_* at least every sequence's
    length; causal / window / softmax_scale / softcap as flash_attention's, within each sequence. Returns
    (total_q, Hq, D)."""
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", None, None, None, None, None, None)
    validated(core.NAME, core.check, names, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
              window, softmax_scale, softcap)  # fmt: skip
    causal, (left, right), scale, softcap = core.options(q, causal, window, softmax_scale, softcap)
    return flash_attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      causal, left, right, scale, softcap)[0]  # fmt: skip


def _public(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, window=(-1, -1),
            softmax_scale=None, softcap=0.0):  # fmt: skip
    return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  tuple(window), softmax_scale, softcap)  # fmt: skip


register_public_op(
    "flash_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, bool causal=False, int[2] window=[-1, -1], float? softmax_scale=None, "
    "float softcap=0.0) -> Tensor",
    _public,
)
