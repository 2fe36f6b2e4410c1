// Unit: a torch::nn::Module with a uniform forward (tensors + Context) that wrappers surround from outside (tensor
// and context parallelism, activation checkpointing, FSDP's gathers) without the model code knowing about them.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "titan/nn/storage.h"

namespace titan::nn {

class KeptOps;  // nn/kept_ops.h

// Per-forward inputs every unit may read: the RoPE table for this sequence length and optional positions.
struct Context {
  at::Tensor rope;       // complex64 (seq_len, head_dim / 2)
  at::Tensor positions;  // undefined, or int64 (batch or 1, seq_len) indices into the RoPE table
  at::Tensor attn_mask;  // undefined (causal), or bool (batch, 1, seq_len, seq_len): true where attention is allowed
  // With attn_mask: int32 (batch, seq_len), each position's document index (the same mask). Under context
  // parallelism without attn_mask: the same over the whole sequence, which context-parallel attention masks by.
  at::Tensor documents;
  // Defined: int64 (batch, seq_len) labels, and the model's last unit returns the summed cross-entropy of its
  // logits against them (float32 scalar) instead of the logits (the fused output projection and loss).
  at::Tensor labels;
  // Set inside a block checkpointed with op-level selective checkpointing: the outputs kept from its forward.
  std::shared_ptr<KeptOps> kept_ops;
};

class Unit : public torch::nn::Module {
 public:
  using Inputs = std::vector<at::Tensor>;
  using Next = std::function<at::Tensor(const Inputs&, const Context&)>;
  using Wrapper = std::function<at::Tensor(const Inputs&, const Context&, const Next&)>;

  at::Tensor operator()(const at::Tensor& x, const Context& context) { return call({x}, context); }
  at::Tensor call(const Inputs& inputs, const Context& context) { return invoke(wrappers_.size(), inputs, context); }

  // Wrappers nest in the order added: the first added runs closest to forward().
  void add_wrapper(std::string name, Wrapper wrapper);
  // Adds a wrapper closest to forward(), inside every wrapper already added (one that replaces the computation).
  void add_innermost_wrapper(std::string name, Wrapper wrapper);
  bool has_wrapper(const std::string& name) const;
  // The module's name, its parameters' shapes and the wrappers around it, innermost first (model.print_after_conversion).
  void pretty_print(std::ostream& stream) const override;

 protected:
  virtual at::Tensor forward(const Inputs& inputs, const Context& context) = 0;

 private:
  at::Tensor invoke(size_t depth, const Inputs& inputs, const Context& context);
  std::vector<std::pair<std::string, Wrapper>> wrappers_;
};

// y = x W^T (no bias, as in Llama).
// Parameters are created with `options` (device, dtype, and whether they get storage now; see nn/storage.h).
class Linear : public Unit {
 public:
  Linear(int64_t in_features, int64_t out_features, const ParameterOptions& options = {});
  at::Tensor weight;
  // Under op-level selective checkpointing: always recomputed and not counted among the block's products
  // (activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns; nn/kept_ops.h).
  bool recompute_under_op_checkpointing = false;

 protected:
  at::Tensor forward(const Inputs& inputs, const Context& context) override;
};

class Embedding : public Unit {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, const ParameterOptions& options = {});
  at::Tensor weight;

 protected:
  at::Tensor forward(const Inputs& inputs, const Context& context) override;
};

class RMSNorm : public Unit {
 public:
  // eps < 0: the machine epsilon of the input's dtype (as torch.nn.RMSNorm without an eps).
  RMSNorm(int64_t dim, double eps, const ParameterOptions& options = {});
  at::Tensor weight;

 protected:
  at::Tensor forward(const Inputs& inputs, const Context& context) override;

 private:
  int64_t dim_;
  double eps_;
};

// silu(gate) * up: the parameter-free part of SwiGLU, a unit of its own so it can be recomputed alone.
class SwiGLU : public Unit {
 protected:
  at::Tensor forward(const Inputs& inputs, const Context& context) override;
};

}  // namespace titan::nn
