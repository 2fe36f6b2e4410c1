#include "titan/components/data/dataloader_state.h"

#include "titan/common/logging.h"

namespace titan::data {

protocols::SavedState DataLoaderState::state_dict(const protocols::SaveOptions&) const {
  protocols::SavedState saved;
  if (saves_) saved.rank = {{"dataloader", loader_.state_dict()}};
  return saved;
}

void DataLoaderState::load_state_dict(protocols::StateSource& source) {
  std::vector<std::string> states;
  for (const auto& rank : source.ranks())
    if (rank.contains("dataloader")) states.push_back(rank["dataloader"].get<std::string>());
  if (states.empty()) {
    log::warn(source.name(), " holds no titan data loader state (torchtitan's is a pickled Python loader with no titan "
              "equivalent): the data loader starts from the beginning of the data; the rest of the training state continues");
    return;
  }
  loader_.load_state_dict(states);
}

}  // namespace titan::data
