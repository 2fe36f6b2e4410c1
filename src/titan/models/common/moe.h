// The Mixture-of-Experts feed-forward of torchtitan's MoE models (Qwen3-MoE, DeepSeek-V3), with torchtitan's
// parameter names: a router (`router.gate`, a linear from the model width to one logit per expert) picks top_k experts
// per token (token choice, dropless); the tokens are sorted by expert, run through each expert's SwiGLU (3-D weights
// `experts.w1` [experts, hidden, dim], `experts.w3` [experts, hidden, dim], `experts.w2` [experts, dim, hidden]) and
// put back in token order, weighted by their routing scores; an optional dense SwiGLU (`shared_experts`) sees every
// token. Like the dense blocks it knows nothing of parallelism. The grouped-matmul converters (quantize.grouped_mm.mx,
// quantize.grouped_mm.float8) may switch the experts' products to MXFP8 or float8 (nn::float8::GroupedMatmuls).
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "titan/distributed/communicator.h"

#include "titan/models/common/decoder.h"
#include "titan/nn/float8.h"
#include "titan/models/common/moe_args.h"

namespace titan::models {

// What the router decided for T tokens: per token its top_k experts and their weights, and the tokens per expert.
struct Routing {
  at::Tensor scores;    // float32 [T, top_k]: normalised and scaled as MoEArgs says (differentiable)
  at::Tensor experts;   // int64 [T, top_k]
  at::Tensor counts;    // int64 [num_experts]
};

class Router : public nn::Unit {
 public:
  Router(int64_t dim, const MoEArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<nn::Linear> gate;
  // Routes x [T, dim]; `bias` (float32 [num_experts], may be undefined) shifts the scores for selection only.
  Routing route(const at::Tensor& x, const at::Tensor& bias, const nn::Context& context);

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;  // the float32 scores [T, experts]

 private:
  MoEArgs args_;
};

// The routed experts' SwiGLUs on tokens sorted by expert: inputs {x [N, dim], counts int64 [num_experts]} with the
// first counts[0] rows for expert 0 and so on, or {source [T, dim], counts, rows int64 [N]} where x is source's rows
// `rows` (gathered here, and again in backward); returns [N, dim]. One grouped product per weight: titan's grouped
// kernels where they apply (kernels/grouped_mm.h: bf16 on the CPU), otherwise a loop of ATen matmuls over the
// experts that received tokens.
class GroupedExperts : public nn::Unit, public nn::float8::GroupedMatmuls {
 public:
  GroupedExperts(int64_t dim, int64_t hidden_dim, int64_t num_experts, const nn::ParameterOptions& options);
  at::Tensor w1, w2, w3;

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;
};

class MoE : public nn::Unit {
 public:
  MoE(int64_t dim, const MoEArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<Router> router;
  std::shared_ptr<GroupedExperts> experts;
  std::shared_ptr<FeedForward> shared_experts;  // null without shared experts
  const MoEArgs& args() const { return args_; }

  // `tokens_per_expert` (float32 [experts]) counts the tokens each expert received in training forwards -- those run
  // with gradients, so a block under activation checkpointing counts in its recomputation, once -- until
  // update_expert_biases reads and zeroes it. With load_balance_coeff (auxiliary-loss-free balancing, as torchtitan),
  // `expert_bias` (float32 [experts], a buffer the checkpoint keeps as "moe.expert_bias") is added to the scores for
  // choosing experts, never to their weights; undefined without balancing.
  at::Tensor expert_bias, tokens_per_expert;
  void move_buffers(const at::Device& device);  // the same tensor objects, their data on `device`

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;

 private:
  MoEArgs args_;
};

// After a training step's backward, before the optimizer step (torchtitan's pre-step hook): the layers' token counts
// summed over `group` (every rank that routed different tokens: the data-parallel and context-parallel ranks; null
// on one process) in one reduction; with balancing, per layer bias += coeff x sign(mean - count), centred on zero.
// The counts are zeroed. Returns the routing health for a model of `n_layers` blocks of which `layers` are blocks
// `indices` (float64 on the counts' device, read later with the loss), laid out so that the figures of pipeline
// stages and model parts combine by an element-wise maximum: per block the busiest expert's tokens over the mean,
// then per block 1 minus the idlest's (0 for blocks held elsewhere), then minus the smallest and the largest bias.
at::Tensor update_expert_biases(const std::vector<MoE*>& layers, const std::vector<int64_t>& indices, int64_t n_layers,
                                distributed::Communicator* group);

// The combined health figures on the host as "moe/..." scalars for TensorBoard (the worst block's, each block's
// busiest expert, the bias range) and as words for the step's log line.
std::vector<std::pair<std::string, double>> routing_health_scalars(const at::Tensor& figures);
std::string routing_health_summary(const at::Tensor& figures);

}  // namespace titan::models
