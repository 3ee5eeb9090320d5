"""Drop-in use in Hugging Face transformers decoder models of the Llama family: `apply_to(model)` patches one model
instance in place (transformers is imported from the model, never by tile_kernels itself).

What each switch swaps (every one independent):
- rms_norm:  every *RMSNorm module (weight * normalized x) for nn.RMSNorm sharing its weight
- swiglu:    every MLP with gate_proj / up_proj / down_proj and a SiLU activation for nn.SwiGLUMLP sharing its Linears
- rotary:    `apply_rotary_pos_emb` as the attention modules' forward sees it (each one's forward rebound to a copy
             whose globals name ours: this model only, not the modeling module nor other models of its class)
- attention: config._attn_implementation = "tile_kernels", registered with transformers' attention-function and
             attention-mask registries (flash_attention; causal, sliding windows, GQA; padded batches and packed
             sequences through flash_attention_varlen, as transformers' flash-attention path takes them);
             attention="triton" / "tilelang" picks flash_attention's backend ("tile_kernels_triton", ...), True its
             default
- qkv:       each attention module's q_proj, k_proj and v_proj as one nn.SharedInputLinear group: the attention
             input's gradient summed by the GEMMs of the three (no adds; the MLP's gate_proj and up_proj get the same
             inside nn.SwiGLUMLP)
- residual:  each decoder layer's post-attention residual add done by its post-attention RMSNorm (rms_norm with
             residual=: one kernel, and in the backward one, instead of an add and a norm), the layer's output add
             done by the norm that reads it next (the next layer's input norm, the model's final norm: handed ahead,
             nn.RMSNorm.hand_ahead; eager, without gradient checkpointing) and the layer input's two gradients (its
             norm's, the residual stream's) summed in that norm's backward kernel (norms.rms_norm_and_input), for
             layers of exactly the Llama family's four parts whose forward returns a tensor (with rms_norm only)
- loss:      the causal-LM forward computes its loss with fused_linear_cross_entropy (the (N, V) logits never
             exist; float32 loss, mean over non-ignored tokens or sum / num_items_in_batch as transformers does); logits
             are returned only when no labels are given
"""

from __future__ import annotations

import functools
import inspect
import types

import torch

from .flash_attention import flash_attention
from .flash_attention_varlen import flash_attention_varlen
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .nn import RMSNorm, SharedInputLinear, SwiGLUMLP, remember_norm
from .norms import rms_norm_and_input
from .rotary import apply_rotary

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION = "tile_kernels"  # + f"_{backend}" for a backend chosen by apply_to(attention=backend)
ATTENTION_BACKENDS = ("triton", "tilelang")
IGNORE_INDEX = -100


