"""flash_attention's TileLang forward (backend="tilelang"): the math of flash_attention.py, written in TileLang.

One program per (BLOCK_M queries, query head, batch entry); query head h reads key/value head h // (Hq / Hk). The
query tile stays in shared memory; the key/value tiles of the block's visible band stream through a T.Pipelined
loop of `stages` buffers. Per key block, in base-2 units (c = log2(e)):
    s = scale * c * q.k^T            (softcap: s = softcap * c * tanh(scale * q.k^T / softcap), tanh from exp2)
    s = -inf where key j is invisible to query i (only on blocks the band does not cover entirely, a runtime test)
    m' = max(m, rowmax(s)),  p = exp2(s - m'),  l = l * exp2(m - m') + rowsum(p),  acc = acc * exp2(m - m') + p V
then out = acc / l (0 where l = 0) and lse = m + log2(l) (+inf where l = 0): exactly the (out, lse) of the Triton
forward, so its backward (flash_attention.backward) gives the gradients. m starts at -1e30 (finite: no inf - inf;
scores never get that low), so a row that has seen no key keeps l = 0 and acc = 0.

Kernels: one per (dtype, head-dim bucket D in 64 / 128 / 256, EVEN: the head dim is D, SOFTCAP) and architecture.
Causal / windowed / full attention share one kernel: the band (left, right) is a pair of runtime ints as in the
Triton kernels (unbounded = Sq + Sk). Sizes B, Sq, Sk, Hq, Hk (and the head dim when not EVEN) are dynamic: no
recompiles per shape. EVEN kernels address the tiles as whole rows, so TileLang lowers the tile copies to TMA on
sm_90a (and cp.async on sm_80), its GEMMs to wgmma on sm_90a (mma.sync on sm_80, MFMA on gfx942) and, on sm_90a,
splits the loop into a TMA producer warp group and wgmma consumers (warp specialization); all of that is TileLang's
choice per target, no Hopper-only path is written here. A head dim below its bucket pads the tiles with zeros
(predicated copies; TMA off: its row strides need not be 16-byte multiples). Inputs are compact (B, S, H, D) in
float16 / bfloat16 (`unsupported` says why another input cannot run: float32 would run its products in TF32).

Design limits: sequence lengths below 2^31 (TMA coordinates and the band arithmetic are int32; the padded kernels'
offsets are int64); B and Hq up to 65535 (grid dims y, z); TMA needs 16-byte aligned bases (torch / JAX allocations
are).

Performance (H200, 2026-11-29, bf16 4x8192x32x128): 535 TFLOP/s forward (77% of the measured GEMM ceiling; causal
490), against the Triton forward's 488 and cuDNN's 590. What TileLang 0.1.15 generates for sm_90a (the .cu that
`tile-kernels aot --target cuda:90 --op flash_attention --out DIR` writes): a TMA producer warp group (registers
released to 24) and two wgmma consumer groups (240 each), K and V in 2 stages, and a `warpgroup_wait<0>` after each
GEMM: a group's softmax never overlaps its own GEMMs, only the other group's. Overlapping a block's softmax with the
next block's QK^T inside a group (T.Pipelined's order / stage / group, or T.wgmma_gemm / T.wait_wgmma), 3 stages and a
wider BLOCK_N at head dim 128 are the next steps.
"""

import functools

from .backends import tilelang_build, tilelang_lower, tilelang_target

LOG2E = 1.4426950408889634
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)  # the buckets; smaller head dims pad up to the next one
# nvcc --use_fast_math: exp2 / log2 as single MUFU instructions (ex2 / lg2.approx, relative error ~2^-22; exp2(-inf)
# is still 0), approximate divisions. It would also turn tanhf into tanh.approx (error ~2^-11, times softcap * log2(e)
# in the exponent): the softcap's tanh is written with exp2 instead.
FAST_MATH = {"tl.enable_fast_math": True}

# (BLOCK_M, BLOCK_N, stages, threads) per architecture family and head-dim bucket. sm_90a: 128 x 128 tiles, two
# consumer warp groups (TileLang adds the producer); the 256 bucket halves BLOCK_N to fit 227 KiB of shared memory
# (q 64 KiB + 2 stages of k, v 32 KiB each + the output tile). sm_80 (163 KiB) / gfx942 (64 KiB LDS): smaller.
CONFIGS = {
    "sm90": {64: (128, 128, 2, 256), 128: (128, 128, 2, 256), 256: (128, 64, 2, 256)},
    "sm80": {64: (128, 64, 2, 128), 128: (128, 64, 2, 256), 256: (64, 32, 2, 128)},
    "hip": {64: (64, 64, 1, 256), 128: (64, 32, 1, 256), 256: (32, 32, 1, 128)},
}


