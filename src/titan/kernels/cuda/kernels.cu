// CUDA kernels for titan's fused SwiGLU, RoPE, cross-entropy rows and float8 casts (declared, with their contracts, in
// kernels.h). Elementwise work runs as grid-stride loops over 64-bit indices; each cross-entropy row is reduced by
// one block (an online maximum and sum of exponentials per thread, combined across warps).
#include "titan/kernels/cuda/kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace titan::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest

__device__ inline float load(const float* p) { return *p; }
__device__ inline float load(const uint16_t* p) { return __bfloat162float(__ushort_as_bfloat16(*p)); }
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(uint16_t* p, float v) { *p = __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

int blocks_for(int64_t n) { return static_cast<int>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = load(gate + i);
    store(out + i, g * sigmoid(g) * load(up + i));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* gate, const T* up, const T* grad_out, T* grad_gate, T* grad_up,
                                       int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = load(gate + i), u = load(up + i), d = load(grad_out + i);
    const float sig = sigmoid(g);
    const float silu = g * sig;
    store(grad_up + i, d * silu);
    store(grad_gate + i, d * u * (sig + silu * (1.0f - sig)));
  }
}

// One thread per (batch, seq, head, pair): the pair (x[2i], x[2i+1]) rotated by the table's (cos, sin) for its
// position (by the negative angle when inverse). The output is written with s.out_stride like the input is read.
template <typename T>
__global__ void rope_kernel(isa::RopeShape s, int64_t table_rows, const float* table, const int64_t* position_of_row,
                            const T* in, T* out, int64_t pairs) {
  const int64_t half = s.head_dim / 2;
  const float sign = s.inverse ? -1.0f : 1.0f;
  for (int64_t item = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; item < pairs;
       item += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = item % half;
    const int64_t row = item / half;  // (batch, seq, head) row
    const int64_t h = row % s.heads, t = (row / s.heads) % s.seq, b = row / (s.heads * s.seq);
    int64_t p = position_of_row ? position_of_row[b * s.seq + t] : t;
    p = p < 0 ? 0 : (p >= table_rows ? table_rows - 1 : p);
    const float c = table[(p * half + i) * 2], si = sign * table[(p * half + i) * 2 + 1];
    const T* x = in + b * s.in_stride[0] + t * s.in_stride[1] + h * s.in_stride[2] + 2 * i;
    T* y = out + b * s.out_stride[0] + t * s.out_stride[1] + h * s.out_stride[2] + 2 * i;
    const float x0 = load(x), x1 = load(x + 1);
    store(y, x0 * c - x1 * si);
    store(y + 1, x0 * si + x1 * c);
  }
}

// A running (maximum, sum of exp(x - maximum)) pair; -inf values add nothing.
struct MaxSum {
  float max, sum;
};

__device__ inline MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

template <typename T>
__global__ void cross_entropy_stats_kernel(int64_t rows, int64_t vocab, const T* logits, const int64_t* local_label,
                                           float* row_max, float* row_sum_exp, float* row_target) {
  __shared__ MaxSum warp_results[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* x = logits + r * vocab;
    MaxSum mine{-INFINITY, 0.0f};
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float v = load(x + i);
      if (v == -INFINITY) continue;
      if (v > mine.max) {
        mine.sum = mine.sum * expf(mine.max - v) + 1.0f;
        mine.max = v;
      } else {
        mine.sum += expf(v - mine.max);
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, mine.max, offset), __shfl_xor_sync(0xffffffffu, mine.sum, offset)};
      mine = combine(mine, other);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_results[warp] = mine;
    __syncthreads();
    if (warp == 0) {
      mine = lane < static_cast<int>(blockDim.x / 32) ? warp_results[lane] : MaxSum{-INFINITY, 0.0f};
      for (int offset = 16; offset > 0; offset /= 2) {
        const MaxSum other{__shfl_xor_sync(0xffffffffu, mine.max, offset),
                           __shfl_xor_sync(0xffffffffu, mine.sum, offset)};
        mine = combine(mine, other);
      }
      if (lane == 0) {
        // A row of -inf sums to 0 with its maximum kept finite, as on the CPU.
        row_max[r] = mine.max == -INFINITY ? 0.0f : mine.max;
        row_sum_exp[r] = mine.max == -INFINITY ? 0.0f : mine.sum;
        const int64_t label = local_label[r];
        row_target[r] = label >= 0 ? load(x + label) : 0.0f;
      }
    }
    __syncthreads();  // warp_results is reused by the next row
  }
}

