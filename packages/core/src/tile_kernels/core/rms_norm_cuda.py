"""rms_norm's CUDA C++ kernels (backend="cuda"): the math of norms.py (is_rms=True), compiled at run time by nvcc.

The same two-pass scheme as the TileLang kernels (rms_norm_tilelang.py), written by hand: forward, one block per row
(grid (rows, batch)), pass 1 forms h (= x + residual, rounded to x's dtype and stored) and sum(h^2), a warp-shuffle
block reduction gives rstd, pass 2 re-reads h and writes y; backward, a persistent grid of P blocks per problem, each
taking rows p, p + P, ... and accumulating dy * xhat into its own fp32 row of dweight_partial, then a column sum.
A thread always touches columns t, t + blockDim, ... of a row, so it reads back only its own stores.

Build: TVM-FFI's `load_inline` (nvcc and ninja; cached on disk by source hash), one module per (x dtype, weight dtype)
and architecture, exporting four functions in the TVM-FFI convention (inputs, outputs, then eps), which run on the
caller's stream (TVMFFIEnvGetStream: torch's current stream, or the XLA stream under JAX).
Design limits: buffers compact (the adapters pass contiguous rows); batch <= 65535 (grid y); any width; int64 offsets.
"""

from __future__ import annotations

import functools
import os
import threading

from .backends import find_cuda_home

_CXX_TYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
_DL_TYPE = {"float32": ("kDLFloat", 32), "float16": ("kDLFloat", 16), "bfloat16": ("kDLBfloat", 16)}
FUNCTIONS = ("rms_norm_fwd", "rms_norm_fwd_residual", "rms_norm_bwd", "rms_norm_bwd_dh")
_LOCK = threading.Lock()

SOURCE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

using tvm::ffi::TensorView;
using TX = TK_X;  // x, residual, y, h, dy, dh, dx
using TW = TK_W;  // weight, dweight

namespace {

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024): every thread gets the same total.
__device__ float block_sum(float v, float* smem) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // a previous call's readers are done with smem
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? smem[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Grid (rows, batch). y, h: (batch, rows, n); rstd: (batch, rows); weight row min(b, wb - 1).
template <bool RESIDUAL>
__global__ void fwd_kernel(const TX* x, const TX* r, const TW* w, TX* y, TX* h, float* rstd, int64_t rows,
                           int64_t n, int64_t wb, float eps) {
  __shared__ float smem[32];
  const int64_t b = blockIdx.y, row = b * rows + blockIdx.x, off = row * n;
  const TX* src = RESIDUAL ? h + off : x + off;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    float v = load(x + off + c);
    if (RESIDUAL) {  // h rounded to x's dtype, as returned
      TX hv;
      store(&hv, v + load(r + off + c));
      h[off + c] = hv;
      v = load(&hv);
    }
    ss += v * v;
  }
  const float rs = rsqrtf(block_sum(ss, smem) / static_cast<float>(n) + eps);
  const TW* wr = w + (b < wb ? b : wb - 1) * n;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) store(y + off + c, load(src + c) * rs * load(wr + c));
  if (threadIdx.x == 0) rstd[row] = rs;
}

// Grid (P, batch): block p takes rows p, p + P, ... and owns dwp[b, p, :] (written on its first row).
template <bool DH>
__global__ void bwd_kernel(const TX* dy, const TX* h, const TW* w, const float* rstd, const TX* dh, TX* dx,
                           float* dwp, int64_t rows, int64_t n, int64_t wb) {
  __shared__ float smem[32];
  const int64_t b = blockIdx.y, p = blockIdx.x, programs = gridDim.x;
  const TW* wr = w + (b < wb ? b : wb - 1) * n;
  float* part = dwp + (b * programs + p) * n;
  for (int64_t m = p; m < rows; m += programs) {
    const int64_t row = b * rows + m, off = row * n;
    const float rs = rstd[row];
    float acc = 0.f;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x)
      acc += load(dy + off + c) * load(wr + c) * (load(h + off + c) * rs);
    const float mean_gx = block_sum(acc, smem) / static_cast<float>(n);
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float g = load(dy + off + c), xhat = load(h + off + c) * rs;
      float d = (g * load(wr + c) - xhat * mean_gx) * rs;
      if (DH) d += load(dh + off + c);
      store(dx + off + c, d);
      part[c] = (m == p ? 0.f : part[c]) + g * xhat;
    }
  }
}

