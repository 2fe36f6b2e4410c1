// RMSNorm, SwiGLU and RoPE, forward and backward, each in one pass over its data with float32 arithmetic, for one
// instruction set.
#include "titan/kernels/isa/kernels.h"
#include "titan/kernels/isa/scalar_math.h"

namespace titan::kernels::isa::TITAN_ISA {
namespace {

template <typename T>
void rms_norm_forward_impl(const RowsShape& s, const T* x, const T* weight, float eps, T* y, float* inv_rms,
                           int64_t begin, int64_t end) {
  const int64_t n = s.dim;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) part[l] += to_float(xr[i + l]) * to_float(xr[i + l]);
    float sum = sum_lanes(part);
    for (; i < n; ++i) sum += to_float(xr[i]) * to_float(xr[i]);
    const float inv = 1.0f / __builtin_sqrtf(sum / static_cast<float>(n) + eps);
    inv_rms[r] = inv;
    T* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) store(yr + i, to_float(xr[i]) * inv * to_float(weight[i]));
  }
}

template <typename T>
void rms_norm_backward_impl(const RowsShape& s, const T* x, const T* weight, const float* inv_rms, const T* grad_y,
                            T* grad_x, float* grad_weight_partial, int64_t begin, int64_t end) {
  const int64_t n = s.dim;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    const T* gr = grad_y + r * n;
    const float inv = inv_rms[r];
    // With x^ = x inv: dx = inv (g w - x^ mean(g w x^)), dw = sum over rows of g x^.
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) {
        const float xhat = to_float(xr[i + l]) * inv, g = to_float(gr[i + l]);
        part[l] += g * to_float(weight[i + l]) * xhat;
      }
    float dot = sum_lanes(part);
    for (; i < n; ++i) dot += to_float(gr[i]) * to_float(weight[i]) * to_float(xr[i]) * inv;
    for (i = 0; i < n; ++i) grad_weight_partial[i] += to_float(gr[i]) * to_float(xr[i]) * inv;
    const float mean = dot / static_cast<float>(n);
    T* dx = grad_x + r * n;
    for (i = 0; i < n; ++i) {
      const float xhat = to_float(xr[i]) * inv;
      store(dx + i, inv * (to_float(gr[i]) * to_float(weight[i]) - xhat * mean));
    }
  }
}

template <typename T>
void swiglu_forward_impl(const T* gate, const T* up, T* out, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + kVec <= end; i += kVec) {  // the same arithmetic as below, 16 values at once
    const Vec16 g = load16(gate + i);
    store16(out + i, g * (1.0f / (1.0f + exp16(-g))) * load16(up + i));
  }
  for (; i < end; ++i) {
    const float g = to_float(gate[i]);
    store(out + i, g * sigmoid(g) * to_float(up[i]));
  }
}

template <typename T>
void swiglu_backward_impl(const T* gate, const T* up, const T* grad_out, T* grad_gate, T* grad_up, int64_t begin,
                          int64_t end) {
  int64_t i = begin;
  for (; i + kVec <= end; i += kVec) {
    const Vec16 g = load16(gate + i), u = load16(up + i), d = load16(grad_out + i);
    const Vec16 sig = 1.0f / (1.0f + exp16(-g));
    const Vec16 silu = g * sig;
    store16(grad_up + i, d * silu);
    store16(grad_gate + i, d * u * (sig + silu * (1.0f - sig)));
  }
  for (; i < end; ++i) {
    const float g = to_float(gate[i]), u = to_float(up[i]), d = to_float(grad_out[i]);
    const float sig = sigmoid(g);
    const float silu = g * sig;
    store(grad_up + i, d * silu);
    store(grad_gate + i, d * u * (sig + silu * (1.0f - sig)));
  }
}

