"""torch adapter of tile_kernels.core.mla_decode: op tile_kernels::mla_decode_fwd (inference: no autograd).
backend="tilelang" runs through the custom op tile_kernels::mla_decode_fwd_compiled (the TileLang split kernel and
the Triton combine; opaque to torch.compile, with a fake implementation)."""

from __future__ import annotations

import torch

from tile_kernels.core import dtype_name
from tile_kernels.core import mla_decode as core

from ._calls import cuda_arch, resolve_backend
from ._runtime import compiled_op, eager_op, executor, register_public_op, target, unit_last, validated


@compiled_op("mla_decode_fwd_compiled")
def mla_decode_fwd_compiled(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None, softmax_scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """mla_decode_fwd through the TileLang kernel (compact inputs: a strided one is copied)."""
    q_nope, q_pe, kv_c, k_pe, cache_seqlens = (t.contiguous() for t in (q_nope, q_pe, kv_c, k_pe, cache_seqlens))
    batch, heads, latent_dim = q_nope.shape
    inputs = [q_nope, q_pe, kv_c, k_pe, cache_seqlens]
    page_size = None
    if block_table is not None:
        page_size = kv_c.shape[1]
        inputs.append(block_table.contiguous())
    capacity = kv_c.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    run = executor(
        core.compiled_forward,
        backend, batch, heads, latent_dim, q_pe.shape[2], capacity, dtype=dtype_name(q_nope.dtype),
        scale=softmax_scale, arch=cuda_arch(q_nope.device), target=target(q_nope.device), page_size=page_size,
    )  # fmt: skip
    out, lse = run(*inputs, device=q_nope.device)
    return out, lse


@mla_decode_fwd_compiled.register_fake
def _(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, backend):
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)


def _fwd(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None, softmax_scale: float, backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns out (B, H, Dc) in q's dtype and lse (B, H) float32 (natural log). `backend` is a resolved name
    (tile_kernels.core.backends.resolve)."""
    if backend != "triton":
        return mla_decode_fwd_compiled(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, backend)
    q_nope, q_pe, kv_c, k_pe = (unit_last(t) for t in (q_nope, q_pe, kv_c, k_pe))
    batch, heads, latent_dim = q_nope.shape
    slots = kv_c.shape[1]
    inputs = [q_nope, q_pe, kv_c, k_pe, cache_seqlens.contiguous()]
    paged = dict(page_size=None)
    if block_table is not None:
        block_table = unit_last(block_table)
        paged = dict(page_size=slots, stride_bt=block_table.stride(0))
        inputs.append(block_table)
    capacity = slots * (block_table.shape[1] if block_table is not None else 1)
    run = executor(
        core.forward, batch, heads, latent_dim, q_pe.shape[2], capacity, dtype=dtype_name(q_nope.dtype),
        scale=softmax_scale, target=target(q_nope.device), strides_q_nope=tuple(q_nope.stride()[:2]),
        strides_q_pe=tuple(q_pe.stride()[:2]), strides_kv=tuple(kv_c.stride()[:2]),
        strides_k_pe=tuple(k_pe.stride()[:2]), **paged,
    )  # fmt: skip
    out, lse = run(*inputs, device=q_nope.device)
    return out, lse


mla_decode_fwd = eager_op("mla_decode_fwd", _fwd)


def mla_decode(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None, return_lse: bool = False,
    backend: str | None = None,
):  # fmt: skip
    """DeepSeek-V3 MLA decode with absorbed weights, one new token a sequence: q_nope (B, H, Dc) and q_pe (B, H, Dr)
    over the first cache_seqlens[b] (int32 (B,)) positions of the latent cache kv_c and the rope keys k_pe,
    contiguous (B, Smax, Dc) / (B, Smax, Dr) or paged (num_blocks, page_size, Dc) / (num_blocks, page_size, Dr)
    with block_table (B, max_pages) int32. scores = (q_nope . kv_c + q_pe . k_pe) * softmax_scale (default
    1 / sqrt(Dc + Dr)), out = softmax(scores) @ kv_c, (B, H, Dc) in q's dtype; with return_lse also the
    log-sum-exp of the scores (B, H) float32, natural log (-inf for an empty sequence, whose output is 0).
    backend: "triton", "tilelang" (Hopper; Dc 512, Dr 64, float16 / bfloat16, pages a multiple of 64) or None for
    the fastest measured for these inputs on the device (core.preferred_backend: TileLang where it runs). Not
    differentiable."""
    _, device = validated(core.NAME, core.check, ("q_nope", "q_pe", "kv_c", "k_pe", "cache_seqlens", "block_table",
                          None, None), q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, softmax_scale,
                          return_lse)  # fmt: skip
    page_size = kv_c.shape[1] if block_table is not None else None
    dims = dtype_name(q_nope.dtype), q_nope.shape[-1], q_pe.shape[-1], page_size
    backend = resolve_backend(core.NAME, backend, device, core.preferred_backend, *dims)
    scale = core.options(q_nope, q_pe, softmax_scale, backend, block_table, kv_c)
    out, lse = mla_decode_fwd(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table, scale, backend)
    return (out, lse) if return_lse else out


register_public_op(
    "mla_decode(Tensor q_nope, Tensor q_pe, Tensor kv_c, Tensor k_pe, Tensor cache_seqlens, Tensor? block_table=None, "
    "float? softmax_scale=None, bool return_lse=False, str? backend=None) -> Tensor[]",
    lambda *args, **kwargs: list(_as_tuple(mla_decode(*args, **kwargs))),
)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)
