// Activation checkpointing applied to a built model from outside, as torchtitan's activation_checkpoint section:
// full (every block), selective N (every N-th block) and selective "op" (keep matmul and attention outputs,
// recompute RMSNorm and the SwiGLU gating in backward).
#pragma once
#include <vector>

#include "titan/config/job_config.h"
#include "titan/nn/unit.h"

namespace titan::llama3 {
class Transformer;
}

namespace titan::distributed {

// Runs `next` without saving activations; backward recomputes it (under the forward's autocast state) and
// differentiates with respect to `inputs` and `parameters`.
at::Tensor checkpointed_call(const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next,
                             const std::vector<at::Tensor>& parameters);

// Wraps `unit` so that every call goes through checkpointed_call.
void checkpoint_unit(nn::Unit& unit);

struct ActivationCheckpointSummary {
  std::string description;  // for the start-up log
  int64_t wrapped_units = 0;
};

// Throws UserError for modes that cannot run here (memory_budget needs a graph compiler).
ActivationCheckpointSummary apply_activation_checkpointing(llama3::Transformer& model,
                                                           const config::ActivationCheckpoint& ac);

}  // namespace titan::distributed
