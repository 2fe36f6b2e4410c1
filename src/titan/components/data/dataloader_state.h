// The data loader's part of a checkpoint: each data-parallel stream's position, as the metadata field
// ranks[r].dataloader of one rank per stream (the ranks of a TP/CP/PP group read the same stream; the first of
// them saves it). Loading gathers the positions of every saved rank, so the streams continue on any number of ranks.
#pragma once
#include "titan/components/data/dataloader.h"
#include "titan/protocols/stateful.h"

namespace titan::data {

class DataLoaderState : public protocols::Stateful {
 public:
  // `saves`: this rank is the one of its group that records the stream's position.
  DataLoaderState(DataLoader& loader, bool saves) : loader_(loader), saves_(saves) {}
  protocols::SavedState state_dict(const protocols::SaveOptions& options) const override;
  void load_state_dict(protocols::StateSource& source) override;

 private:
  DataLoader& loader_;
  bool saves_;
};

}  // namespace titan::data
