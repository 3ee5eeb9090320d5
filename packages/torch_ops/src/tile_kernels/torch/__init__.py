"""tile_kernels.torch: the core ops as torch custom ops (torch.ops.tile_kernels.*), torch.compile-clean, with autograd.

On CUDA/ROCm tensors the compiled Triton kernels run; on CPU tensors the same kernels run in Triton's interpreter when
TRITON_INTERPRET=1 was set before import, and a call raises a clear error otherwise."""

from . import nn
from ._distributed import register_rules
from .cross_entropy import cross_entropy, cross_entropy_bwd, cross_entropy_fwd
from .decode_attention import decode_attention, decode_attention_fwd
from .dequant_matmul import dequant_matmul, dequant_matmul_fwd
from .flash_attention import flash_attention, flash_attention_bwd, flash_attention_fwd
from .flash_attention_varlen import flash_attention_varlen, flash_attention_varlen_bwd, flash_attention_varlen_fwd
from .fp8_matmul import fp8_matmul, fp8_matmul_fwd
from .fp8_quantize import fp8_quantize, fp8_quantize_fwd
from .fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_bwd,
    fused_linear_cross_entropy_fwd,
    fused_linear_cross_entropy_scale_,
)
from .grouped_matmul import grouped_matmul, grouped_matmul_bwd, grouped_matmul_fwd
from .matmul import matmul, matmul_fwd
from .mla_decode import mla_decode, mla_decode_fwd
from .models import apply_to
from .moe import (
    moe_permute,
    moe_permute_bwd,
    moe_permute_fwd,
    moe_route,
    moe_route_fwd,
    moe_unpermute,
    moe_unpermute_bwd,
    moe_unpermute_fwd,
)
from .norms import layer_norm, layer_norm_bwd, layer_norm_fwd, rms_norm, rms_norm_bwd, rms_norm_fwd
from .rms_norm_fp8_quantize import rms_norm_fp8_quantize, rms_norm_fp8_quantize_fwd
from .rotary import apply_rotary, apply_rotary_bwd, apply_rotary_fwd
from .softmax import softmax, softmax_bwd, softmax_fwd
from .swiglu import swiglu, swiglu_bwd, swiglu_fwd
from .swiglu_fp8_quantize import swiglu_fp8_quantize, swiglu_fp8_quantize_fwd

register_rules()  # DTensor sharding strategies of the ops above (tile_kernels.core.sharding)

__all__ = [
    "apply_rotary", "apply_rotary_bwd", "apply_rotary_fwd", "apply_to", "cross_entropy", "cross_entropy_bwd",
    "cross_entropy_fwd", "decode_attention", "decode_attention_fwd", "dequant_matmul", "dequant_matmul_fwd",
    "flash_attention", "flash_attention_bwd", "flash_attention_fwd", "fp8_matmul", "fp8_matmul_fwd",
    "fp8_quantize", "fp8_quantize_fwd",
    "flash_attention_varlen", "flash_attention_varlen_bwd", "flash_attention_varlen_fwd",
    "fused_linear_cross_entropy", "fused_linear_cross_entropy_bwd", "fused_linear_cross_entropy_fwd",
    "fused_linear_cross_entropy_scale_", "grouped_matmul", "grouped_matmul_bwd", "grouped_matmul_fwd",
    "layer_norm", "layer_norm_bwd", "layer_norm_fwd", "matmul", "matmul_fwd", "mla_decode", "mla_decode_fwd",
    "moe_permute", "moe_permute_bwd", "moe_permute_fwd", "moe_route", "moe_route_fwd", "moe_unpermute",
    "moe_unpermute_bwd", "moe_unpermute_fwd", "nn",
    "rms_norm", "rms_norm_bwd", "rms_norm_fwd", "rms_norm_fp8_quantize", "rms_norm_fp8_quantize_fwd",
    "softmax", "softmax_bwd", "softmax_fwd", "swiglu", "swiglu_bwd", "swiglu_fwd", "swiglu_fp8_quantize",
    "swiglu_fp8_quantize_fwd",
]  # fmt: skip
