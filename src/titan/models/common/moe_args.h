// The arguments of a Mixture-of-Experts feed-forward (torchtitan v0.2.2's MoEArgs, with the experts' hidden width):
// token-choice top-k routing over `num_experts` SwiGLU experts, optionally beside a dense shared SwiGLU.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::models {

struct MoEArgs {
  int64_t num_experts = 8;
  int64_t num_shared_experts = 1;  // > 0: one dense SwiGLU of width hidden_dim x num_shared_experts beside the experts
  std::string score_func = "sigmoid";  // "softmax" or "sigmoid" of the router's logits (in float32)
  bool route_norm = false;             // divide the top-k scores by their sum
  double route_scale = 1.0;            // multiply the (normalised) top-k scores
  bool gate_bias = false;              // the router's linear has a bias (not supported yet: check() refuses it)
  bool score_before_experts = true;    // scale each routed input by its score (else each expert output)
  int64_t top_k = 1;
  // Node-limited routing: the experts fall into num_expert_groups groups; each token keeps the num_limited_groups
  // groups whose two best scores sum highest and picks its experts inside them. Unset: no groups.
  std::optional<int64_t> num_expert_groups;
  std::optional<int64_t> num_limited_groups;
  // Auxiliary-loss-free balancing's step (unset: off): after every optimizer step each expert's selection bias moves
  // by this much towards the mean load (models/common/moe.h).
  std::optional<double> load_balance_coeff = 1e-3;
  // debug.moe_force_load_balance (torchtitan's _debug_force_load_balance): token t's k-th slot goes to expert
  // (t top_k + k) mod num_experts whatever the router says; its weights are still the router's scores there.
  bool force_load_balance = false;
  int64_t hidden_dim = 768;  // each expert's SwiGLU width (torchtitan's moe_inter_dim)

  // Throws UserError naming the field when the arguments do not fit together.
  void check() const;
  // One "field: a vs b" line per field that changes what the layer computes.
  std::vector<std::string> differences(const MoEArgs& other) const;
};

}  // namespace titan::models
