"""The ground truth: a plain torch eager decode step of an HF-Llama-layout decoder stack (batch 1, one new token).

Per layer, with x the residual stream (hidden,) and the token at `position` (the cache holds positions < position):
    n = rms(x) * w_attn;  q, k, v = Wq n + bq, Wk n + bk, Wv n + bv (biases: qkv_bias, else none)
    q, k = rope(q, position), rope(k, position)
    cache[l, :, position] = k, v;  a_h = softmax(q_h K_g^T / sqrt(D)) V_g over positions 0..position (g = h // group)
    x = x + Wo a;  m = rms(x) * w_mlp;  x = x + Wd (silu(Wg m) * Wu m)
rms(x) = x / sqrt(mean(x^2) + eps); rope is GPT-NeoX's half split: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
The returned hidden is the residual stream after the last layer (before the model's final norm)."""

from __future__ import annotations

import functools

import torch

from .config import DecoderConfig
from .weights import layer_weights


def rope_cos_sin(
    config: DecoderConfig, position: int, dtype=torch.float64, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq, (head_dim / 2,), computed in float64 then cast; on a GPU kept per
    (frequencies, position, dtype, device), so that a step captured in a CUDA graph copies nothing from the host."""
    return _rope_cos_sin(tuple(config.rope_inv_freq()), position, dtype, torch.device(device))


@functools.lru_cache(maxsize=256)
def _rope_cos_sin(inv_freq: tuple, position: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    angle = position * torch.tensor(inv_freq, dtype=torch.float64)
    return angle.cos().to(device, dtype), angle.sin().to(device, dtype)


def check_step_inputs(config: DecoderConfig, hidden, kv_cache, position) -> None:
    """The decode step's argument checks, shared by every implementation."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(kv_cache, torch.Tensor):
        raise TypeError(
            f"decode step: hidden and kv_cache must be torch.Tensor, got {type(hidden).__name__} and "
            f"{type(kv_cache).__name__}"
        )
    if not (hidden.dtype.is_floating_point and kv_cache.dtype.is_floating_point):
        raise TypeError(f"decode step: hidden and kv_cache must be floating, got {hidden.dtype} and {kv_cache.dtype}")
    if tuple(hidden.shape) not in ((config.hidden,), (1, config.hidden)):
        raise ValueError(
            f"decode step: hidden must be ({config.hidden},) or (1, {config.hidden}), got {tuple(hidden.shape)}"
        )
    if tuple(kv_cache.shape) != config.kv_cache_shape():
        raise ValueError(f"decode step: kv_cache must be {config.kv_cache_shape()}, got {tuple(kv_cache.shape)}")
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(f"decode step: position must be an int, got {type(position).__name__}")
    if not 0 <= position < config.max_seq:
        raise ValueError(f"decode step: position must be in [0, {config.max_seq}), got {position}")


def decode_step(
    config: DecoderConfig, weights: dict, hidden: torch.Tensor, kv_cache: torch.Tensor, position: int, dtype=None
) -> torch.Tensor:
    """One decode step in eager torch; writes kv_cache[:, :, position] in place and returns the new hidden (same shape
    as `hidden`). Computes in `dtype` (default: the weights' dtype, with float32 norms and softmax for 16-bit)."""
    check_step_inputs(config, hidden, kv_cache, position)
    layers = layer_weights(config, weights)
    dtype = dtype or layers[0]["q"].dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    c, D, G = config, config.head_dim, config.group
    cos, sin = rope_cos_sin(c, position, acc, hidden.device)

    def rms(x, w):
        x = x.to(acc)
        return (x * torch.rsqrt(x.pow(2).mean() + c.rms_eps)).to(dtype) * w.to(dtype)

    def rope(x):  # (heads, D)
        x1, x2 = x[:, : D // 2].to(acc), x[:, D // 2 :].to(acc)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)

    x = hidden.reshape(c.hidden).to(dtype)
    for i, w in enumerate(layers):
        n = rms(x, w["attn_norm"])
        q, k, v = (w[p].to(dtype) @ n + (w[f"{p}_bias"].to(dtype) if c.qkv_bias else 0) for p in ("q", "k", "v"))
        q = rope(q.view(c.num_heads, D))
        k = rope(k.view(c.num_kv_heads, D))
        v = v.view(c.num_kv_heads, D)
        kv_cache[i, 0, position] = k.to(kv_cache.dtype)
        kv_cache[i, 1, position] = v.to(kv_cache.dtype)
        keys = kv_cache[i, 0, : position + 1].to(dtype).repeat_interleave(G, dim=1)  # (S, Hq, D)
        vals = kv_cache[i, 1, : position + 1].to(dtype).repeat_interleave(G, dim=1)
        scores = torch.einsum("hd,shd->hs", q.to(acc), keys.to(acc)) / D**0.5
        a = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), vals.to(acc)).to(dtype)
        x = x + w["o"].to(dtype) @ a.reshape(c.q_size)
        m = rms(x, w["mlp_norm"])
        x = x + w["down"].to(dtype) @ (torch.nn.functional.silu(w["gate"].to(dtype) @ m) * (w["up"].to(dtype) @ m))
    return x.to(hidden.dtype).reshape(hidden.shape)
