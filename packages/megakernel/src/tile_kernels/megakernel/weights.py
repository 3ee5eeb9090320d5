"""HF-Llama weight names and shapes: `model.layers.{i}.<name>.weight` (the `model.` prefix optional), and Qwen2's
q / k / v biases `model.layers.{i}.<name>.bias` where the config has them (qkv_bias)."""

from __future__ import annotations

from .config import DecoderConfig

# short name -> (HF name inside a layer, shape as a function of the config); nn.Linear weights are (out, in)
LAYER_WEIGHTS = {
    "attn_norm": ("input_layernorm", lambda c: (c.hidden,)),
    "q": ("self_attn.q_proj", lambda c: (c.q_size, c.hidden)),
    "k": ("self_attn.k_proj", lambda c: (c.kv_size, c.hidden)),
    "v": ("self_attn.v_proj", lambda c: (c.kv_size, c.hidden)),
    "o": ("self_attn.o_proj", lambda c: (c.hidden, c.q_size)),
    "mlp_norm": ("post_attention_layernorm", lambda c: (c.hidden,)),
    "gate": ("mlp.gate_proj", lambda c: (c.intermediate, c.hidden)),
    "up": ("mlp.up_proj", lambda c: (c.intermediate, c.hidden)),
    "down": ("mlp.down_proj", lambda c: (c.hidden, c.intermediate)),
}
QKV_BIASES = {
    "q_bias": ("self_attn.q_proj", lambda c: (c.q_size,)),
    "k_bias": ("self_attn.k_proj", lambda c: (c.kv_size,)),
    "v_bias": ("self_attn.v_proj", lambda c: (c.kv_size,)),
}


def layer_tensors(config: DecoderConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(short name, HF name inside a layer with its .weight / .bias suffix, shape) of every tensor a layer has."""
    out = [(short, f"{hf}.weight", shape_of(config)) for short, (hf, shape_of) in LAYER_WEIGHTS.items()]
    if config.qkv_bias:
        out += [(short, f"{hf}.bias", shape_of(config)) for short, (hf, shape_of) in QKV_BIASES.items()]
    return out


def layer_weights(config: DecoderConfig, weights: dict) -> list[dict]:
    """Per layer {short name: tensor}, after checking that every tensor is present, of the right shape, and that all
    share one floating dtype and one device. Extra entries (embeddings, lm_head, final norm) are ignored."""
    import torch

    if not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict of name -> torch.Tensor, got {type(weights).__name__}")
    layers, dtype, device = [], None, None
    for i in range(config.num_layers):
        layer = {}
        for short, hf, shape in layer_tensors(config):
            name = f"model.layers.{i}.{hf}"
            t = weights.get(name, weights.get(name[len("model.") :]))
            if t is None:
                raise ValueError(f"weights: missing {name!r} (or without the 'model.' prefix)")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weights[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"weights[{name!r}]: expected shape {shape}, got {tuple(t.shape)}")
            if dtype is None:
                dtype, device = t.dtype, t.device
                if not t.dtype.is_floating_point:
                    raise TypeError(f"weights[{name!r}]: expected a floating dtype, got {t.dtype}")
            elif t.dtype != dtype or t.device != device:
                raise ValueError(
                    f"weights[{name!r}]: expected {dtype} on {device} like the first weight, got {t.dtype} on "
                    f"{t.device}"
                )
            layer[short] = t
        layers.append(layer)
    return layers
