// The raw CUDA kernels behind titan's fused SwiGLU, RoPE and cross-entropy rows and its float8 casts on NVIDIA
// GPUs, where LibTorch has no fused operation of its own (RMSNorm uses LibTorch's fused CUDA kernel, attention its
// flash/cuDNN kernels). Like the CPU kernels (kernels/isa) they see plain pointers, sizes and strides, no LibTorch
// types, so that nvcc compiles them without LibTorch's headers. bf16 values travel as uint16_t bit patterns;
// arithmetic is float32 and each result is rounded once. Every launcher returns the launch's error (cudaSuccess
// when it was queued) and runs on `stream`, on the current device.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "titan/kernels/isa/kernels.h"

namespace titan::kernels::cuda {

// out = silu(gate) * up over n contiguous elements; the backward also takes the output's gradient.
cudaError_t swiglu_forward(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);
cudaError_t swiglu_forward(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n, cudaStream_t stream);
cudaError_t swiglu_backward(const float* gate, const float* up, const float* grad_out, float* grad_gate, float* grad_up,
                            int64_t n, cudaStream_t stream);
cudaError_t swiglu_backward(const uint16_t* gate, const uint16_t* up, const uint16_t* grad_out, uint16_t* grad_gate,
                            uint16_t* grad_up, int64_t n, cudaStream_t stream);

// RoPE as isa::rope (the same shape and table layout; the table and positions in device memory). A position
// outside the table's `table_rows` rows is clamped to it (titan's positions are sequence indices, always inside).
cudaError_t rope(const isa::RopeShape& s, int64_t table_rows, const float* table, const int64_t* position_of_row,
                 const float* in, float* out, cudaStream_t stream);
cudaError_t rope(const isa::RopeShape& s, int64_t table_rows, const float* table, const int64_t* position_of_row,
                 const uint16_t* in, uint16_t* out, cudaStream_t stream);

// The cross-entropy row passes of isa::cross_entropy_stats / cross_entropy_grad over all `rows` rows.
cudaError_t cross_entropy_stats(int64_t rows, int64_t vocab, const float* logits, const int64_t* local_label,
                                float* row_max, float* row_sum_exp, float* row_target, cudaStream_t stream);
cudaError_t cross_entropy_stats(int64_t rows, int64_t vocab, const uint16_t* logits, const int64_t* local_label,
                                float* row_max, float* row_sum_exp, float* row_target, cudaStream_t stream);
cudaError_t cross_entropy_grad(int64_t rows, int64_t vocab, float* logits, const int64_t* local_label,
                               const float* row_lse, const float* row_scale, cudaStream_t stream);
cudaError_t cross_entropy_grad(int64_t rows, int64_t vocab, uint16_t* logits, const int64_t* local_label,
                               const float* row_lse, const float* row_scale, cudaStream_t stream);

// Float8 casts for the float8 linears: out = the float8 value nearest float(in) * scale (ties to even), saturated at
// the format's largest finite value (NaN stays NaN), in E4M3 ("fn", e4m3 = true) or E5M2 bit patterns. The input is
// rows x cols row-major; the scale is read at scale[r * scale_row_stride + c * scale_col_stride] (0 and 0 for one
// scale per tensor, 1 and 0 per row, 0 and 1 per column). Without `transpose` out is rows x cols row-major; with it,
// cols x rows row-major (the cast of the input's transpose, staged through shared-memory tiles so that both the
// reads and the writes are coalesced).
struct Float8Cast {
  int64_t rows = 0, cols = 0, scale_row_stride = 0, scale_col_stride = 0;
  bool e4m3 = true, transpose = false;
};
cudaError_t scaled_cast_float8(const Float8Cast& c, const float* in, const float* scale, uint8_t* out, cudaStream_t stream);
cudaError_t scaled_cast_float8(const Float8Cast& c, const uint16_t* in, const float* scale, uint8_t* out, cudaStream_t stream);

}  // namespace titan::kernels::cuda
