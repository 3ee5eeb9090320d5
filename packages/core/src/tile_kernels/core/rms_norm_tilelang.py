"""rms_norm's TileLang kernels (backend="tilelang"): the math of norms.py (is_rms=True), written in TileLang.

Forward, grid (rows, batch), one program of THREADS threads per row, the row streamed in CHUNK-element chunks:
pass 1 forms h (= x + residual, rounded to x's dtype and stored) and sum(h^2); pass 2 re-reads h (mostly from L2)
and writes y = h * rstd * weight. A thread touches the same columns in both passes, so it reads back only its own
stores. Backward, grid (P, batch), P programs per problem (rows.programs_per_problem): program p takes rows p, p + P,
...; pass 1 forms mean(g * xhat) with g = dy * weight, xhat = h * rstd; pass 2 writes
dx = rstd * (g - xhat * mean(g * xhat)) (+ dh) and accumulates dy * xhat into its fp32 row dweight_partial[b, p, :]
(written on its first row, no zeroing); `colsum` then reduces the P rows into dweight.

Design limits: any width (dynamic shapes, int32 sizes as TileLang binds them, int64 offsets); one compile per dtype
pair, flag and architecture, cached by TileLang on disk. Buffers are compact: the adapters pass contiguous rows.
Weight is (WB, n) with WB = 1 (shared) or batch (one per problem, a JAX vmap), row min(b, WB - 1).
"""

from .backends import tilelang_entry_points, tilelang_target

THREADS = 256
CHUNK = THREADS * 8  # elements of a row per step: 8 per thread
COLSUM_THREADS = 256


def _kernels(x_dtype: str, w_dtype: str, flag: bool):
    """The forward (flag: with residual) and backward (flag: with dh) prim_funcs for one dtype pair."""
    import tilelang.language as T

    f32 = "float32"
    B, M, N, WB, P = T.dynamic("B M N WB P")

    @T.macro
    def fwd_body(X, R, W, Y, H, RSTD, eps):
        with T.Kernel(M, B, threads=THREADS) as (row, b):
            acc = T.alloc_fragment((1, CHUNK), f32)
            total = T.alloc_fragment((1,), f32)
            T.clear(acc)
            for k in T.serial(T.ceildiv(N, CHUNK)):
                for i, j in T.Parallel(1, CHUNK):
                    col = k * CHUNK + j
                    if col < N:
                        if flag:
                            h = T.cast(T.cast(X[b, row, col], f32) + T.cast(R[b, row, col], f32), x_dtype)
                            H[b, row, col] = h
                            acc[i, j] += T.cast(h, f32) * T.cast(h, f32)
                        else:
                            acc[i, j] += T.cast(X[b, row, col], f32) * T.cast(X[b, row, col], f32)
            T.reduce_sum(acc, total, dim=1)
            rstd = T.rsqrt(total[0] / T.cast(N, f32) + eps)
            wb = T.min(b, WB - 1)  # WB is 1 (shared weight) or B
            for k in T.serial(T.ceildiv(N, CHUNK)):
                for _i, j in T.Parallel(1, CHUNK):
                    col = k * CHUNK + j
                    if col < N:
                        y = T.cast(H[b, row, col], f32) * rstd * T.cast(W[wb, col], f32)
                        Y[b, row, col] = T.cast(y, x_dtype)
            RSTD[b, row] = rstd

    @T.macro
    def bwd_body(DY, Hin, W, RSTD, DH, DX, DWP):
        with T.Kernel(P, B, threads=THREADS) as (p, b):
            acc = T.alloc_fragment((1, CHUNK), f32)
            total = T.alloc_fragment((1,), f32)
            wb = T.min(b, WB - 1)  # WB is 1 (shared weight) or B
            for step in T.serial(T.ceildiv(M - p, P)):
                m = p + step * P
                rstd = RSTD[b, m]
                T.clear(acc)
                for k in T.serial(T.ceildiv(N, CHUNK)):
                    for i, j in T.Parallel(1, CHUNK):
                        col = k * CHUNK + j
                        if col < N:
                            g = T.cast(DY[b, m, col], f32) * T.cast(W[wb, col], f32)
                            acc[i, j] += g * (T.cast(Hin[b, m, col], f32) * rstd)
                T.reduce_sum(acc, total, dim=1)
                mean_gx = total[0] / T.cast(N, f32)
                for k in T.serial(T.ceildiv(N, CHUNK)):
                    for _i, j in T.Parallel(1, CHUNK):
                        col = k * CHUNK + j
                        if col < N:
                            dy = T.cast(DY[b, m, col], f32)
                            xhat = T.cast(Hin[b, m, col], f32) * rstd
                            dx = (dy * T.cast(W[wb, col], f32) - xhat * mean_gx) * rstd
                            if flag:
                                dx += T.cast(DH[b, m, col], f32)
                            DX[b, m, col] = T.cast(dx, x_dtype)
                            DWP[b, p, col] = T.if_then_else(step == 0, T.float32(0), DWP[b, p, col]) + dy * xhat

    # annotations are factories (TileLang calls them): one buffer per parameter
    def X3():
        return T.Tensor((B, M, N), x_dtype)

    def W2():
        return T.Tensor((WB, N), w_dtype)

    def S2():
        return T.Tensor((B, M), f32)

    def P3():
        return T.Tensor((B, P, N), f32)

    if flag:

        @T.prim_func
        def rms_norm_fwd_residual(X: X3, R: X3, W: W2, Y: X3, H: X3, RSTD: S2, eps: T.float32):
            fwd_body(X, R, W, Y, H, RSTD, eps)

        @T.prim_func
        def rms_norm_bwd_dh(DY: X3, H: X3, W: W2, RSTD: S2, DH: X3, DX: X3, DWP: P3):
            bwd_body(DY, H, W, RSTD, DH, DX, DWP)

        return rms_norm_fwd_residual, rms_norm_bwd_dh

    @T.prim_func
    def rms_norm_fwd(X: X3, W: W2, Y: X3, RSTD: S2, eps: T.float32):
        fwd_body(X, X, W, Y, X, RSTD, eps)  # h is x: pass 2 re-reads x

    @T.prim_func
    def rms_norm_bwd(DY: X3, H: X3, W: W2, RSTD: S2, DX: X3, DWP: P3):
        bwd_body(DY, H, W, RSTD, DY, DX, DWP)

    return rms_norm_fwd, rms_norm_bwd