template <typename T>
__global__ void cross_entropy_grad_kernel(int64_t rows, int64_t vocab, T* logits, const int64_t* local_label,
                                          const float* row_lse, const float* row_scale) {
  const int64_t n = rows * vocab;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / vocab, column = i - r * vocab;
    const float one_hot = column == local_label[r] ? 1.0f : 0.0f;
    store(logits + i, (expf(load(logits + i) - row_lse[r]) - one_hot) * row_scale[r]);
  }
}

// SwiGLU over whole 16-byte vectors (8 bf16 or 4 float32 values per load), the same arithmetic per value as the
// kernels above, which take the rest.
template <typename T>
union Vector16 {
  uint4 raw;
  T value[16 / sizeof(T)];
};

template <typename T>
__global__ void swiglu_forward_vector_kernel(const T* gate, const T* up, T* out, int64_t vectors) {
  constexpr int kVec = 16 / sizeof(T);
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < vectors; v += int64_t{gridDim.x} * blockDim.x) {
    Vector16<T> g, u, o;
    g.raw = reinterpret_cast<const uint4*>(gate)[v];
    u.raw = reinterpret_cast<const uint4*>(up)[v];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = load(g.value + j);
      store(o.value + j, x * sigmoid(x) * load(u.value + j));
    }
    reinterpret_cast<uint4*>(out)[v] = o.raw;
  }
}

template <typename T>
__global__ void swiglu_backward_vector_kernel(const T* gate, const T* up, const T* grad_out, T* grad_gate, T* grad_up,
                                              int64_t vectors) {
  constexpr int kVec = 16 / sizeof(T);
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < vectors; v += int64_t{gridDim.x} * blockDim.x) {
    Vector16<T> g, u, d, dg, du;
    g.raw = reinterpret_cast<const uint4*>(gate)[v];
    u.raw = reinterpret_cast<const uint4*>(up)[v];
    d.raw = reinterpret_cast<const uint4*>(grad_out)[v];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = load(g.value + j), y = load(u.value + j), dy = load(d.value + j);
      const float sig = sigmoid(x);
      const float silu = x * sig;
      store(du.value + j, dy * silu);
      store(dg.value + j, dy * y * (sig + silu * (1.0f - sig)));
    }
    reinterpret_cast<uint4*>(grad_gate)[v] = dg.raw;
    reinterpret_cast<uint4*>(grad_up)[v] = du.raw;
  }
}

bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <typename T>
cudaError_t swiglu_forward_impl(const T* gate, const T* up, T* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int64_t kVec = 16 / sizeof(T);
  int64_t done = 0;
  if (n >= kVec && aligned16({gate, up, out})) {
    swiglu_forward_vector_kernel<<<blocks_for(n / kVec), kThreads, 0, stream>>>(gate, up, out, n / kVec);
    done = n / kVec * kVec;
  }
  if (done < n) swiglu_forward_kernel<<<blocks_for(n - done), kThreads, 0, stream>>>(gate + done, up + done, out + done, n - done);
  return cudaGetLastError();
}

template <typename T>
cudaError_t swiglu_backward_impl(const T* gate, const T* up, const T* grad_out, T* grad_gate, T* grad_up, int64_t n,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int64_t kVec = 16 / sizeof(T);
  int64_t done = 0;
  if (n >= kVec && aligned16({gate, up, grad_out, grad_gate, grad_up})) {
    swiglu_backward_vector_kernel<<<blocks_for(n / kVec), kThreads, 0, stream>>>(gate, up, grad_out, grad_gate, grad_up, n / kVec);
    done = n / kVec * kVec;
  }
  if (done < n)
    swiglu_backward_kernel<<<blocks_for(n - done), kThreads, 0, stream>>>(gate + done, up + done, grad_out + done,
                                                                          grad_gate + done, grad_up + done, n - done);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_impl(const isa::RopeShape& s, int64_t table_rows, const float* table, const int64_t* position_of_row,
                      const T* in, T* out, cudaStream_t stream) {
  const int64_t pairs = s.batch * s.seq * s.heads * (s.head_dim / 2);
  if (pairs == 0) return cudaSuccess;
  if (table_rows <= 0) return cudaErrorInvalidValue;
  rope_kernel<<<blocks_for(pairs), kThreads, 0, stream>>>(s, table_rows, table, position_of_row, in, out, pairs);
  return cudaGetLastError();
}

template <typename T>
cudaError_t stats_impl(int64_t rows, int64_t vocab, const T* logits, const int64_t* local_label, float* row_max,
                       float* row_sum_exp, float* row_target, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min(rows, kMaxBlocks));
  cross_entropy_stats_kernel<<<blocks, kThreads, 0, stream>>>(rows, vocab, logits, local_label, row_max, row_sum_exp,
                                                               row_target);
  return cudaGetLastError();
}