// dw[b, c] = sum over p of dwp[b, p, c]; grid (cdiv(n, 256), batch).
__global__ void colsum_kernel(const float* dwp, TW* dw, int64_t programs, int64_t n) {
  const int64_t b = blockIdx.y, c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  float s = 0.f;
  for (int64_t p = 0; p < programs; ++p) s += dwp[(b * programs + p) * n + c];
  store(dw + b * n + c, s);
}

template <typename T>
const T* in(const TensorView& t, DLDataType dtype, const char* name) {
  TVM_FFI_ICHECK(t.dtype() == dtype) << "rms_norm (cuda backend): " << name << " has the wrong dtype";
  TVM_FFI_ICHECK(t.IsContiguous()) << "rms_norm (cuda backend): " << name << " must be contiguous";
  TVM_FFI_ICHECK(t.device().device_type == kDLCUDA) << "rms_norm (cuda backend): " << name << " must be on CUDA";
  return reinterpret_cast<const T*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}
template <typename T>
T* out(const TensorView& t, DLDataType dtype, const char* name) {
  return const_cast<T*>(in<T>(t, dtype, name));
}

constexpr DLDataType kX{TK_X_CODE, TK_X_BITS, 1}, kW{TK_W_CODE, TK_W_BITS, 1}, kF32{kDLFloat, 32, 1};

int threads_for(int64_t n) {  // at least 4 elements per thread before adding threads; 32..1024
  int t = 32;
  while (t < 1024 && 4 * static_cast<int64_t>(t) < n) t *= 2;
  return t;
}

struct Launch {  // on the tensor's device and the caller's stream (torch's current one, or XLA's)
  int previous = 0, device = 0;
  cudaStream_t stream;
  explicit Launch(const TensorView& t) : device(t.device().device_id) {
    cudaGetDevice(&previous);
    if (previous != device) cudaSetDevice(device);
    stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  }
  ~Launch() {
    if (previous != device) cudaSetDevice(previous);
  }
  void check(const char* what) const {
    const cudaError_t e = cudaGetLastError();
    TVM_FFI_ICHECK(e == cudaSuccess) << "rms_norm (cuda backend): " << what << ": " << cudaGetErrorString(e);
  }
};

template <bool RESIDUAL>
void forward(TensorView x, TensorView r, TensorView w, TensorView y, TensorView h, TensorView rstd, double eps) {
  TVM_FFI_ICHECK(x.ndim() == 3 && w.ndim() == 2) << "rms_norm (cuda backend): x (B, M, N), weight (WB, N)";
  const int64_t batch = x.size(0), rows = x.size(1), n = x.size(2);
  TVM_FFI_ICHECK(batch <= 65535 && rows < (int64_t{1} << 31))
      << "rms_norm (cuda backend): at most 65535 problems of 2^31 - 1 rows, got " << batch << " of " << rows;
  if (batch * rows * n == 0) return;
  Launch launch(x);
  fwd_kernel<RESIDUAL><<<dim3(rows, batch), threads_for(n), 0, launch.stream>>>(
      in<TX>(x, kX, "x"), RESIDUAL ? in<TX>(r, kX, "residual") : nullptr, in<TW>(w, kW, "weight"),
      out<TX>(y, kX, "y"), RESIDUAL ? out<TX>(h, kX, "h") : nullptr, out<float>(rstd, kF32, "rstd"), rows, n,
      w.size(0), static_cast<float>(eps));
  launch.check("forward launch");
}

