"""tile_kernels.core: each op defined once — Triton kernels, launch plans, float64 references, validation, cost.

Imports neither torch nor JAX. The adapters `tile_kernels.torch` and `tile_kernels.jax` execute the plans."""

# importing the op modules registers the ops
from . import (  # noqa: F401
    cross_entropy,
    decode_attention,
    dequant_matmul,
    flash_attention,
    flash_attention_varlen,
    fp8_matmul,
    fp8_quantize,
    fused_linear_cross_entropy,
    grouped_matmul,
    layer_norm,
    matmul,
    mla_decode,
    moe,
    rms_norm,
    rms_norm_fp8_quantize,
    rotary,
    softmax,
    swiglu,
    swiglu_fp8_quantize,
)
from .plan import BufferSpec, Launch, Plan, Target, dtype_name
from .registry import REGISTRY, BadInput, Cost, OpInfo

__all__ = ["REGISTRY", "BadInput", "BufferSpec", "Cost", "Launch", "OpInfo", "Plan", "Target", "dtype_name"]
