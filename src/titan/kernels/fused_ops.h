// titan's fused operations (float32 and bfloat16), with autograd, each one pass forward and one backward: on the
// CPU attention, RMSNorm, SwiGLU, RoPE and the cross-entropy rows (kernels/isa); on NVIDIA GPUs SwiGLU, RoPE and the
// cross-entropy rows (kernels/cuda), while RMSNorm and attention use LibTorch's own fused CUDA kernels.
// training.fused_kernels = false turns them off, and the model then composes the same computations from ATen ops
// (the reference they are tested against).
//
// A CUDA kernel checks itself on its first call in a process (per dtype): it runs on a slice of that call's inputs
// beside the ATen composition, forward and backward, and is used only if they agree within the dtype's rounding.
// The start-up log says which were checked and how closely they agreed; one that disagrees is reported as a warning
// and replaced by the ATen composition for the rest of the process (fused_kernel_applies() then says false). The check
// guards the values on its slice (the first batch row's first 64 positions, 64 rows, 65,536 elements); it cannot
// see a fault outside that slice, and a kernel that faults leaves the CUDA context unusable whatever follows.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace titan::kernels {

// The process-wide switch (training.fused_kernels; on by default).
bool fused_kernels_enabled();
void set_fused_kernels_enabled(bool enabled);

// grouped_mm: the MoE experts' grouped matrix products (kernels/grouped_mm.h), CPU only.
enum class Op { attention, rms_norm, swiglu, rope, cross_entropy, grouped_mm };

// Whether titan's fused kernel for `op` takes tensors like these: the switch is on, all are float32 or bfloat16
// tensors of one dtype on one device, and that device is the CPU, or a CUDA GPU for SwiGLU, RoPE and the
// cross-entropy rows (unless that kernel's first-call check failed in this process).
bool fused_kernel_applies(Op op, std::initializer_list<at::Tensor> tensors);

// The comparison behind those checks, on any device a fused kernel runs on (tests call it on the CPU): the worst
// difference between the fused kernel and the ATen composition, forward and backward, on a slice of these inputs,
// in units of the dtype's tolerance (at most 1 when they agree). Inputs: SwiGLU {gate, up}; RoPE {q, k, table,
// positions (may be undefined)}; cross-entropy rows {logits, local_label}. Attention, RMSNorm and the grouped
// products have none.
double compare_with_aten(Op op, const std::vector<at::Tensor>& inputs);

// The comparison's measure: the worst difference between `actual` (float32 or bf16) and `expected` (computed in
// float32 or wider from the same inputs) in units of what actual's dtype allows (8e-3 relative for bf16, 1e-5 for
// float32, plus 1e-6 of expected's largest finite value).
double difference_in_tolerances(const at::Tensor& actual, const at::Tensor& expected);

// Strict checks (the GPU tests): a CUDA kernel that disagrees with ATen on its first call raises an error instead
// of giving way to the ATen composition, so that tests measure the kernel itself.
void set_cuda_checks_strict(bool strict);
bool cuda_checks_strict();

// Whether this build has titan's CUDA kernels (LibTorch with CUDA; not ROCm).
bool cuda_kernels_built();

// How many threads titan's CPU kernels split one call over: LibTorch's intra-op thread count where titan was built
// with OpenMP (GCC builds), 1 where it was not (at::parallel_for, an inline template, then runs on the caller).
int kernel_threads();

// The first-call checks of the CUDA kernels so far in this process, one line each ("swiglu bf16: agrees with ATen,
// worst difference 0.21 of the tolerance"); empty on the CPU.
std::vector<std::string> cuda_kernel_checks();

// Causal attention softmax(q k^T / sqrt(head_dim)) v on (batch, heads, seq, head_dim) q and (batch, kv_heads, seq,
// head_dim) k, v (grouped-query when kv_heads < heads); block-causal when `documents` (int32 (batch, seq), each
// position's document index, non-decreasing) is given. The result is (batch, heads, seq, head_dim), a transposed
// view of a (batch, seq, heads, head_dim) tensor.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents);
// The same forward without autograd, with the float32 log-sum-exp of every query row (batch, heads, seq): what
// op-level selective checkpointing keeps of attention (nn/kept_ops.h).
std::pair<at::Tensor, at::Tensor> attention_outputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& documents);
// attention() whose forward is already known: attention_outputs() of the same inputs. Returns `out`, differentiable
// with attention's backward, without computing it again.
at::Tensor attention_with_outputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents,
                                  const at::Tensor& out, const at::Tensor& lse);
// attention()'s backward without autograd: the gradients of q, k and v (k and v with their kv_heads) given the
// output gradient and the output and float32 log-sum-exp of every query row. Those may be combined over more keys
// than k and v hold (context parallelism's chunk pairs): the softmax of a score is exp(score - lse) either way.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_gradients(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, const at::Tensor& documents,
                                                                   const at::Tensor& out, const at::Tensor& lse);

// x / sqrt(mean(x^2, last dim) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
// The same composed from ATen ops (what the model runs when the fused kernel does not apply).
at::Tensor swiglu_reference(const at::Tensor& gate, const at::Tensor& up);

// RoPE on the interleaved pairs of q and k (batch, seq, heads, head_dim): `table` is the complex64 (positions,
// head_dim / 2) rotation table; positions (batch or 1, seq) pick its rows, the sequence index when undefined.
std::pair<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                                       const at::Tensor& positions);
// RoPE on one of them composed from ATen ops, through complex views (as torchtitan's model does).
at::Tensor rope_reference(const at::Tensor& x, const at::Tensor& table, const at::Tensor& positions);

// The two passes of a cross-entropy over a (rows, vocab) chunk of logits (float32 or bf16, any device; the fused
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