def bucket(head_dim: int) -> int:
    return next(d for d in HEAD_DIMS if head_dim <= d)


def unsupported(dtype: str, head_dim: int) -> str | None:
    """Why the TileLang forward cannot run these inputs (a clause naming the feature), or None."""
    if dtype not in DTYPES:
        return f"supports q, k, v in {' / '.join(DTYPES)} only (its GEMMs would round float32 to TF32), got {dtype}"
    if head_dim > HEAD_DIMS[-1]:
        return f"supports head dims up to {HEAD_DIMS[-1]}, got {head_dim}"
    return None


def unsupported_inputs(kwargs) -> str | None:
    """`unsupported` for a call's arguments (backends.unsupported_inputs)."""
    return unsupported(str(kwargs["q"].dtype), kwargs["q"].shape[-1])


def kernel_name(head_dim: int, softcap: bool) -> str:
    """The kernel that serves this head dim: flash_fwd_d{bucket}[_pad][_softcap]."""
    d = bucket(head_dim)
    return f"flash_fwd_d{d}" + ("" if head_dim == d else "_pad") + ("_softcap" if softcap else "")


def _parse(kernel: str) -> tuple[int, bool, bool]:
    parts = kernel.removeprefix("flash_fwd_d").split("_")
    return int(parts[0]), "pad" not in parts, "softcap" in parts


def _family(tilelang_target: dict) -> str:
    if tilelang_target["kind"] == "hip":
        return "hip"
    return "sm90" if int(tilelang_target["arch"].removeprefix("sm_").rstrip("a")) >= 90 else "sm80"


NO_KEYS_KERNEL = "flash_fwd_no_keys"  # Sk = 0: every row sees no key


def _no_keys(dtype: str):
    """OUT = 0, LSE = +inf; grid (cdiv(Sq, 128), Hq, B), a thread per query row."""
    import tilelang.language as T

    B, SQ, HQ, D = T.dynamic("B SQ HQ D")

    @T.prim_func
    def flash_fwd_no_keys(OUT: T.Tensor((B, SQ, HQ, D), dtype), LSE: T.Tensor((B, HQ, SQ), "float32")):
        with T.Kernel(T.ceildiv(SQ, 128), HQ, B, threads=128) as (mb, h, b):
            for i in T.Parallel(128):
                row = mb * 128 + i
                if row < SQ:
                    LSE[b, h, row] = T.infinity("float32")
                    for d in T.serial(D):
                        OUT[b, row, h, d] = T.cast(0, dtype)

    return flash_fwd_no_keys