def apply_to(model, rms_norm=True, swiglu=True, rotary=True, attention=True, loss=True, residual=True, qkv=True):
    """Patches `model` (a transformers model of the Llama family: Llama, Mistral, Qwen2, Qwen3) in place and returns
    it. Parameters are shared, not copied: the state dict, the optimizer's parameters and tied weights stay as they
    were."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY:
        expected = ", ".join(FAMILY)
        raise ValueError(f"apply_to: model must be a transformers model of type {expected}, got {model_type!r}")
    if not (isinstance(attention, bool) or attention in ATTENTION_BACKENDS):
        raise ValueError(f"apply_to: attention must be True, False or one of {ATTENTION_BACKENDS}, got {attention!r}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if rms_norm and _is_rms_norm(child):
                norm = RMSNorm(1, float(getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))))
                norm.weight = child.weight  # shared
                setattr(parent, name, norm)
            elif swiglu and _is_swiglu_mlp(child):
                setattr(parent, name, SwiGLUMLP.sharing(child))
        if qkv and _has_qkv(parent):
            projections = ("q_proj", "k_proj", "v_proj")
            for name, member in zip(projections, SharedInputLinear.group(*(getattr(parent, n) for n in projections))):
                setattr(parent, name, member)
    if rms_norm and residual:
        for module in model.modules():
            if _is_pre_norm_decoder_layer(module):
                module.forward = types.MethodType(decoder_layer_forward, module)
                object.__setattr__(module, "_following_norm", None)  # a plain attribute, not a submodule
        _link_following_norms(model)
    if rotary:
        for module in model.modules():
            forward = inspect.unwrap(type(module).forward)
            if "apply_rotary_pos_emb" in forward.__code__.co_names:
                ours = _with_globals(forward, apply_rotary_pos_emb=apply_rotary_pos_emb)
                module.forward = types.MethodType(ours, module)
    if attention:
        register_attention()
        name = ATTENTION if attention is True else f"{ATTENTION}_{attention}"
        model.config._attn_implementation = name
        for sub in model.modules():  # sub-configs (text_config) some models keep
            if hasattr(sub, "config") and sub.config is not model.config:
                sub.config._attn_implementation = name
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


def _has_qkv(module) -> bool:
    """An attention module with q_proj, k_proj and v_proj Linears of one input size (the Llama family's)."""
    linears = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    return all(type(m) is torch.nn.Linear for m in linears) and len({m.in_features for m in linears}) == 1


_DECODER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def _is_pre_norm_decoder_layer(module) -> bool:
    """A decoder layer as Llama's: exactly the four parts, both norms ours, a forward returning the
    hidden states (transformers 4.x layers that return tuples, or with more parts, keep their own forward)."""
    returns = inspect.signature(type(module).forward).return_annotation
    return (
        {name for name, _ in module.named_children()} == _DECODER_PARTS
        and isinstance(module.post_attention_layernorm, RMSNorm)
        and isinstance(module.input_layernorm, RMSNorm)
        and returns in (torch.Tensor, "torch.Tensor")
    )


def _link_following_norms(model) -> None:
    """Each patched decoder layer of a model's `layers` gets the norm that reads its output (the next layer's input
    norm, the last layer the model's final `norm`) when that norm is ours: the layer adds its MLP residual and
    computes that norm in one rms_norm and hands the norm ahead (nn.RMSNorm.hand_ahead)."""
    for module in model.modules():
        layers, final = getattr(module, "layers", None), getattr(module, "norm", None)
        if not isinstance(layers, torch.nn.ModuleList) or not isinstance(final, RMSNorm):
            continue
        if not all(getattr(layer, "forward", None).__func__ is decoder_layer_forward for layer in layers):
            continue
        for layer, following in zip(layers, [layer.input_layernorm for layer in layers[1:]] + [final]):
            object.__setattr__(layer, "_following_norm", following)


def decoder_layer_forward(self, hidden_states, **kwargs):
    """A Llama-family decoder layer, x + attention(norm(x)) then h + mlp(norm(h)), with h and norm(h) from one
    rms_norm(attention's output, residual=x), and x's two gradients summed by its norm's backward. With a following
    norm (_link_following_norms), h + mlp(...) and that norm of it come from one rms_norm too: the next layer takes
    its input norm ahead (or the model's final norm does), and its input's two gradients meet in that kernel's
    backward. Not under torch.compile or gradient checkpointing (where a recomputed layer must save what the first
    pass saved). The keyword arguments go to the attention module as the stock layer passes them."""
    norm = self.input_layernorm
    normed = norm.take_ahead(hidden_states)
    if normed is None:  # x's two gradients join in its norm's kernel
        normed, hidden_states = rms_norm_and_input(hidden_states, norm.weight, norm.eps)
        remember_norm(normed, hidden_states, norm.weight, norm.eps)
    attention_out, _ = self.self_attn(hidden_states=normed, **kwargs)
    normed, hidden_states = self.post_attention_layernorm(attention_out, residual=hidden_states)
    following = self._following_norm
    if following is None or torch.compiler.is_compiling() or (self.training and _checkpointing(self)):
        return hidden_states + self.mlp(normed)
    normed_next, out = following(self.mlp(normed), residual=hidden_states)
    following.hand_ahead(out, normed_next)
    return out


def _checkpointing(layer) -> bool:
    """Whether transformers' gradient checkpointing is on for `layer`."""
    return bool(getattr(layer, "gradient_checkpointing", False))


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb on apply_rotary: q, k (B, H, S, D) (unsqueeze_dim=1) or (B, S, H, D)
    (unsqueeze_dim=2); cos, sin (B, S, D) or (S, D) holding each angle twice (GPT-NeoX halves)."""
    cos, sin = _half_tables(cos, sin)
    if unsqueeze_dim == 1:
        return tuple(apply_rotary(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


_LAST_TABLES: list = [None, None, None]  # cos, sin and their compact halves: one forward's layers share them


def _half_tables(cos, sin) -> tuple:
    """The first halves of transformers' cos / sin tables, (S, D/2) where every sequence has the same positions, else
    (B, S, D/2); compact copies made once a forward (every layer gets the same tables), which apply_rotary and its
    backward read without copying them again."""
    if _LAST_TABLES[0] is cos and _LAST_TABLES[1] is sin:
        return _LAST_TABLES[2]
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    if c.dim() == 3 and c.shape[0] == 1:
        c, s = c[0], s[0]  # the same positions in every sequence: one table
    tables = c.contiguous(), s.contiguous()
    if not torch.compiler.is_compiling():
        _LAST_TABLES[:] = cos, sin, tables
    return tables


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                      max_length_k=None, backend=None, **kwargs):  # fmt: skip
    """transformers' attention-function interface: query (B, Hq, S, D), key / value (B, Hk, Sk, D); returns
    ((B, S, Hq, D), None). As transformers' flash-attention path: a padding mask (B, Sk) (true at tokens) unpads the
    batch into packed sequences (padding rows give 0); a batch of one packed sequence comes with cu_seq_lens_* and
    max_length_* or with position_ids that restart at each sequence; flash_attention_varlen runs those,
    flash_attention the rest (`backend`: flash_attention's; flash_attention_varlen has Triton's only)."""
    if dropout:
        raise ValueError(f"tile_kernels attention: dropout must be 0, got {dropout}")
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    options = dict(causal=getattr(module, "is_causal", True), window=window, softmax_scale=scaling,
                   softcap=softcap or 0.0)  # fmt: skip
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    if attention_mask is not None:
        return _unpadded(q, k, v, attention_mask, options), None
    if cu_seq_lens_q is None and q.shape[0] == 1 and q.shape[1] == k.shape[1] > 1:
        cu_seq_lens_q, max_length_q = _restarts(position_ids)
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    if cu_seq_lens_q is not None:
        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
        out = flash_attention_varlen(q[0], k[0], v[0], cu_q, cu_k, int(max_length_q), int(max_length_k), **options)
        return out[None], None
    return flash_attention(q, k, v, **options, backend=backend), None


_LAST_RESTARTS: list = [None, (None, None)]  # position_ids and _restarts' answer: one forward's layers share them


def _restarts(position_ids) -> tuple:
    """(sequence offsets int32 (B + 1,), longest sequence) of one row of packed sequences whose position_ids (1, S)
    restart at each sequence; (None, None) when they only count up (one sequence) or are absent. Host syncs once a
    forward: every layer gets the same position_ids tensor."""
    if position_ids is None:
        return None, None
    if _LAST_RESTARTS[0] is not position_ids:
        positions = position_ids.reshape(-1)
        starts = (positions[1:] <= positions[:-1]).nonzero()[:, 0] + 1
        answer = None, None
        if starts.numel():
            bounds = (positions.new_zeros(1), starts, positions.new_full((1,), positions.numel()))
            offsets = torch.cat(bounds).to(torch.int32)
            answer = offsets, int(offsets.diff().max())
        _LAST_RESTARTS[:] = position_ids, answer
    return _LAST_RESTARTS[1]


_LAST_UNPADDING: list = [None, None]  # (mask, S) and _unpadding's answer: one forward's layers share them


def _unpadding(mask, seqlen_q: int) -> tuple:
    """For a 2-D mask (B, Sk') whose last S positions are the queries: (token rows of the (B * S) queries, their
    offsets, the longest; the same for the (B * Sk') keys). Host syncs once a forward: every layer gets the same
    mask tensor."""
    last = _LAST_UNPADDING[0]
    if last is None or last[0] is not mask or last[1] != seqlen_q:
        keep_k = mask.bool()
        answer = []
        for keep in (keep_k[:, -seqlen_q:], keep_k):
            lengths = keep.sum(1, dtype=torch.int32)
            offsets = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            answer += [keep.reshape(-1).nonzero()[:, 0], offsets, int(lengths.max())]
        _LAST_UNPADDING[:] = (mask, seqlen_q), tuple(answer)
    return _LAST_UNPADDING[1]


def _unpadded(q, k, v, mask, options):
    """Attention of a padded batch (B, S, H, D) whose 2-D mask (B, Sk') marks the tokens of the last Sk' key positions
    (keys past it are unused slots of a static cache) and, in its last S positions, the queries: the tokens packed,
    attended as sequences, and scattered back (0 at padding)."""
    batch, seqlen_q = q.shape[:2]
    k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    rows_q, cu_q, max_q, rows_k, cu_k, max_k = _unpadding(mask, seqlen_q)
    out = flash_attention_varlen(q.flatten(0, 1)[rows_q], k.flatten(0, 1)[rows_k], v.flatten(0, 1)[rows_k], cu_q,
                                 cu_k, max_q, max_k, **options)  # fmt: skip
    padded = out.new_zeros((batch * seqlen_q, *out.shape[1:])).index_copy(0, rows_q, out)
    return padded.view(batch, seqlen_q, *out.shape[1:])


def register_attention() -> None:
    """Registers "tile_kernels" (flash_attention's default backend) and "tile_kernels_<backend>" with transformers'
    attention-function registry (so that `attn_implementation="tile_kernels"` selects it) and its mask registry
    (flash-attention's: no mask unless padded)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    for backend in (None, *ATTENTION_BACKENDS):
        name = ATTENTION if backend is None else f"{ATTENTION}_{backend}"
        AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
        AttentionMaskInterface.register(name, flash_attention_mask)


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
