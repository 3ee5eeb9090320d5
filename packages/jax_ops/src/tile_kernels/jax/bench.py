"""JAX side of `tile-kernels bench`: tile-kernels' JAX functions (jax-triton), the same math as plain `jax.jit` code
(XLA's fusions), and Pallas' GPU ops where JAX ships one (rms_norm, layer_norm, softmax, flash_attention's mha).

Timer: JAX runs on its own stream, so CUDA events on torch's stream cannot time it. A jitted call is enqueued `reps`
times back to back and the wall time to the last result is divided by `reps` (dispatch overlaps the kernels; for
calls under ~20 us the figure includes dispatch). bwd = the jitted VJP function of one recorded forward; step = the
jitted forward + VJP."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the device with torch in one process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tile_kernels.jax as tkj  # noqa: E402
from tile_kernels.core.bench import FUSED_BACKWARD, Case, Ceilings, Timing, other_backends  # noqa: E402
from tile_kernels.core.registry import REGISTRY  # noqa: E402

# ------------------------------------------------------------------------------ the ops as a JAX user writes them


def _norm(h, weight, bias, eps, is_rms):
    hf = h.astype(jnp.float32)
    if not is_rms:
        hf = hf - hf.mean(-1, keepdims=True)
    y = hf * jax.lax.rsqrt((hf * hf).mean(-1, keepdims=True) + eps) * weight
    return (y if bias is None else y + bias).astype(h.dtype)


def rms_norm(x, weight, eps=1e-6, residual=None):
    h = x if residual is None else x + residual
    y = _norm(h, weight, None, eps, True)
    return y if residual is None else (y, h)


def layer_norm(x, weight, bias=None, eps=1e-5, residual=None):
    h = x if residual is None else x + residual
    y = _norm(h, weight, bias, eps, False)
    return y if residual is None else (y, h)


def softmax(x, dim=-1):
    return jax.nn.softmax(x.astype(jnp.float32), axis=dim).astype(x.dtype)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    valid = target != ignore_index
    picked = jnp.take_along_axis(logp, jnp.where(valid, target, 0)[:, None], -1)[:, 0]
    loss = -((1 - label_smoothing) * picked + label_smoothing * logp.mean(-1))
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def apply_rotary(x, cos, sin, interleaved=False):
    c, s = cos[:, None, :], sin[:, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return jnp.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).reshape(x.shape).astype(x.dtype)
    x1, x2 = jnp.split(xf, 2, -1)
    return jnp.concatenate((x1 * c - x2 * s, x2 * c + x1 * s), -1).astype(x.dtype)


def fused_linear_cross_entropy(hidden, weight, target, ignore_index=-100, reduction="mean", chunk_size=None):
    return cross_entropy(hidden @ weight.T, target, ignore_index, reduction)


def flash_attention(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
    """jax.nn.dot_product_attention (XLA; GQA native, same (B, S, H, D) layout); windows, softcap and bottom-right
    causal with Sq != Sk through an explicit mask (rows that see no key give 0)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if softcap == 0 and tuple(window) == (-1, -1) and (not causal or seqlen_q == seqlen_k):
        return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal)
    group = q.shape[2] // k.shape[2]
    kf, vf = (jnp.repeat(t, group, axis=2).astype(jnp.float32) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    i = jnp.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    j = jnp.arange(seqlen_k)[None, :]
    left, right = window[0], 0 if causal else window[1]
    seen = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
    p = jnp.nan_to_num(jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1), nan=0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vf).astype(q.dtype)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           window=(-1, -1), softmax_scale=None, softcap=0.0):  # fmt: skip
    """The packed sequences padded to (B, max_seqlen, H, D) (a gather), attended in float32 with each sequence's mask
    (bottom-right causal, windows, its length; heads repeated for GQA), packed back (rows that see no key give 0)."""
    lengths_q, lengths_k = jnp.diff(cu_seqlens_q), jnp.diff(cu_seqlens_k)

    def padded(t, cu, longest):
        rows = jnp.clip(cu[:-1, None] + jnp.arange(longest)[None, :], 0, max(t.shape[0] - 1, 0))
        return t[rows].astype(jnp.float32) if t.shape[0] else jnp.zeros(rows.shape + t.shape[1:], jnp.float32)

    group = q.shape[1] // max(k.shape[1], 1)
    qp = padded(q, cu_seqlens_q, max_seqlen_q)
    kp, vp = (jnp.repeat(padded(t, cu_seqlens_k, max_seqlen_k), group, axis=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    s = jnp.einsum("bqhd,bkhd->bhqk", qp, kp) * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    i = jnp.arange(max_seqlen_q)[None, :, None] + (lengths_k - lengths_q)[:, None, None]
    j = jnp.arange(max_seqlen_k)[None, None, :]
    left, right = window[0], 0 if causal else window[1]
    seen = (j < lengths_k[:, None, None]) & ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
    p = jnp.nan_to_num(jax.nn.softmax(jnp.where(seen[:, None], s, -jnp.inf), axis=-1), nan=0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vp).astype(q.dtype)
    rows = jnp.arange(q.shape[0])
    seq = jnp.searchsorted(cu_seqlens_q[1:], rows, side="right")
    return out[seq, rows - cu_seqlens_q[seq]]


def dequant_matmul(a, qweight, scales, group_size=128, zeros=None):
    """The int4 codes unpacked by shifts, (code - zero) * scale in float32, rounded to a's dtype, then a @ W."""
    codes = (qweight[:, None, :] >> jnp.arange(0, 32, 4, dtype=jnp.int32)[None, :, None]) & 0xF
    codes = codes.reshape(-1, qweight.shape[1]).astype(jnp.float32)
    zero = 8.0 if zeros is None else jnp.repeat(zeros.astype(jnp.float32), group_size, axis=0)
    w = (codes - zero) * jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    return jnp.matmul(a, w.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)


_ACTIVATIONS = {
    None: lambda y: y,
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def matmul(a, b, bias=None, activation=None, residual=None):
    """XLA's dot (fp32 accumulation), the epilogue in fp32, rounded once."""
    y = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    y = _ACTIVATIONS[activation](y if bias is None else y + bias.astype(jnp.float32))
    return (y if residual is None else y + residual.astype(jnp.float32)).astype(a.dtype)


def fp8_matmul(a, a_scales, b, b_scales, out_dtype="bfloat16"):
    """a and b dequantized (code x its block's scale, in float32) to out_dtype, then XLA's dot (fp32 accumulation)."""
    wa = jnp.repeat(a_scales, 128, axis=1) * a.astype(jnp.float32)
    wb = jnp.repeat(jnp.repeat(b_scales, 128, axis=0), 128, axis=1) * b.astype(jnp.float32)
    y = jnp.matmul(wa.astype(out_dtype), wb.astype(out_dtype).T, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def fp8_quantize(x, block_rows=1):
    """amax per block, scale = amax / 448 (1 for zeros), codes x / scale cast to e4m3, in float32."""
    r, k = x.shape
    blocks = x.astype(jnp.float32).reshape(r // block_rows, block_rows, k // 128, 128)
    amax = jnp.abs(blocks).max(axis=(1, 3))
    scales = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (blocks / scales[:, None, :, None]).reshape(r, k).astype(jnp.float8_e4m3fn), scales


def rms_norm_fp8_quantize(x, weight, eps=1e-6, residual=None):
    """rms_norm's peer, then fp8_quantize's: the unfused pair."""
    out = rms_norm(x, weight, eps, residual)
    y, h = (out, None) if residual is None else out
    return fp8_quantize(y) + (() if h is None else (h,))


def swiglu_fp8_quantize(gate, up):
    """swiglu's peer, then fp8_quantize's: the unfused pair."""
    return fp8_quantize(swiglu(gate, up))


def moe_route(expert_ids, num_experts):
    """A stable argsort of the choices by expert (dropped ones keyed past the last expert), bincount."""
    ids = expert_ids.reshape(-1)
    key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = jnp.argsort(key, stable=True)
    positions = jnp.zeros_like(ids).at[order].set(jnp.arange(ids.size, dtype=ids.dtype))
    positions = jnp.where(key < num_experts, positions, -1).reshape(expert_ids.shape)
    return positions, jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)


def moe_permute(x, positions):
    """Each token's row set at its k positions (dropped ones out of bounds, dropped by the scatter)."""
    rows = positions.size
    index = jnp.where(positions >= 0, positions, rows).reshape(-1)
    return jnp.zeros((rows, x.shape[1]), x.dtype).at[index].set(jnp.repeat(x, positions.shape[1], 0), mode="drop")


def moe_unpermute(ys, positions, weights):
    """The k rows gathered, weighted (dropped ones 0) and summed in float32."""
    gates = jnp.where(positions >= 0, weights.astype(jnp.float32), 0.0)
    rows = ys[jnp.maximum(positions, 0)].astype(jnp.float32)
    return (rows * gates[..., None]).sum(1).astype(ys.dtype)


def grouped_matmul(x, weights, group_sizes):
    """XLA's ragged_dot (fp32 accumulation), rounded once."""
    return jax.lax.ragged_dot(x, weights, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None,
                     v_scale=None):  # fmt: skip
    """The cache gathered (through the block table when paged) and masked past each length, heads expanded for GQA,
    softmax in float32 (a sequence of length 0 gives 0); FP8 caches times their scales in float32."""
    if block_table is not None:  # (B, max_pages * page_size, Hk, D)
        k_cache, v_cache = (c[block_table].reshape((q.shape[0], -1) + c.shape[2:]) for c in (k_cache, v_cache))
    group = q.shape[1] // k_cache.shape[2]
    scaled = ((k_cache, k_scale), (v_cache, v_scale))
    k, v = (jnp.repeat(c, group, axis=2).astype(jnp.float32) * (x or 1.0) for c, x in scaled)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    s = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), k) * scale
    seen = jnp.arange(k.shape[1])[None, :] < cache_seqlens[:, None]
    p = jnp.nan_to_num(jax.nn.softmax(jnp.where(seen[:, None, :], s, -jnp.inf), axis=-1), nan=0.0)
    return jnp.einsum("bhs,bshd->bhd", p, v).astype(q.dtype)


def mla_decode(q_nope, q_pe, kv_c, k_pe, cache_seqlens, block_table=None, softmax_scale=None, return_lse=False):
    """The latent caches gathered (through the block table when paged), scores of both parts masked past each
    length, softmax in float32 (a sequence of length 0 gives 0 and lse -inf)."""
    if block_table is not None:  # (B, max_pages * page_size, D)
        kv_c, k_pe = (c[block_table].reshape((q_nope.shape[0], -1, c.shape[-1])) for c in (kv_c, k_pe))
    scale = softmax_scale if softmax_scale is not None else (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    kv = kv_c.astype(jnp.float32)
    s = jnp.einsum("bhc,bsc->bhs", q_nope.astype(jnp.float32), kv)
    s = (s + jnp.einsum("bhr,bsr->bhs", q_pe.astype(jnp.float32), k_pe.astype(jnp.float32))) * scale
    seen = jnp.arange(kv.shape[1])[None, None, :] < cache_seqlens[:, None, None]
    s = jnp.where(seen, s, -jnp.inf)
    p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1), nan=0.0)
    out = jnp.einsum("bhs,bsc->bhc", p, kv).astype(q_nope.dtype)
    return (out, jax.nn.logsumexp(s, axis=-1)) if return_lse else out


REFERENCE = {f.__name__: f for f in (rms_norm, layer_norm, softmax, swiglu, cross_entropy, apply_rotary,
                                     fused_linear_cross_entropy, flash_attention, flash_attention_varlen,
                                     decode_attention, dequant_matmul, matmul, fp8_matmul, fp8_quantize,
                                     grouped_matmul, mla_decode, moe_route, moe_permute, moe_unpermute,
                                     rms_norm_fp8_quantize, swiglu_fp8_quantize)}  # fmt: skip


def _pallas(op: str):
    """Pallas' GPU op for `op` with our argument names (3-D inputs, a bias argument), or None."""
    try:
        from jax.experimental.pallas.ops.gpu import attention as pl_attention
        from jax.experimental.pallas.ops.gpu import decode_attention as pl_decode
        from jax.experimental.pallas.ops.gpu import layer_norm as pl_layer
        from jax.experimental.pallas.ops.gpu import rms_norm as pl_rms
        from jax.experimental.pallas.ops.gpu import softmax as pl_softmax
    except ImportError:
        return None

    def norm(kernel, x, weight, bias, eps, residual):  # no fused residual add: XLA adds first
        h = x if residual is None else x + residual
        b = jnp.zeros_like(weight) if bias is None else bias
        y = kernel(h.reshape((1,) + h.shape), weight, b, eps=eps).reshape(h.shape)
        return y if residual is None else (y, h)

    def attention(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):  # (B, S, H, D) too
        if softcap or tuple(window) != (-1, -1) or q.shape[1:3] != k.shape[1:3]:
            raise NotImplementedError("Pallas' mha: no window, softcap, GQA or Sq != Sk")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return pl_attention.mha(q, k, v, None, sm_scale=scale, causal=causal)

    def decode(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, k_scale=None, v_scale=None):
        # Pallas' paged_attention takes (Hk, pages, page, D) caches: a transpose in the timing would be unfair
        if block_table is not None or q.ndim != 3 or k_cache.dtype != q.dtype:
            raise NotImplementedError("Pallas' gqa: contiguous caches in q's dtype, one query token a sequence")
        return pl_decode.gqa(q, k_cache, v_cache, kv_seq_len=cache_seqlens, sm_scale=softmax_scale)

    return {
        "flash_attention": attention,
        "decode_attention": decode,
        "rms_norm": lambda x, weight, eps=1e-6, residual=None: norm(pl_rms.rms_norm, x, weight, None, eps, residual),
        "layer_norm": lambda x, weight, bias=None, eps=1e-5, residual=None: norm(pl_layer.layer_norm, x, weight, bias,
                                                                                 eps, residual),
        "softmax": lambda x, dim=-1: pl_softmax.softmax(x, axis=dim),
    }.get(op)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- measuring


def _time_ms(fn, *args, min_seconds: float = 0.2) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    reps = max(3, min(1000, int(min_seconds / max(time.perf_counter() - start, 1e-6))))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class Provider:
    def __init__(self):
        if jax.default_backend() not in ("gpu", "cuda", "rocm"):
            raise SystemExit(f"bench: JAX's backend is {jax.default_backend()!r}, not a GPU")

    def device_name(self) -> str:
        return jax.devices()[0].device_kind

    def versions(self) -> dict:
        out = {"jax": jax.__version__}
        for dist in ("jaxlib", "jax-triton"):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out

    def ceilings(self) -> Ceilings:
        src = jnp.ones((1 << 28,), jnp.bfloat16)
        copy = jax.jit(lambda a: a + 1)  # one read, one write
        gbs = 2 * src.size * 2 / _time_ms(copy, src) / 1e6
        a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
        tflops = 2 * 8192**3 / _time_ms(jax.jit(jnp.matmul), a, a) / 1e9
        return Ceilings(copy_gbs=gbs, gemm_tflops=tflops)

    def implementations(self, op: str) -> dict:
        ours = getattr(tkj, op, None)
        impls = {"tile-kernels (jax)": ours} | {f"{k} (jax)": f for k, f in other_backends(op, ours, "cuda").items()}
        return impls | {"jax.jit": REFERENCE.get(op), "pallas": _pallas(op)}

    def measure(self, case: Case, only=None) -> list[Timing]:
        arrays = {k: jnp.asarray(v) for k, v in case.kwargs.items() if isinstance(v, (np.ndarray, np.generic))}
        attrs = {k: v for k, v in case.kwargs.items() if k not in arrays}
        names = [k for k in REGISTRY[case.op].grad_args if k in arrays]
        timings = []
        for name, fn in self.implementations(case.op).items():
            if only and not any(s in name for s in only):
                continue
            if fn is None:
                if name != "pallas":  # Pallas ships only a few ops: absence is the normal case
                    timings.append(Timing(name, None, None, note="no such op"))
                continue
            try:
                timings.append(self._time(name, fn, arrays, attrs, names))
            except Exception as e:  # reported, not dropped
                timings.append(Timing(name, None, None, note=f"{type(e).__name__}: {e}".splitlines()[0]))
        return timings

    def _time(self, name, fn, arrays, attrs, names) -> Timing:
        def call(diff, rest):
            return _as_tuple(fn(**diff, **rest, **attrs))

        diff = {k: arrays[k] for k in names}
        rest = {k: v for k, v in arrays.items() if k not in diff}
        fwd = jax.jit(call)
        fwd_ms = _time_ms(fwd, diff, rest)
        if not names:
            return Timing(name, fwd_ms, None, eager_fwd_ms=fwd_ms)  # jitted calls: wall times already
        try:
            outs, vjp_fn = jax.vjp(lambda d: call(d, rest), diff)
            cts = tuple(jax.random.normal(jax.random.key(i), o.shape, o.dtype) for i, o in enumerate(outs))
            bwd_ms = _time_ms(jax.jit(lambda f, c: f(c)), vjp_fn, cts)

            def value_and_grad(d, r, c):  # the outputs too, as a model consumes them: XLA drops unused writes
                outs, vjp_fn = jax.vjp(lambda d: call(d, r), d)
                return outs, vjp_fn(c)

            step_ms = _time_ms(jax.jit(value_and_grad), diff, rest, cts)
        except Exception as e:  # e.g. a peer without a VJP: its forward still counts
            return Timing(name, fwd_ms, None, note=f"backward: {type(e).__name__}: {e}".splitlines()[0],
                          eager_fwd_ms=fwd_ms)  # fmt: skip
        if bwd_ms < 0.05 * step_ms:  # the forward computed the gradients (fused_linear_cross_entropy)
            return Timing(name, fwd_ms, None, step_ms=step_ms, note=FUSED_BACKWARD, eager_fwd_ms=fwd_ms,
                          eager_step_ms=step_ms)  # fmt: skip
        return Timing(name, fwd_ms, bwd_ms, step_ms=step_ms, eager_fwd_ms=fwd_ms, eager_step_ms=step_ms)
