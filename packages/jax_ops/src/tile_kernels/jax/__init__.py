"""tile_kernels.jax: the core ops as JAX functions (jit, grad through custom_vjp, vmap folded into one launch).

On a CUDA/ROCm backend the Triton kernels launch through jax-triton. On the CPU backend, TRITON_INTERPRET=1 (set
before import) selects interpret mode: the same kernels run in Triton's interpreter inside a jax.pure_callback.
Without either, a call raises a clear error; there is no silent fallback to a jnp implementation. No torch needed."""

from .cross_entropy import cross_entropy
from .decode_attention import decode_attention
from .dequant_matmul import dequant_matmul
from .flash_attention import flash_attention
from .flash_attention_varlen import flash_attention_varlen
from .fp8_matmul import fp8_matmul
from .fp8_quantize import fp8_quantize
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .grouped_matmul import grouped_matmul
from .matmul import matmul
from .mla_decode import mla_decode
from .moe import moe_permute, moe_route, moe_unpermute
from .norms import layer_norm, rms_norm
from .rms_norm_fp8_quantize import rms_norm_fp8_quantize
from .rotary import apply_rotary
from .softmax import softmax
from .swiglu import swiglu
from .swiglu_fp8_quantize import swiglu_fp8_quantize

__all__ = [
    "apply_rotary", "cross_entropy", "decode_attention", "dequant_matmul", "flash_attention", "flash_attention_varlen",
    "fp8_matmul", "fp8_quantize", "fused_linear_cross_entropy", "grouped_matmul", "layer_norm", "matmul", "mla_decode",
    "moe_permute", "moe_route", "moe_unpermute", "rms_norm", "rms_norm_fp8_quantize", "softmax", "swiglu",
    "swiglu_fp8_quantize",
]  # fmt: skip