template <typename T>
cudaError_t grad_impl(int64_t rows, int64_t vocab, T* logits, const int64_t* local_label, const float* row_lse,
                      const float* row_scale, cudaStream_t stream) {
  if (rows * vocab == 0) return cudaSuccess;
  cross_entropy_grad_kernel<<<blocks_for(rows * vocab), kThreads, 0, stream>>>(rows, vocab, logits, local_label,
                                                                               row_lse, row_scale);
  return cudaGetLastError();
}

// Float8: the nearest value, ties to even, saturated at the largest finite one (as clamping first and then
// converting does); NaN stays NaN.
__device__ inline uint8_t to_float8(float v, bool e4m3) {
  return e4m3 ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
}

template <typename T>
__global__ void float8_cast_kernel(Float8Cast c, const T* in, const float* scale, uint8_t* out) {
  const int64_t n = c.rows * c.cols;
  const bool one_scale = c.scale_row_stride == 0 && c.scale_col_stride == 0;
  const float whole = one_scale ? *scale : 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float s = whole;
    if (!one_scale) {
      const int64_t r = i / c.cols, col = i - r * c.cols;
      s = scale[r * c.scale_row_stride + col * c.scale_col_stride];
    }
    out[i] = to_float8(load(in + i) * s, c.e4m3);
  }
}

// One scale, whole 16-byte vectors: 8 bf16 or 4 float32 values per load, their float8 bytes stored together.
template <typename T>
__global__ void float8_cast_vector_kernel(const T* in, const float* scale, bool e4m3, uint8_t* out, int64_t vectors) {
  constexpr int kVec = 16 / sizeof(T);
  using Bytes = typename std::conditional<kVec == 8, uint2, uint32_t>::type;
  const float s = *scale;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < vectors; v += int64_t{gridDim.x} * blockDim.x) {
    Vector16<T> x;
    x.raw = reinterpret_cast<const uint4*>(in)[v];
    union {
      Bytes packed;
      uint8_t byte[kVec];
    } result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) result.byte[j] = to_float8(load(x.value + j) * s, e4m3);
    reinterpret_cast<Bytes*>(out)[v] = result.packed;
  }
}