def prim_func(kernel: str, dtype: str, tilelang_target: dict):
    """The forward prim_func `kernel` (kernel_name) for one dtype and target. Parameters: Q, K, V (reads), OUT, LSE
    (writes), scale, softcap, left, right (scalars)."""
    import tilelang.language as T

    if kernel == NO_KEYS_KERNEL:
        return _no_keys(dtype)
    d_pad, even, has_softcap = _parse(kernel)
    block_m, block_n, stages, threads = CONFIGS[_family(tilelang_target)][d_pad]
    f32 = "float32"
    B, SQ, SK, HQ, HK = T.dynamic("B SQ SK HQ HK")
    D = d_pad if even else T.dynamic("D")
    # padded head dims: no TMA (a row stride of H * D elements need not be a multiple of 16 bytes)
    hints = None if even else {"disable_tma": True}

    @T.prim_func
    def flash_fwd(
        Q: T.Tensor((B, SQ, HQ, D), dtype),
        K: T.Tensor((B, SK, HK, D), dtype),
        V: T.Tensor((B, SK, HK, D), dtype),
        OUT: T.Tensor((B, SQ, HQ, D), dtype),
        LSE: T.Tensor((B, HQ, SQ), f32),
        scale: T.float32,
        softcap: T.float32,
        left: T.int32,
        right: T.int32,
    ):
        with T.Kernel(T.ceildiv(SQ, block_m), HQ, B, threads=threads) as (bx, h, b):
            mb = T.ceildiv(SQ, block_m) - 1 - bx  # the last query blocks (the longest causal bands) start first
            q_tile = T.alloc_shared((block_m, d_pad), dtype)
            k_tile = T.alloc_shared((block_n, d_pad), dtype)
            v_tile = T.alloc_shared((block_n, d_pad), dtype)
            o_tile = T.alloc_shared((block_m, d_pad), dtype)
            s = T.alloc_fragment((block_m, block_n), f32)
            p = T.alloc_fragment((block_m, block_n), dtype)
            acc = T.alloc_fragment((block_m, d_pad), f32)
            m = T.alloc_fragment((block_m,), f32)
            m_prev = T.alloc_fragment((block_m,), f32)
            row_sum = T.alloc_fragment((block_m,), f32)
            l = T.alloc_fragment((block_m,), f32)  # noqa: E741 - the softmax denominator's usual name

            hk = h // (HQ // HK)
            m0 = mb * block_m
            shift = SK - SQ  # bottom-right alignment: query i sees keys [i + shift - left, i + shift + right]
            # key blocks [first, last) hold every key a row of this block sees; keys in [full_lo, full_hi) are seen
            # by every row, so a block inside that range needs no mask
            first = T.max(m0 + shift - left, 0) // block_n
            # at least one block: the loop's first iteration waits for the query tile (a block that sees no key
            # then masks all of one block and keeps l = 0)
            last = T.max(T.ceildiv(T.min(m0 + block_m + shift + right, SK), block_n), first + 1)
            full_lo = m0 + block_m - 1 + shift - left
            full_hi = T.min(m0 + shift + right + 1, SK)

            T.copy(Q[b, m0 : m0 + block_m, h, 0:d_pad], q_tile, annotations=hints)
            T.fill(acc, 0)
            T.fill(l, 0)
            T.fill(m, -1e30)
            for kb in T.Pipelined(first, last, num_stages=stages):
                n0 = kb * block_n
                T.copy(K[b, n0 : n0 + block_n, hk, 0:d_pad], k_tile, annotations=hints)
                T.gemm(q_tile, k_tile, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                for i, j in T.Parallel(block_m, block_n):
                    if has_softcap:
                        # softcap * tanh(x) = softcap - 2 softcap / (exp(2x) + 1): saturates to +-softcap
                        t = T.exp2(s[i, j] * (scale / softcap * 2 * LOG2E))
                        s[i, j] = (softcap * LOG2E) - (2 * softcap * LOG2E) / (t + 1)
                    else:
                        s[i, j] = s[i, j] * (scale * LOG2E)
                if n0 < full_lo or n0 + block_n > full_hi:
                    for i, j in T.Parallel(block_m, block_n):
                        diag = m0 + i + shift
                        key = n0 + j
                        seen = (key < SK) & (key >= diag - left) & (key <= diag + right)
                        s[i, j] = T.if_then_else(seen, s[i, j], -T.infinity(f32))
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)  # m = max(m_prev, rowmax(s))
                for i, j in T.Parallel(block_m, block_n):
                    s[i, j] = T.exp2(s[i, j] - m[i])
                T.reduce_sum(s, row_sum, dim=1)
                for i in T.Parallel(block_m):
                    m_prev[i] = T.exp2(m_prev[i] - m[i])  # the rescale factor of the running sums
                    l[i] = l[i] * m_prev[i] + row_sum[i]
                for i, j in T.Parallel(block_m, d_pad):
                    acc[i, j] *= m_prev[i]
                T.copy(s, p)
                T.copy(V[b, n0 : n0 + block_n, hk, 0:d_pad], v_tile, annotations=hints)
                T.gemm(p, v_tile, acc, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block_m, d_pad):
                acc[i, j] = acc[i, j] / T.if_then_else(l[i] == 0, T.float32(1), l[i])
            T.copy(acc, o_tile)
            T.copy(o_tile, OUT[b, m0 : m0 + block_m, h, 0:d_pad], annotations=hints)
            for i in T.Parallel(block_m):
                if m0 + i < SQ:
                    LSE[b, h, m0 + i] = T.if_then_else(l[i] == 0, T.infinity(f32), m[i] + T.log2(l[i]))

    return flash_fwd


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, dtype, dtype) of every kernel in the given dtypes that it supports (the AOT matrix)."""
    kernels = [kernel_name(d - pad, softcap) for d in HEAD_DIMS for pad in (0, 1) for softcap in (False, True)]
    kernels.append(NO_KEYS_KERNEL)
    return [(k, d, d) for d in dtypes if d in DTYPES for k in kernels]


target = tilelang_target


def lower(kernel: str, dtype: str, _dtype: str, target: dict):
    """TileLang's lowering of one kernel for a target (no build)."""
    return tilelang_lower(lambda: prim_func(kernel, dtype, target), target)


def build(kernel: str, dtype: str, _dtype: str, target: dict):
    """TileLang's nvcc build of one kernel (TVM-FFI calling convention)."""
    return tilelang_build(lambda: prim_func(kernel, dtype, target), target, pass_configs=FAST_MATH)


@functools.cache
def function(kernel: str, dtype: str, _dtype: str, arch: int):
    """The compiled kernel's TVM-FFI function: kernel(q, k, v, out, lse, scale, softcap, left, right)."""
    compiled = build(kernel, dtype, dtype, target(arch))
    return compiled.adapter.get_exportable_executable()[compiled.adapter.prim_func.attrs["global_symbol"]]
