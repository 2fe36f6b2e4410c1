// The loop's counters (torchtitan's TrainState): the step reached and the tokens trained on by all ranks, with each
// rank's CPU random-number state. Checkpointed as the metadata fields train_state.{step, tokens_seen} and
// ranks[r].rng (restored when as many ranks resume as saved).
#pragma once
#include <cstdint>

#include "titan/protocols/stateful.h"

namespace titan {

struct TrainState : protocols::Stateful {
  int64_t step = 0;
  int64_t tokens_seen = 0;

  protocols::SavedState state_dict(const protocols::SaveOptions& options) const override;
  void load_state_dict(protocols::StateSource& source) override;
};

}  // namespace titan