// One block per 32 x 32 tile (looping over the tile rows past the grid's y limit): read along the input's rows,
// written along the output's, through shared memory.
constexpr int kTile = 32;
template <typename T>
__global__ void float8_cast_transpose_kernel(Float8Cast c, const T* in, const float* scale, uint8_t* out) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const int64_t tiles_r = (c.rows + kTile - 1) / kTile, c0 = int64_t{blockIdx.x} * kTile;
  for (int64_t tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
    const int64_t r0 = tr * kTile;
    for (int j = threadIdx.y; j < kTile; j += blockDim.y) {
      const int64_t r = r0 + j, col = c0 + threadIdx.x;
      if (r < c.rows && col < c.cols)
        tile[j][threadIdx.x] = to_float8(load(in + r * c.cols + col) * scale[r * c.scale_row_stride + col * c.scale_col_stride], c.e4m3);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += blockDim.y) {
      const int64_t out_row = c0 + j, out_col = r0 + threadIdx.x;  // the input's column and row
      if (out_row < c.cols && out_col < c.rows) out[out_row * c.rows + out_col] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}

template <typename T>
cudaError_t float8_cast_impl(const Float8Cast& c, const T* in, const float* scale, uint8_t* out, cudaStream_t stream) {
  if (c.rows == 0 || c.cols == 0) return cudaSuccess;
  if (!c.transpose) {
    constexpr int64_t kVec = 16 / sizeof(T);
    const int64_t n = c.rows * c.cols;
    const bool one_scale = c.scale_row_stride == 0 && c.scale_col_stride == 0;
    int64_t done = 0;
    if (one_scale && n >= kVec && aligned16({in, out})) {
      const int64_t vectors = n / kVec;
      float8_cast_vector_kernel<<<blocks_for(vectors), kThreads, 0, stream>>>(in, scale, c.e4m3, out, vectors);
      done = vectors * kVec;
    }
    if (done < n) {
      // The rest (or all, with a per-row or per-column scale) one value per thread; with one scale the rest is a
      // single row of what is left.
      Float8Cast rest = c;
      if (done > 0) {
        rest.rows = 1;
        rest.cols = n - done;
      }
      float8_cast_kernel<<<blocks_for(n - done), kThreads, 0, stream>>>(rest, in + done, scale, out + done);
    }
  } else {
    const int64_t tiles_r = (c.rows + kTile - 1) / kTile, tiles_c = (c.cols + kTile - 1) / kTile;
    const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(std::min<int64_t>(tiles_r, 65535)));
    float8_cast_transpose_kernel<<<grid, dim3(kTile, 8), 0, stream>>>(c, in, scale, out);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t swiglu_forward(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  return swiglu_forward_impl(gate, up, out, n, stream);
}
cudaError_t swiglu_forward(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n, cudaStream_t stream) {
  return swiglu_forward_impl(gate, up, out, n, stream);
}
cudaError_t swiglu_backward(const float* gate, const float* up, const float* grad_out, float* grad_gate, float* grad_up,
                            int64_t n, cudaStream_t stream) {
  return swiglu_backward_impl(gate, up, grad_out, grad_gate, grad_up, n, stream);
}
cudaError_t swiglu_backward(const uint16_t* gate, const uint16_t* up, const uint16_t* grad_out, uint16_t* grad_gate,
                            uint16_t* grad_up, int64_t n, cudaStream_t stream) {
  return swiglu_backward_impl(gate, up, grad_out, grad_gate, grad_up, n, stream);
}
cudaError_t rope(const isa::RopeShape& s, int64_t table_rows, const float* table, const int64_t* position_of_row,
                 const float* in, float* out, cudaStream_t stream) {
  return rope_impl(s, table_rows, table, position_of_row, in, out, stream);
}
cudaError_t rope(const isa::RopeShape& s, int64_t table_rows, const float* table, const int64_t* position_of_row,
                 const uint16_t* in, uint16_t* out, cudaStream_t stream) {
  return rope_impl(s, table_rows, table, position_of_row, in, out, stream);
}
cudaError_t cross_entropy_stats(int64_t rows, int64_t vocab, const float* logits, const int64_t* local_label,
                                float* row_max, float* row_sum_exp, float* row_target, cudaStream_t stream) {
  return stats_impl(rows, vocab, logits, local_label, row_max, row_sum_exp, row_target, stream);
}
cudaError_t cross_entropy_stats(int64_t rows, int64_t vocab, const uint16_t* logits, const int64_t* local_label,
                                float* row_max, float* row_sum_exp, float* row_target, cudaStream_t stream) {
  return stats_impl(rows, vocab, logits, local_label, row_max, row_sum_exp, row_target, stream);
}
cudaError_t cross_entropy_grad(int64_t rows, int64_t vocab, float* logits, const int64_t* local_label,
                               const float* row_lse, const float* row_scale, cudaStream_t stream) {
  return grad_impl(rows, vocab, logits, local_label, row_lse, row_scale, stream);
}
cudaError_t cross_entropy_grad(int64_t rows, int64_t vocab, uint16_t* logits, const int64_t* local_label,
                               const float* row_lse, const float* row_scale, cudaStream_t stream) {
  return grad_impl(rows, vocab, logits, local_label, row_lse, row_scale, stream);
}

cudaError_t scaled_cast_float8(const Float8Cast& c, const float* in, const float* scale, uint8_t* out, cudaStream_t stream) {
  return float8_cast_impl(c, in, scale, out, stream);
}
cudaError_t scaled_cast_float8(const Float8Cast& c, const uint16_t* in, const float* scale, uint8_t* out, cudaStream_t stream) {
  return float8_cast_impl(c, in, scale, out, stream);
}

}  // namespace titan::kernels::cuda
