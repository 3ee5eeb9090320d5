"""flax.nnx modules of the ops, with the parameter names of flax's own (nnx.RMSNorm / nnx.LayerNorm: `scale`,
`bias`, `epsilon`) and of Llama-family MLPs (gate_proj, up_proj, down_proj): RMSNorm, LayerNorm, SwiGLUMLP, Rotary.
flax is an optional dependency (pip install flax); this module imports it."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .norms import layer_norm, rms_norm
from .rotary import apply_rotary
from .swiglu import swiglu


class RMSNorm(nnx.Module):
    """rms_norm over the last dim with a learned scale; __call__(x, residual=None) returns y, or (y, x + residual)."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, param_dtype=jnp.float32, rngs: nnx.Rngs = None):
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.epsilon = epsilon

    def __call__(self, x, residual=None):
        return rms_norm(x, self.scale[...], self.epsilon, residual)


class LayerNorm(nnx.Module):
    """layer_norm over the last dim with a learned scale and (unless use_bias=False) bias."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, use_bias: bool = True, param_dtype=jnp.float32,
                 rngs: nnx.Rngs = None):  # fmt: skip
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype)) if use_bias else None
        self.epsilon = epsilon

    def __call__(self, x, residual=None):
        bias = None if self.bias is None else self.bias[...]
        return layer_norm(x, self.scale[...], bias, self.epsilon, residual)


class SwiGLUMLP(nnx.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the product fused (swiglu); no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):  # fmt: skip
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **kw)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Rotary(nnx.Module):
    """Rotary position embedding of x (B, S, H, D): angles position * base^(-2i/D), GPT-NeoX halves unless
    interleaved; positions 0..S-1 (a vmap over sequences gives each its own tables)."""

    def __init__(self, head_dim: int, *, base: float = 10000.0, interleaved: bool = False):
        if head_dim % 2:
            raise ValueError(f"Rotary: head_dim must be even, got {head_dim}")
        self.inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
        self.interleaved = interleaved

    def __call__(self, x):
        angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * self.inv_freq
        return apply_rotary(x, jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype), self.interleaved)