template <bool DH>
void backward(TensorView dy, TensorView h, TensorView w, TensorView rstd, TensorView dh, TensorView dx,
              TensorView dw, TensorView dwp) {
  TVM_FFI_ICHECK(h.ndim() == 3 && dwp.ndim() == 3) << "rms_norm (cuda backend): h (B, M, N), partial (B, P, N)";
  const int64_t batch = h.size(0), rows = h.size(1), n = h.size(2), programs = dwp.size(1);
  TVM_FFI_ICHECK(batch <= 65535) << "rms_norm (cuda backend): at most 65535 problems, got " << batch;
  if (batch * rows * n == 0) return;
  Launch launch(h);
  bwd_kernel<DH><<<dim3(programs, batch), threads_for(n), 0, launch.stream>>>(
      in<TX>(dy, kX, "dy"), in<TX>(h, kX, "h"), in<TW>(w, kW, "weight"), in<float>(rstd, kF32, "rstd"),
      DH ? in<TX>(dh, kX, "dh") : nullptr, out<TX>(dx, kX, "dx"), out<float>(dwp, kF32, "dweight_partial"), rows,
      n, w.size(0));
  launch.check("backward launch");
  colsum_kernel<<<dim3((n + 255) / 256, batch), 256, 0, launch.stream>>>(
      in<float>(dwp, kF32, "dweight_partial"), out<TW>(dw, kW, "dweight"), programs, n);
  launch.check("dweight column-sum launch");
}

}  // namespace

void rms_norm_fwd(TensorView x, TensorView w, TensorView y, TensorView rstd, double eps) {
  forward<false>(x, x, w, y, y, rstd, eps);
}
void rms_norm_fwd_residual(TensorView x, TensorView r, TensorView w, TensorView y, TensorView h, TensorView rstd,
                           double eps) {
  forward<true>(x, r, w, y, h, rstd, eps);
}
void rms_norm_bwd(TensorView dy, TensorView h, TensorView w, TensorView rstd, TensorView dx, TensorView dw,
                  TensorView dwp) {
  backward<false>(dy, h, w, rstd, dy, dx, dw, dwp);
}
void rms_norm_bwd_dh(TensorView dy, TensorView h, TensorView w, TensorView rstd, TensorView dh, TensorView dx,
                     TensorView dw, TensorView dwp) {
  backward<true>(dy, h, w, rstd, dh, dx, dw, dwp);
}
"""


def build(x_dtype: str, w_dtype: str, arch: int, build_directory: str | None = None):
    """Compiles (or loads from TVM-FFI's cache) the module for one dtype pair and compute capability `arch` (90 for
    9.0); returns the loaded TVM-FFI module. Needs nvcc and ninja; no GPU."""
    import tvm_ffi.cpp

    flags = [f"-DTK_ARCH={arch}"]  # the architecture is part of the cache key
    for name, dtype in (("X", x_dtype), ("W", w_dtype)):
        code, bits = _DL_TYPE[dtype]
        flags += [f"-DTK_{name}={_CXX_TYPE[dtype]}", f"-DTK_{name}_CODE={code}", f"-DTK_{name}_BITS={bits}"]
    # TVM-FFI reads the architecture and the toolkit from the environment
    env = {"TVM_FFI_CUDA_ARCH_LIST": f"{arch // 10}.{arch % 10}", "CUDA_HOME": find_cuda_home()}
    with _LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({k: v for k, v in env.items() if v and (k != "CUDA_HOME" or not saved[k])})
        try:
            return tvm_ffi.cpp.load_inline(
                f"tile_kernels_rms_norm_{x_dtype}_{w_dtype}_sm{arch}", cuda_sources=SOURCE, functions=FUNCTIONS,
                extra_cuda_cflags=flags, build_directory=build_directory, backend="cuda",
            )  # fmt: skip
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


COLUMN_SUM_KERNEL = None  # the backward functions launch their column sum themselves


@functools.cache
def function(name: str, x_dtype: str, w_dtype: str, arch: int):
    """One exported function of the module (FUNCTIONS), built on first use."""
    return getattr(build(x_dtype, w_dtype, arch), name)