template <typename T>
void rope_impl(const RopeShape& s, const float* table, const int64_t* position_of_row, const T* in, T* out,
               int64_t begin, int64_t end) {
  const int64_t half = s.head_dim / 2;
  const float sign = s.inverse ? -1.0f : 1.0f;
  // 8 pairs at once: y = x * (c0, c0, c1, c1, ...) + (x1, x0, x3, x2, ...) * (-s0, s0, -s1, s1, ...) (signs flipped
  // for the inverse).
  const Vec16 signs = splat(sign) * Vec16{-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1};
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / (s.seq * s.heads), t = (item / s.heads) % s.seq, h = item % s.heads;
    const int64_t p = position_of_row ? position_of_row[b * s.seq + t] : t;
    const float* angles = table + p * half * 2;
    const T* x = in + b * s.in_stride[0] + t * s.in_stride[1] + h * s.in_stride[2];
    T* y = out + b * s.out_stride[0] + t * s.out_stride[1] + h * s.out_stride[2];
    int64_t i = 0;
    for (; 2 * i + kVec <= s.head_dim; i += kVec / 2) {
      const Vec16 v = load16(x + 2 * i), a = load16(angles + 2 * i);
      store16(y + 2 * i, v * even_lanes_twice(a) + swap_pairs(v) * odd_lanes_twice(a) * signs);
    }
    for (; i < half; ++i) {
      const float x0 = to_float(x[2 * i]), x1 = to_float(x[2 * i + 1]);
      const float c = angles[2 * i], si = sign * angles[2 * i + 1];
      store(y + 2 * i, x0 * c - x1 * si);
      store(y + 2 * i + 1, x0 * si + x1 * c);
    }
  }
}

}  // namespace

void rms_norm_forward(const RowsShape& s, const float* x, const float* weight, float eps, float* y, float* inv_rms,
                      int64_t begin, int64_t end) {
  rms_norm_forward_impl(s, x, weight, eps, y, inv_rms, begin, end);
}
void rms_norm_forward(const RowsShape& s, const uint16_t* x, const uint16_t* weight, float eps, uint16_t* y,
                      float* inv_rms, int64_t begin, int64_t end) {
  rms_norm_forward_impl(s, x, weight, eps, y, inv_rms, begin, end);
}
void rms_norm_backward(const RowsShape& s, const float* x, const float* weight, const float* inv_rms,
                       const float* grad_y, float* grad_x, float* grad_weight_partial, int64_t begin, int64_t end) {
  rms_norm_backward_impl(s, x, weight, inv_rms, grad_y, grad_x, grad_weight_partial, begin, end);
}
void rms_norm_backward(const RowsShape& s, const uint16_t* x, const uint16_t* weight, const float* inv_rms,
                       const uint16_t* grad_y, uint16_t* grad_x, float* grad_weight_partial, int64_t begin,
                       int64_t end) {
  rms_norm_backward_impl(s, x, weight, inv_rms, grad_y, grad_x, grad_weight_partial, begin, end);
}
void swiglu_forward(const float* gate, const float* up, float* out, int64_t begin, int64_t end) {
  swiglu_forward_impl(gate, up, out, begin, end);
}
void swiglu_forward(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t begin, int64_t end) {
  swiglu_forward_impl(gate, up, out, begin, end);
}
void swiglu_backward(const float* gate, const float* up, const float* grad_out, float* grad_gate, float* grad_up,
                     int64_t begin, int64_t end) {
  swiglu_backward_impl(gate, up, grad_out, grad_gate, grad_up, begin, end);
}
void swiglu_backward(const uint16_t* gate, const uint16_t* up, const uint16_t* grad_out, uint16_t* grad_gate,
                     uint16_t* grad_up, int64_t begin, int64_t end) {
  swiglu_backward_impl(gate, up, grad_out, grad_gate, grad_up, begin, end);
}
void rope(const RopeShape& s, const float* table, const int64_t* position_of_row, const float* in, float* out,
          int64_t begin, int64_t end) {
  rope_impl(s, table, position_of_row, in, out, begin, end);
}
void rope(const RopeShape& s, const float* table, const int64_t* position_of_row, const uint16_t* in, uint16_t* out,
          int64_t begin, int64_t end) {
  rope_impl(s, table, position_of_row, in, out, begin, end);
}

}  // namespace titan::kernels::isa::TITAN_ISA
