"""nn.Modules of the ops, with the parameter names of their torch / Hugging Face counterparts (a state dict loads
unchanged): RMSNorm (as LlamaRMSNorm / torch.nn.RMSNorm), LayerNorm (as torch.nn.LayerNorm over the last dim),
SwiGLUMLP (as LlamaMLP: gate_proj, up_proj, down_proj) and Rotary (as LlamaRotaryEmbedding's default rope, applied).
SharedInputLinear: Linears that read one input (an attention's q_proj, k_proj, v_proj) with the input gradient summed
in the GEMMs. A Linear group reading an RMSNorm's output keeps the norm's input (which the norm's backward keeps
anyway) in place of the output, and recomputes the output in its backward (remember_norm)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .norms import layer_norm, rms_norm
from .rotary import apply_rotary
from .swiglu import swiglu_over_inputs


class RMSNorm(nn.Module):
    """rms_norm over the last dim with a learned weight; forward(x, residual=None) returns y, or (y, x + residual).

    hand_ahead(x, y): y = this norm of x, computed by a caller that formed x with a residual add (rms_norm(a, w,
    residual=b) gives x = a + b and its norm in one kernel: a decoder layer's output and the next layer's input
    norm). The next forward(x) or take_ahead(x) of that same tensor, unmodified since (its version counter), returns
    y without a kernel; any other call drops it. Its outputs are noted (remember_norm): a shared_input_linear reading
    one recomputes it in its backward instead of keeping it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self._ahead: tuple | None = None  # (x, x's version, y) from hand_ahead

    def hand_ahead(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._ahead = (x, x._version, y)

    def take_ahead(self, x: torch.Tensor) -> torch.Tensor | None:
        """The y handed ahead for this x, or None."""
        ahead, self._ahead = self._ahead, None
        return ahead[2] if ahead is not None and ahead[0] is x and ahead[1] == x._version else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._ahead is not None and residual is None:
            y = self.take_ahead(x)
            if y is not None:
                return y
        out = rms_norm(x, self.weight, self.eps, residual)
        y, h = (out, x) if residual is None else out
        remember_norm(y, h, self.weight, self.eps)
        return out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


_NORMS: dict[int, tuple] = {}  # id(y) -> (weakref to y, y's version, h, weight, eps) while y lives (remember_norm)


def remember_norm(y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Notes that y = rms_norm(h, weight, eps) (h as the norm read it: x, or x + residual), while y lives unmodified,
    so that a shared_input_linear of y saves h in place of y and recomputes y in its backward: h is what the norm's
    backward keeps anyway, so one (N, D) tensor less stays alive from forward to backward (a Llama layer's two norm
    outputs), for one norm forward more in the backward. Eager training only (not under torch.compile)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    key = id(y)
    _NORMS[key] = (weakref.ref(y, lambda _: _NORMS.pop(key, None)), y._version, h, weight, eps)


def _norm_of(x: torch.Tensor) -> tuple | None:
    """(h, weight, eps) with x = rms_norm(h, weight, eps) as remember_norm noted it, or None."""
    noted = _NORMS.get(id(x))
    return noted[2:] if noted is not None and noted[0]() is x and noted[1] == x._version else None


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
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the product fused (swiglu; its backward writes the gradients over
    the two projections' outputs, which nothing else reads)."""

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
        return self.down_proj(swiglu_over_inputs(*shared_input_linear(x, self.gate_proj, self.up_proj)))


class _SharedInputLinear(torch.autograd.Function):
    """y_i = x W_i^T + b_i for Linears reading one x. Backward: dx = sum_i dy_i W_i accumulated by the GEMMs (addmm,
    beta = 1: the sum is rounded once, in the GEMM's epilogue) where autograd runs a GEMM per Linear and an add per
    further one (each add reads two (N, D) tensors and writes one); dW_i = dy_i^T x, db_i = sum of dy_i's rows.
    norm_of_x: None, or (h, weight, eps) with x = rms_norm(h, weight, eps): then h and weight are saved (torch's
    version checks guard them) and x is recomputed in the backward (the same kernel on the same input: the same x)."""

    @staticmethod
    def forward(ctx, x, norm_of_x, *params):  # params: W_0, b_0, W_1, b_1, ... (a b_i may be None)
        weights, biases = params[0::2], params[1::2]
        ctx.norm_eps = None if norm_of_x is None else norm_of_x[2]
        ctx.save_for_backward(*((x,) if norm_of_x is None else norm_of_x[:2]), *weights)
        ctx.has_bias = [b is not None for b in biases]
        ctx.set_materialize_grads(False)  # an output that did not reach the loss: None, not zeros
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.norm_eps is None:
            x, *weights = ctx.saved_tensors
        else:
            h, norm_weight, *weights = ctx.saved_tensors
            x = rms_norm(h, norm_weight, ctx.norm_eps)
        x2 = x.reshape(-1, x.shape[-1])
        dx, dparams = None, []
        for i, (dy, w, has_bias) in enumerate(zip(grads, weights, ctx.has_bias)):
            if dy is None:  # an output that did not reach the loss
                dparams += [None, None]
                continue
            dy2 = dy.reshape(-1, dy.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = dy2 @ w if dx is None else dx.addmm_(dy2, w)
            dparams.append(dy2.t() @ x2 if ctx.needs_input_grad[2 + 2 * i] else None)  # after x and norm_of_x
            dparams.append(dy2.sum(0) if has_bias and ctx.needs_input_grad[3 + 2 * i] else None)
        return (None if dx is None else dx.view(x.shape), None, *dparams)


def shared_input_linear(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """(linear(x) for linear in linears), as one autograd node whose backward sums x's gradient in the GEMMs. Under
    torch.autocast the Linears run one by one (autocast's casts, autograd's sum). An x that remember_norm noted is
    recomputed in the backward, not saved."""
    if torch.is_autocast_enabled(x.device.type):
        return tuple(F.linear(x, linear.weight, linear.bias) for linear in linears)
    params = (p for linear in linears for p in (linear.weight, linear.bias))
    norm_of_x = None if torch.compiler.is_compiling() or not _NORMS else _norm_of(x)
    return _SharedInputLinear.apply(x, norm_of_x, *params)


class SharedInputLinear(nn.Module):
    """One of a group of Linears that a model calls in turn on one input (an attention's q_proj, k_proj, v_proj):
    the first member called computes every member's output through shared_input_linear and keeps the others' until
    they are called with that same input (the same tensor object); a member called with another input computes its
    group again. The parameters are the replaced Linear's (state-dict keys unchanged). `group` builds the members."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # shared
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._members, self._index = [self], 0
        self._pending: list = [None, []]  # the input and the outputs not yet handed out (None where handed out)

    @classmethod
    def group(cls, *linears: nn.Linear) -> tuple[SharedInputLinear, ...]:
        members = tuple(cls(linear) for linear in linears)
        pending: list = [None, []]
        for index, member in enumerate(members):
            member._members, member._index, member._pending = list(members), index, pending
        return members

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, pending = self._index, self._pending
        if pending[0] is not x or pending[1][index] is None:
            pending[:] = [x, list(shared_input_linear(x, *self._members))]
        out, pending[1][index] = pending[1][index], None
        if all(o is None for o in pending[1]):
            pending[:] = [None, []]
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
