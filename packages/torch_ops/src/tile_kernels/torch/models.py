"""Drop-in use in Hugging Face transformers decoder models of the Llama family: `apply_to(model)` patches one model
instance in place (transformers is imported from the model, never by tile_kernels itself).

What each switch swaps (every one independent):
- rms_norm:  every *RMSNorm module (weight * normalized x) for nn.RMSNorm sharing its weight
- swiglu:    every MLP with gate_proj / up_proj / down_proj and a SiLU activation for nn.SwiGLUMLP sharing its Linears
- rotary:    `apply_rotary_pos_emb` as the attention modules' forward sees it (each one's forward rebound to a copy
             whose globals name ours: this model only, not the modeling module nor other models of its class)
- attention: config._attn_implementation = "tile_kernels", registered with transformers' attention-function and
             attention-mask registries (flash_attention; causal, sliding windows, GQA; no padding masks)
- loss:      the causal-LM forward computes its loss with fused_linear_cross_entropy (the (N, V) logits never
             exist; float32 loss, mean over non-ignored tokens or sum / num_items_in_batch as transformers does); logits
             are returned only when no labels are given
"""

from __future__ import annotations

import inspect
import types

import torch

from .flash_attention import flash_attention
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .nn import RMSNorm, SwiGLUMLP
from .rotary import apply_rotary

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION = "tile_kernels"
IGNORE_INDEX = -100


def apply_to(model, rms_norm=True, swiglu=True, rotary=True, attention=True, loss=True):
    """Patches `model` (a transformers model of the Llama family: Llama, Mistral, Qwen2, Qwen3) in place and returns
    it. Parameters are shared, not copied: the state dict, the optimizer's parameters and tied weights stay as they
    were."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY:
        expected = ", ".join(FAMILY)
        raise ValueError(f"apply_to: model must be a transformers model of type {expected}, got {model_type!r}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if rms_norm and _is_rms_norm(child):
                norm = RMSNorm(1, float(getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))))
                norm.weight = child.weight  # shared
                setattr(parent, name, norm)
            elif swiglu and _is_swiglu_mlp(child):
                setattr(parent, name, SwiGLUMLP.sharing(child))
    if rotary:
        for module in model.modules():
            forward = inspect.unwrap(type(module).forward)
            if "apply_rotary_pos_emb" in forward.__code__.co_names:
                ours = _with_globals(forward, apply_rotary_pos_emb=apply_rotary_pos_emb)
                module.forward = types.MethodType(ours, module)
    if attention:
        register_attention()
        model.config._attn_implementation = ATTENTION
        for sub in model.modules():  # sub-configs (text_config) some models keep
            if hasattr(sub, "config") and sub.config is not model.config:
                sub.config._attn_implementation = ATTENTION
    if loss:
        if getattr(getattr(model, "lm_head", None), "bias", None) is not None:
            raise ValueError("apply_to: loss=True needs an lm_head without bias")
        if not hasattr(model, "lm_head"):
            name = type(model).__name__
            raise ValueError(f"apply_to: loss=True needs a causal-LM model (with an lm_head), got {name}")
        model.forward = types.MethodType(causal_lm_forward, model)
    return model


def _with_globals(fn, **names):
    """A copy of function `fn` that sees `names` in place of its module's globals of those names."""
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_swiglu_mlp(module) -> bool:
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
    has_bias = any(getattr(getattr(module, p, None), "bias", None) is not None for p in ("gate_proj", "up_proj"))
    return silu and not has_bias and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb on apply_rotary: q, k (B, H, S, D) (unsqueeze_dim=1) or (B, S, H, D)
    (unsqueeze_dim=2); cos, sin (B, S, D) or (S, D) holding each angle twice (GPT-NeoX halves)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    if cos.dim() == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]  # the same positions in every sequence: one table
    if unsqueeze_dim == 1:
        return tuple(apply_rotary(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, **kwargs):  # fmt: skip
    """transformers' attention-function interface on flash_attention: query (B, Hq, S, D), key / value (B, Hk, Sk,
    D); returns ((B, S, Hq, D), None)."""
    if dropout:
        raise ValueError(f"tile_kernels attention: dropout must be 0, got {dropout}")
    if attention_mask is not None:
        raise ValueError(
            "tile_kernels attention: padding masks are not supported (batches of unpadded sequences only; for padded "
            "batches patch with apply_to(model, attention=False)); got an attention mask of shape "
            f"{tuple(attention_mask.shape)}"
        )
    causal = getattr(module, "is_causal", True)
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = flash_attention(q, k, v, causal=causal, window=window, softmax_scale=scaling, softcap=softcap or 0.0)
    return out, None


def register_attention() -> None:
    """Registers "tile_kernels" with transformers' attention-function registry (so that
    `attn_implementation="tile_kernels"` selects it) and its mask registry (flash-attention's: no mask unless
    padded)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, flash_attention_mask)


def causal_lm_forward(self, input_ids=None, labels=None, logits_to_keep=0, num_items_in_batch=None,
                      shift_labels=None, **kwargs):  # fmt: skip
    """The *ForCausalLM forward with the loss of fused_linear_cross_entropy: with labels (or shift_labels) the
    logits are never formed (returned as None)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("return_dict", None)
    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs.last_hidden_state
    loss = logits = None
    if labels is None and shift_labels is None:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
    else:
        if shift_labels is None:  # tokens < n predict n
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        rows = hidden.reshape(-1, hidden.shape[-1])
        target = shift_labels.reshape(-1).to(rows.device)
        if num_items_in_batch is None:
            loss = fused_linear_cross_entropy(rows, self.lm_head.weight, target, IGNORE_INDEX)
        else:
            loss = fused_linear_cross_entropy(rows, self.lm_head.weight, target, IGNORE_INDEX, reduction="sum")
            count = num_items_in_batch
            loss = loss / (count.to(loss.device) if torch.is_tensor(count) else count)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=getattr(outputs, "past_key_values", None),
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)  # fmt: skip
