"""nn.Modules of the ops, with the parameter names of their torch / Hugging Face counterparts (a state dict loads
unchanged): RMSNorm (as LlamaRMSNorm / torch.nn.RMSNorm), LayerNorm (as torch.nn.LayerNorm over the last dim),
SwiGLUMLP (as LlamaMLP: gate_proj, up_proj, down_proj) and Rotary (as LlamaRotaryEmbedding's default rope, applied)."""

from __future__ import annotations

import torch
from torch import nn

from .norms import layer_norm, rms_norm
from .rotary import apply_rotary
from .swiglu import swiglu


class RMSNorm(nn.Module):
    """rms_norm over the last dim with a learned weight; forward(x, residual=None) returns y, or (y, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(nn.Module):
    """layer_norm over the last dim with a learned weight and (unless bias=False) bias; forward as RMSNorm's."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the product fused (swiglu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def sharing(cls, mlp: nn.Module) -> SwiGLUMLP:
        """A SwiGLUMLP over another module's gate_proj, up_proj and down_proj (the same Linear modules, not copies)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Rotary(nn.Module):
    """Rotary position embedding of x (B, S, H, D): angles position * base^(-2i/D) (the default rope of Llama-family
    models, inv_freq as theirs), GPT-NeoX halves unless interleaved. forward(x, position_ids=None): positions
    0..S-1, or (B, S) / (S,) integer positions."""

    def __init__(self, head_dim: int, base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"Rotary: head_dim must be even, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved

    def tables(self, seqlen: int, position_ids: torch.Tensor | None, dtype: torch.dtype):
        """(cos, sin), (S, D/2) or (B, S, D/2), in float32 rounded to `dtype`."""
        if position_ids is None:
            position_ids = torch.arange(seqlen, device=self.inv_freq.device)
        angles = position_ids.to(torch.float32)[..., None] * self.inv_freq
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.tables(x.shape[1], position_ids, x.dtype)
        return apply_rotary(x, cos, sin, self.interleaved)