def _colsum(w_dtype: str):
    """dweight[b, n] = sum over p of dweight_partial[b, p, n]; grid (cdiv(n, COLSUM_THREADS), batch)."""
    import tilelang.language as T

    B, P, N = T.dynamic("B P N")

    @T.prim_func
    def rms_norm_colsum(DWP: T.Tensor((B, P, N), "float32"), DW: T.Tensor((B, N), w_dtype)):
        with T.Kernel(T.ceildiv(N, COLSUM_THREADS), B, threads=COLSUM_THREADS) as (cb, b):
            acc = T.alloc_fragment((COLSUM_THREADS,), "float32")
            T.clear(acc)
            for p in T.serial(P):
                for j in T.Parallel(COLSUM_THREADS):
                    col = cb * COLSUM_THREADS + j
                    if col < N:
                        acc[j] += DWP[b, p, col]
            for j in T.Parallel(COLSUM_THREADS):
                col = cb * COLSUM_THREADS + j
                if col < N:
                    DW[b, col] = T.cast(acc[j], w_dtype)

    return rms_norm_colsum


def prim_func(kernel: str, x_dtype: str, w_dtype: str, _tilelang_target: dict):
    """One kernel by name: rms_norm_fwd, rms_norm_fwd_residual, rms_norm_bwd, rms_norm_bwd_dh, rms_norm_colsum."""
    if kernel == "rms_norm_colsum":
        return _colsum(w_dtype)
    fwd, bwd = _kernels(x_dtype, w_dtype, flag=kernel.endswith(("_residual", "_dh")))
    return fwd if kernel.startswith("rms_norm_fwd") else bwd


def variants(dtypes) -> list[tuple[str, str, str]]:
    """(kernel, x_dtype, weight_dtype) of every kernel, weights in x's dtype (the AOT matrix)."""
    kernels = ("rms_norm_fwd", "rms_norm_fwd_residual", "rms_norm_bwd", "rms_norm_bwd_dh")
    return [(k, d, d) for d in dtypes for k in kernels] + [("rms_norm_colsum", d, d) for d in dtypes]


target = tilelang_target
lower, build, function = tilelang_entry_points(prim_func)
COLUMN_SUM_KERNEL = "rms_norm_colsum"  # the backward's second launch
