"""torch adapter of tile_kernels.core.flash_attention: ops tile_kernels::flash_attention_fwd / _bwd with autograd.

The forward op returns (out, lse); lse (B, Hq, Sq) fp32 (base 2, +inf for rows that see no key) is what the backward
needs and is saved by autograd, not exposed by the public function. backend="tilelang" runs the forward through the
custom op tile_kernels::flash_attention_fwd_compiled (TileLang, opaque to torch.compile, with a fake implementation)
and its backward through tile_kernels::flash_attention_bwd_compiled (the same; sm_90a, head dims up to 128, else the
Triton backward: core.compiled_backward_unsupported)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import flash_attention as core

from ._calls import cuda_arch, resolve_backend
from ._runtime import compiled_op, eager_op, executor, register_public_op, target, validated


def _bshd(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """t (B, S, H, D) with unit head-dim stride (copied only if it has none) and its (batch, seq, head) strides."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t, tuple(t.stride()[:3])


def _settings(q, k, v, causal, left, right, scale, softcap):
    (q, sq), (k, sk), (v, sv) = _bshd(q), _bshd(k), _bshd(v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    settings = dict(dtype=dtype_name(q.dtype), causal=causal, window=(left, right), scale=scale, softcap=softcap,
                    target=target(q.device), strides_q=sq, strides_k=sk, strides_v=sv)  # fmt: skip
    return (batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim), settings, (q, k, v)


@compiled_op("flash_attention_fwd_compiled")
def flash_attention_fwd_compiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_left: int, window_right: int,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """flash_attention_fwd through the TileLang kernel (compact inputs: a strided q, k or v is copied)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    batch, seqlen_q, heads_q, head_dim = q.shape
    run = executor(
        core.compiled_forward,
        backend, batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim, dtype=dtype_name(q.dtype),
        causal=causal, window=(window_left, window_right), scale=softmax_scale, softcap=softcap,
        arch=cuda_arch(q.device),
    )  # fmt: skip
    out, lse = run(q, k, v, device=q.device)
    return out, lse


@flash_attention_fwd_compiled.register_fake
def _(q, k, v, causal, window_left, window_right, softmax_scale, softcap, backend):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_left: int, window_right: int,
    softmax_scale: float, softcap: float, backend: str = "triton", backward_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (out (B, Sq, Hq, D), lse (B, Hq, Sq) fp32). `backend` is a resolved name
    (tile_kernels.core.backends.resolve); `backward_backend` the backward's where it differs (None: `backend`'s).
    Every backend's forward writes out and lse alike, so any backward reads them."""
    if backend != "triton":
        return flash_attention_fwd_compiled(q, k, v, causal, window_left, window_right, softmax_scale, softcap, backend)
    sizes, settings, qkv = _settings(q, k, v, causal, window_left, window_right, softmax_scale, softcap)
    out, lse = executor(core.forward, *sizes, **settings)(*qkv, device=q.device)
    return out, lse


def _bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, window_left: int, window_right: int, softmax_scale: float, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (dq, dk, dv), shaped as q, k, v."""
    sizes, settings, qkv = _settings(q, k, v, causal, window_left, window_right, softmax_scale, softcap)
    run = executor(core.backward, *sizes, **settings)
    dq, dk, dv = run(*qkv, out.contiguous(), dout.contiguous(), lse.contiguous(), device=q.device)
    return dq, dk, dv


@compiled_op("flash_attention_bwd_compiled")
def flash_attention_bwd_compiled(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, window_left: int, window_right: int, softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """flash_attention_bwd through the TileLang kernels (compact inputs: strided ones are copied)."""
    q, k, v, out, dout, lse = (t.contiguous() for t in (q, k, v, out, dout, lse))
    batch, seqlen_q, heads_q, head_dim = q.shape
    run = executor(
        core.compiled_backward,
        backend, batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim, dtype=dtype_name(q.dtype),
        causal=causal, window=(window_left, window_right), scale=softmax_scale, softcap=softcap,
        arch=cuda_arch(q.device),
    )  # fmt: skip
    dq, dk, dv = run(q, k, v, out, dout, lse, device=q.device)
    return dq, dk, dv


@flash_attention_bwd_compiled.register_fake
def _(dout, q, k, v, out, lse, causal, window_left, window_right, softmax_scale, softcap, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs[:8]
    backend = next((b for b in reversed(inputs[8:]) if b is not None), "triton")  # backward_backend, else backend
    ctx.options = options
    # the backend's own backward where it has one for these inputs, else Triton's (it reads the same out, lse)
    arch = cuda_arch(q.device) if backend != "triton" else 0
    compiled = core.compiled_backward_unsupported(backend, dtype_name(q.dtype), q.shape[-1], arch) is None
    ctx.backend = backend if compiled else "triton"
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.set_materialize_grads(False)  # lse gets no zero-filled cotangent


def _backward(ctx, dout, _dlse):
    if ctx.backend != "triton":
        dq, dk, dv = flash_attention_bwd_compiled(dout, *ctx.saved_tensors, *ctx.options, ctx.backend)
    else:
        dq, dk, dv = flash_attention_bwd(dout, *ctx.saved_tensors, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


flash_attention_bwd = eager_op("flash_attention_bwd", _bwd)
flash_attention_fwd = eager_op("flash_attention_fwd", _fwd, _setup_context, _backward)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, window: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None, softcap: float = 0.0, backend: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of q (B, Sq, Hq, D) over k, v (B, Sk, Hk, D), Hq % Hk == 0; causal aligned bottom-right; window
    (left, right) as flash-attn (-1 = unbounded); softmax_scale defaults to 1 / sqrt(D); softcap > 0 caps the scores
    with softcap * tanh(s / softcap). Returns (B, Sq, Hq, D). backend: "triton", "tilelang" (its forward; float16 /
    bfloat16; its backward too on sm_90a for head dims up to 128), or None for the fastest measured for these inputs
    on the device, for the forward and, when a gradient is wanted, for the backward on its own (core.preferred_backend:
    they may differ)."""
    _, device = validated(core.NAME, core.check, ("q", "k", "v", None, None, None, None), q, k, v, causal, window,
                          softmax_scale, softcap)  # fmt: skip
    dims, backward_backend = (dtype_name(q.dtype), q.shape[-1]), None
    if backend is None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        backward_backend = resolve_backend(core.NAME, None, device, core.preferred_backend, *dims, True)
    backend = resolve_backend(core.NAME, backend, device, core.preferred_backend, *dims, False)
    if backward_backend == backend:
        backward_backend = None
    causal, (left, right), scale, softcap = core.options(q, causal, window, softmax_scale, softcap, backend)
    return flash_attention_fwd(q, k, v, causal, left, right, scale, softcap, backend, backward_backend)[0]


def _public(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0, backend=None):
    return flash_attention(q, k, v, causal, tuple(window), softmax_scale, softcap, backend)


register_public_op(
    "flash_attention(Tensor q, Tensor k, Tensor v, bool causal=False, int[2] window=[-1, -1], "
    "float? softmax_scale=None, float softcap=0.0, str? backend=None) -> Tensor",
    _public,
)
