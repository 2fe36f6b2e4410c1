#include "titan/components/checkpoint/torch_dcp_source.h"

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/torchtitan_checkpoint.h"

namespace titan::checkpoint {

using json = nlohmann::json;

TorchDcpSource::TorchDcpSource(const std::string& directory, bool weights_only) : reader_(directory) {
  namespace tt = torchtitan;
  const std::string state_prefix = tt::kOptimizerStatePrefix;
  const std::string nested = torch_dcp::nested_model_prefix(reader_);  // {"model": state_dict} saves
  if (!nested.empty())
    log::info("torch DCP checkpoint ", directory, " holds the model's tensors under \"model.\"; reading them from there");
  bool has_optimizer_state = false;
  json steps = json::object();
  for (const auto& [key, item] : reader_.tensors()) {
    if (starts_with(key, state_prefix)) {
      has_optimizer_state = true;
      for (const char* field : {"exp_avg_sq", "exp_avg", "step"}) {
        const std::string suffix = cat(".", field);
        if (!ends_with(key, suffix)) continue;
        const std::string parameter = key.substr(state_prefix.size(), key.size() - state_prefix.size() - suffix.size());
        if (std::string(field) == "step") {
          if (!weights_only) steps[parameter] = reader_.read(key).to(at::kDouble).reshape({}).item<double>();
        } else {
          titan_to_dcp_[cat("optimizer.", field, ".", parameter)] = key;
        }
        break;
      }
    } else if (!starts_with(key, "optimizer.") && !starts_with(key, "lr_scheduler.") && !starts_with(key, "train_state.") &&
               !starts_with(key, "dataloader.")) {
      titan_to_dcp_["model." + key.substr(nested.size())] = key;
    }
  }
  step_ = reader_.read_integer(tt::kStepKey);
  if (!step_ && has_optimizer_state && !weights_only)
    fail("torch DCP checkpoint ", directory, " has optimizer state but no ", tt::kStepKey,
         "; titan cannot tell which step it continues from. Load its weights only (checkpoint.initial_load_model_only = true)");
  if (step_ && !weights_only) {
    // torchtitan counts each rank's own tokens; titan counts all ranks': times its data-parallel world size.
    const int64_t ranks = std::max<int64_t>(reader_.read_integer(tt::kDataWorldSizeKey).value_or(1), 1);
    metadata_["train_state"] = {{"step", *step_}, {"tokens_seen", reader_.read_integer(tt::kTokensKey).value_or(0) * ranks}};
    metadata_["optimizer"] = {{"steps", steps}};
    if (auto epoch = reader_.read_integer(tt::kLrEpochKey)) metadata_["lr_scheduler"] = {{"completed", *epoch}};
  }
}

std::string TorchDcpSource::name() const { return "torch DCP checkpoint " + reader_.directory(); }

std::string TorchDcpSource::key_name(const std::string& key) const {
  auto it = titan_to_dcp_.find(key);
  if (it != titan_to_dcp_.end()) return it->second;
  return starts_with(key, "model.") ? key.substr(6) : key;
}

std::vector<std::string> TorchDcpSource::keys() const {
  std::vector<std::string> keys;
  for (const auto& [key, dcp_key] : titan_to_dcp_) keys.push_back(key);
  return keys;
}

std::optional<protocols::StateSource::Entry> TorchDcpSource::entry(const std::string& key) const {
  auto it = titan_to_dcp_.find(key);
  if (it == titan_to_dcp_.end()) return std::nullopt;
  const auto& item = reader_.tensors().at(it->second);
  return Entry{item.shape, item.dtype};
}

void TorchDcpSource::read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) {
  reader_.read_box(titan_to_dcp_.at(key), offsets, std::move(out));
}

}  // namespace titan::checkpoint
