// The raw CPU kernels behind titan's fused operations, compiled once per instruction set (generic, AVX2, AVX-512,
// AVX-512 with bf16 dot products; see CMakeLists.txt) into namespaces of those names and chosen at run time
// (kernels/cpu_isa.h). They see plain pointers and strides only: no LibTorch types, so that nothing inline is shared
// between the differently compiled copies. bf16 values travel as uint16_t bit patterns.
#pragma once
#include <cstdint>

namespace titan::kernels::isa {

// Causal (optionally block-causal) attention over (batch, seq, heads, head_dim) tensors whose last dimension is
// contiguous; strides are in elements, in (batch, seq, head) order.
struct AttentionShape {
  int64_t batch = 0, heads = 0, kv_heads = 0, seq = 0, head_dim = 0;
  int64_t q_stride[3] = {}, k_stride[3] = {}, v_stride[3] = {}, out_stride[3] = {}, grad_out_stride[3] = {};
  int64_t grad_q_stride[3] = {}, grad_k_stride[3] = {}, grad_v_stride[3] = {};
  float scale = 1;
  // Per batch row and position, the index of the document it belongs to (non-decreasing along the sequence), or
  // null: attention is then causal over the whole sequence.
  const int32_t* documents = nullptr;
};

// Forward work items are (batch, head, block of kAttentionBlock queries); backward items are (batch, kv head).
constexpr int64_t kAttentionBlock = 64;

// RMSNorm over rows of `dim` values: y = x / sqrt(mean(x^2) + eps) * weight. inv_rms (rows) is saved for backward.
struct RowsShape {
  int64_t rows = 0, dim = 0;
};

// RoPE on the interleaved (even, odd) layout of (batch, seq, heads, head_dim) rows, contiguous in head_dim:
// table is float (positions, head_dim / 2, 2) of (cos, sin) pairs; position_of_row gives each (batch, seq) its table
// row (the sequence index when null). Work items are (batch, seq, head) rows.
struct RopeShape {
  int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  int64_t in_stride[3] = {}, out_stride[3] = {};  // (batch, seq, head)
  bool inverse = false;                             // rotate by -angle (the backward)
};

// Cross-entropy over rows of `vocab` contiguous logits (row r at logits + r * vocab); local_label[r] is the
// label's column in these logits, or -1 when it lies in another vocabulary shard or the token is ignored.
// stats: row_max, row_sum_exp = sum exp(x - row_max), row_target = x[label] (0 without one).
// grad: x <- (exp(x - row_lse) - [column == label]) * row_scale, in place.

// One product C[rows, cols] = A[rows, depth] B[depth, cols] of a grouped matrix product (kernels/grouped_mm.h).
// Element (i, j) of each operand lies at its pointer + i * stride[0] + j * stride[1] (elements; float or bf16 bits as
// the call says). depth 0 gives zeros.
struct MatmulProblem {
  int64_t rows = 0, cols = 0, depth = 0;
  const void* a = nullptr;
  int64_t a_stride[2] = {};
  const void* b = nullptr;
  int64_t b_stride[2] = {};
  void* c = nullptr;
  int64_t c_stride[2] = {};
};
// How a problem is computed: both operands are first copied into the copy's own layouts (zero-padded), then
// independent output tiles are computed from those copies. `amx` (bf16 only, the avx512bf16 copy, CPUs with AMX and
// the kernel's permission to use it) runs the tiles on the AMX unit; otherwise bf16 runs on bf16 dot products in
// the avx512bf16 copy, and everything else on float32 multiply-adds on vectors.
// matmul_pack copies part `part` of `parts` (slices of the panels, for packing one large problem on several threads;
// the AMX copy does the whole problem as part 0).
struct MatmulPacking {
  int64_t a_bytes = 0, b_bytes = 0, tiles = 0;
};

#define TITAN_KERNELS_DECLARE(ns)                                                                                       \
  namespace ns {                                                                                                       \
  void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v, float* out,          \
                         float* lse, int64_t begin, int64_t end);                                                      \
  void attention_forward(const AttentionShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,            \
                         uint16_t* out, float* lse, int64_t begin, int64_t end);                                       \
  void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v, const float* out,  \
                          const float* grad_out, const float* lse, float* grad_q, float* grad_k, float* grad_v,       \
                          int64_t begin, int64_t end);                                                                 \
  void attention_backward(const AttentionShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,           \
                          const uint16_t* out, const uint16_t* grad_out, const float* lse, uint16_t* grad_q,          \
                          uint16_t* grad_k, uint16_t* grad_v, int64_t begin, int64_t end);                            \
  void rms_norm_forward(const RowsShape& s, const float* x, const float* weight, float eps, float* y, float* inv_rms,  \
                        int64_t begin, int64_t end);                                                                   \
  void rms_norm_forward(const RowsShape& s, const uint16_t* x, const uint16_t* weight, float eps, uint16_t* y,        \
                        float* inv_rms, int64_t begin, int64_t end);                                                   \
  void rms_norm_backward(const RowsShape& s, const float* x, const float* weight, const float* inv_rms,               \
                         const float* grad_y, float* grad_x, float* grad_weight_partial, int64_t begin, int64_t end); \
  void rms_norm_backward(const RowsShape& s, const uint16_t* x, const uint16_t* weight, const float* inv_rms,         \
                         const uint16_t* grad_y, uint16_t* grad_x, float* grad_weight_partial, int64_t begin,        \
                         int64_t end);                                                                                 \
  void swiglu_forward(const float* gate, const float* up, float* out, int64_t begin, int64_t end);                    \
  void swiglu_forward(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t begin, int64_t end);           \
  void swiglu_backward(const float* gate, const float* up, const float* grad_out, float* grad_gate, float* grad_up,    \
                       int64_t begin, int64_t end);                                                                    \
  void swiglu_backward(const uint16_t* gate, const uint16_t* up, const uint16_t* grad_out, uint16_t* grad_gate,       \
                       uint16_t* grad_up, int64_t begin, int64_t end);                                                 \
  void rope(const RopeShape& s, const float* table, const int64_t* position_of_row, const float* in, float* out,      \
            int64_t begin, int64_t end);                                                                               \
  void rope(const RopeShape& s, const float* table, const int64_t* position_of_row, const uint16_t* in,               \
            uint16_t* out, int64_t begin, int64_t end);                                                                \
  void cross_entropy_stats(int64_t vocab, const float* logits, const int64_t* local_label, float* row_max,            \
                           float* row_sum_exp, float* row_target, int64_t begin, int64_t end);                         \
  void cross_entropy_stats(int64_t vocab, const uint16_t* logits, const int64_t* local_label, float* row_max,         \
                           float* row_sum_exp, float* row_target, int64_t begin, int64_t end);                         \
  void cross_entropy_grad(int64_t vocab, float* logits, const int64_t* local_label, const float* row_lse,             \
                          const float* row_scale, int64_t begin, int64_t end);                                         \
  void cross_entropy_grad(int64_t vocab, uint16_t* logits, const int64_t* local_label, const float* row_lse,          \
                          const float* row_scale, int64_t begin, int64_t end);                                         \
  void matmul_packing(const MatmulProblem& p, bool bf16, bool amx, MatmulPacking* out);                              \
  void matmul_pack(const MatmulProblem& p, bool bf16, bool amx, void* a_packed, void* b_packed, int64_t part,       \
                   int64_t parts);                                                                                     \
  void matmul_tiles(const MatmulProblem& p, bool bf16, bool amx, const void* a_packed, const void* b_packed,           \
                    int64_t begin, int64_t end);                                                                       \
  }

TITAN_KERNELS_DECLARE(generic)
TITAN_KERNELS_DECLARE(avx2)
TITAN_KERNELS_DECLARE(avx512)
TITAN_KERNELS_DECLARE(avx512bf16)

}  // namespace titan::kernels::isa
