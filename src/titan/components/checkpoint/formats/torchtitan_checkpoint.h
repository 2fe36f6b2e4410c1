// torchtitan's checkpoint keys for titan's training state, in torch DCP directories: model weights under their
// own names, AdamW moments and step under "optimizer.state.<name>.<field>", "train_state.step" /
// "train_state.ntokens_seen" (each rank's own count) and "lr_scheduler.last_epoch" as pickled integers.
#pragma once
#include <string>

namespace titan::checkpoint::torchtitan {

inline constexpr const char* kOptimizerStatePrefix = "optimizer.state.";
inline std::string optimizer_key(const std::string& parameter, const std::string& field) {
  return kOptimizerStatePrefix + parameter + "." + field;
}
inline constexpr const char* kStepKey = "train_state.step";
inline constexpr const char* kTokensKey = "train_state.ntokens_seen";
inline constexpr const char* kLrEpochKey = "lr_scheduler.last_epoch";
inline constexpr const char* kDataWorldSizeKey = "dataloader.world_size";  // torchtitan's data-parallel ranks

}  // namespace titan::checkpoint::torchtitan
