// Checkpointer: torchtitan's checkpoints (torch DCP directories) as a source the training state's parts load from.
#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/components/checkpoint/formats/torchtitan_checkpoint.h"

namespace titan::checkpoint {

using json = nlohmann::json;

namespace {

// torchtitan's keys in titan's names: weights at the top level ("model.<name>" in titan), AdamW moments and step
// counts under optimizer.state.<name>.<field>, the step, token count and LR schedule as pickled integers.
class TorchDcpSource : public protocols::StateSource {
 public:
  TorchDcpSource(const std::string& directory, bool weights_only) : reader_(directory) {
    namespace tt = torchtitan;
    const std::string optimizer_prefix = tt::optimizer_key("", "");  // "optimizer.state.."
    const std::string state_prefix = optimizer_prefix.substr(0, optimizer_prefix.size() - 1);  // "optimizer.state."
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
        titan_to_dcp_["model." + key] = key;
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
  std::optional<int64_t> step() const { return step_; }

  std::string name() const override { return "torch DCP checkpoint " + reader_.directory(); }
  std::string key_name(const std::string& key) const override {
    auto it = titan_to_dcp_.find(key);
    if (it != titan_to_dcp_.end()) return it->second;
    return starts_with(key, "model.") ? key.substr(6) : key;
  }
  std::vector<std::string> keys() const override {
    std::vector<std::string> keys;
    for (const auto& [key, dcp_key] : titan_to_dcp_) keys.push_back(key);
    return keys;
  }
  std::optional<Entry> entry(const std::string& key) const override {
    auto it = titan_to_dcp_.find(key);
    if (it == titan_to_dcp_.end()) return std::nullopt;
    const auto& item = reader_.tensors().at(it->second);
    return Entry{item.shape, item.dtype};
  }
  void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) override {
    reader_.read_box(titan_to_dcp_.at(key), offsets, std::move(out));
  }
  const json& metadata() const override { return metadata_; }
  const json& ranks() const override { return no_ranks_; }

 private:
  torch_dcp::Reader reader_;
  std::map<std::string, std::string> titan_to_dcp_;
  std::optional<int64_t> step_;
  json metadata_ = json::object(), no_ranks_ = json::array();
};

}  // namespace

bool Checkpointer::load_torch_dcp(const protocols::StatefulParts& parts, const std::string& directory, bool weights_only) {
  const double start = now_seconds();
  TorchDcpSource source(directory, weights_only);
  const bool model_only = weights_only || !source.step();
  load_parts(parts, source, model_only);
  if (model_only) {
    log::info("Loaded model weights from torch DCP checkpoint ", directory,
              source.step() ? " (model only: training starts at step 1)"
                            : " (it holds model weights only, as torchtitan's last save: training starts at step 1)",
              strprintf(" in %.2f s", now_seconds() - start));
    return true;
  }
  log::info(strprintf("Loaded torch DCP checkpoint %s (step %lld: model, optimizer, LR schedule) in %.2f s", directory.c_str(),
                      static_cast<long long>(*source.step()), now_seconds() - start));
  return true;
}

}  // namespace titan::checkpoint
