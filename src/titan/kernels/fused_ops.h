// titan's fused operations on CPU tensors (float32 and bfloat16), with autograd: attention, RMSNorm, SwiGLU and
// RoPE, each one pass forward and one backward (kernels/isa). training.fused_kernels = false turns them off, and
// the model then composes the same computations from ATen ops (the reference they are tested against).
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace titan::kernels {

// The process-wide switch (training.fused_kernels; on by default).
bool fused_enabled();
void set_fused_enabled(bool enabled);

// Whether the fused CPU kernels take tensors like these: the switch is on, and all are CPU float32 or bfloat16
// tensors of one dtype.
bool cpu_kernels_apply(std::initializer_list<at::Tensor> tensors);

// Causal attention softmax(q k^T / sqrt(head_dim)) v on (batch, heads, seq, head_dim) q and (batch, kv_heads, seq,
// head_dim) k, v (grouped-query when kv_heads < heads); block-causal when `documents` (int32 (batch, seq), each
// position's document index, non-decreasing) is given. The result is (batch, heads, seq, head_dim), a transposed
// view of a (batch, seq, heads, head_dim) tensor.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents);

// x / sqrt(mean(x^2, last dim) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// RoPE on the interleaved pairs of q and k (batch, seq, heads, head_dim): `table` is the complex64 (positions,
// head_dim / 2) rotation table; positions (batch or 1, seq) pick its rows, the sequence index when undefined.
std::pair<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                                       const at::Tensor& positions);

// The two passes of a cross-entropy over a (rows, vocab) chunk of logits (float32 or bf16, any device; the CPU
// kernels when they apply, ATen ops otherwise). local_label (int64, rows): each row's label column in these logits,
// or -1 where the label lies elsewhere or the token is ignored.
struct CrossEntropyRowStats {
  at::Tensor max, sum_exp, target;  // float32 (rows): the row maximum, sum exp(x - max), x[label] (0 without one)
};
CrossEntropyRowStats cross_entropy_row_stats(const at::Tensor& logits, const at::Tensor& local_label);
// Overwrites the logits with (softmax with log-sum-exp `lse` - one_hot(label)) * scale, both float32 (rows): the
// gradient of the summed loss when scale is 1 for counted tokens and 0 for ignored ones.
void cross_entropy_row_grad_(const at::Tensor& logits, const at::Tensor& local_label, const at::Tensor& lse,
                             const at::Tensor& scale);

}  // namespace titan::kernels
