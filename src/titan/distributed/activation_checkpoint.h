// Activation checkpointing applied to units from outside: a unit's forward runs without saving activations and
// is recomputed in backward. Which units a model checkpoints for torchtitan's modes (full, selective N, selective
// op) is the model's plan (models/common/decoder_parallelize.h).
#pragma once
#include <vector>

#include <string>
#include "titan/nn/unit.h"

namespace titan::distributed {

// What a checkpointed unit's backward recomputes: its whole forward, or all but the outputs op-level selective
// checkpointing keeps (torchtitan's policy, nn/kept_ops.h).
enum class Recompute { everything, all_but_kept_ops };

// Runs `next` without saving activations; backward recomputes it (under the forward's autocast state) and
// differentiates with respect to `inputs` and `parameters`. Under autocast with the step's weight casts held, the
// matrices among `cast_ahead` (default: `parameters`) get their low-precision copies first (nn/autocast.h).
at::Tensor checkpointed_call(const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next,
                             const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>* cast_ahead = nullptr,
                             Recompute recompute = Recompute::everything);

// Wraps `unit` so that every call goes through checkpointed_call.
void checkpoint_unit(nn::Unit& unit, Recompute recompute = Recompute::everything);

struct ActivationCheckpointSummary {
  std::string description;  // for the start-up log
  int64_t wrapped_units = 0;
};

}  // namespace titan::distributed
