"""Decoder configuration of an HF-Llama-layout model, as the mega-kernel needs it (batch 1 decode; biases only on
q / k / v, as Qwen2 has them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DecoderConfig: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"DecoderConfig: {name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class DecoderConfig:
    """Shapes of one decoder stack. `head_dim` must be even (rotary halves); `num_heads % num_kv_heads == 0` (GQA).

    `rope_scaling` is None or Llama-3's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; `max_seq` is the KV cache capacity (positions 0 .. max_seq - 1);
    `qkv_bias`: the q / k / v projections add biases (Qwen2), the other projections have none."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    max_seq: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, compare=False)
    qkv_bias: bool = False

    def __post_init__(self):
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "max_seq"):
            _positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig: num_heads must be a multiple of num_kv_heads, got {self.num_heads} and "
                f"{self.num_kv_heads}"
            )
        if type(self.qkv_bias) is not bool:
            raise TypeError(f"DecoderConfig: qkv_bias must be a bool, got {self.qkv_bias!r}")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig: head_dim must be even (rotary halves), got {self.head_dim}")
        if not (self.rms_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"DecoderConfig: rms_eps and rope_theta must be > 0, got {self.rms_eps} and {self.rope_theta}"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"DecoderConfig: rope_scaling must be None or rope_type 'llama3', got {kind!r}")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_cache_shape(self) -> tuple[int, int, int, int, int]:
        """(layers, 2 (k, v), max_seq, num_kv_heads, head_dim): the one KV cache tensor a decode step updates."""
        return (self.num_layers, 2, self.max_seq, self.num_kv_heads, self.head_dim)

    def rope_inv_freq(self) -> list[float]:
        """inv_freq[i] = theta^(-2i/D) for i < D/2, with Llama-3's wavelength-dependent scaling when configured:
        wavelengths above original/low_freq_factor are divided by `factor`, below original/high_freq_factor kept,
        and interpolated smoothly in between."""
        d = self.head_dim
        inv = [self.rope_theta ** (-(2 * i) / d) for i in range(d // 2)]
        if self.rope_scaling is None:
            return inv
        s = self.rope_scaling
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out

    @classmethod
    def from_hf(cls, hf: dict, max_seq: int | None = None) -> DecoderConfig:
        """From an HF Llama or Qwen2 (model_type "qwen2": q / k / v biases) `config.json` dict. `max_seq` defaults to
        max_position_embeddings."""
        if not isinstance(hf, dict):
            raise TypeError(f"DecoderConfig.from_hf: hf must be a dict, got {type(hf).__name__}")
        missing = [
            k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size") if k not in hf
        ]
        if missing:
            raise ValueError(f"DecoderConfig.from_hf: hf lacks the keys {missing}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"DecoderConfig.from_hf: hidden_act must be 'silu', got {act!r}")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key, False):
                raise ValueError(f"DecoderConfig.from_hf: {key} must be false (no biases), got {hf[key]!r}")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        if max_seq is None:
            max_seq = hf.get("max_position_embeddings", 2048)
        return cls(
            num_layers=hf["num_hidden_layers"],
            hidden=hf["hidden_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate=hf["intermediate_size"],
            max_seq=max_seq,
            rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling"),
            qkv_bias=hf.get("model_type") == "qwen2",
        )
