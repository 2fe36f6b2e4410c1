// torchtitan's op-level selective activation checkpointing (selective_ac_option = "op"): a block runs as one
// checkpointed unit, but its forward keeps the outputs of attention and of every other matrix product (the 1st,
// 3rd, 5th ... linear in forward order), and the recomputation in backward reuses those instead of computing them
// again; everything else (norms, the other products, RoPE, the gating, the routed experts' grouped products, the
// expert all-to-alls, TP's and CP's communication) is recomputed. Float8 and MXFP8 linears count as the others do
// (torchtitan's policy counts aten.mm, and torchao's float8 and MX linears call torch.mm on their float8 tensors,
// which the policy sees as aten.mm; components/quantization/float8.cpp). Linears marked
// `recompute_under_op_checkpointing` (the MoE router's gate: per_op_sac_force_recompute_mm_shapes_by_fqns) are not
// counted and always recomputed.
//
// Units meet the region through nn::Context::kept_ops, which only the block's checkpoint
// (distributed/activation_checkpoint.h) sets.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace titan::nn {

class KeptOps {
 public:
  // x W^T, counted among the block's products: kept (forward) or reused (recomputation) when its count is odd.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
  // The same for any way of computing a product: `run(kept)` computes it when `kept` is undefined, else returns
  // `kept` (the result of the same call in forward) differentiable as the product.
  at::Tensor product(const std::function<at::Tensor(const at::Tensor& kept)>& run);
  // titan's attention kernel (kernels::attention): its output and log-sum-exp kept, or reused.
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents);

  // From the forward to the recomputation: the counts restart and the kept tensors are handed back in order.
  void start_recomputation();
  // Drops the kept tensors (after the recomputation's backward).
  void release() { kept_.clear(), versions_.clear(); }
  const std::vector<at::Tensor>& kept() const { return kept_; }

  // Called with the kept tensors when a block's forward ends, in the order kept (tests and diagnostics).
  using Observer = std::function<void(const std::vector<at::Tensor>&)>;
  static void set_observer(Observer observer);
  static void notify(const std::vector<at::Tensor>& kept);

 private:
  void keep(const at::Tensor& t);
  const at::Tensor& reuse(const char* what);
  bool recomputing_ = false;
  int64_t products_ = 0;
  size_t next_ = 0;
  std::vector<at::Tensor> kept_;
  std::vector<uint32_t> versions_;  // each kept tensor's version when kept: changed in place since, it is refused
};

}  // namespace titan::nn
