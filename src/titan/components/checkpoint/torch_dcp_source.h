// torchtitan's checkpoints (torch DCP directories) as a source the training state's parts load from
// (protocols/stateful.h): weights at the top level ("model.<name>" in titan's names), AdamW moments and step counts
// under optimizer.state.<name>.<field>, the step, token count and LR schedule as pickled integers.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/protocols/stateful.h"

namespace titan::checkpoint {

class TorchDcpSource : public protocols::StateSource {
 public:
  // Reads the directory's metadata and, unless weights_only, its step, token count, LR schedule and step counts;
  // optimizer state without a step is refused (UserError naming the directory).
  TorchDcpSource(const std::string& directory, bool weights_only);
  // The step it was saved at; nothing for a model-only save.
  std::optional<int64_t> step() const { return step_; }

  std::string name() const override;
  std::string key_name(const std::string& key) const override;
  std::vector<std::string> keys() const override;
  std::optional<Entry> entry(const std::string& key) const override;
  void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) override;
  const nlohmann::json& metadata() const override { return metadata_; }
  const nlohmann::json& ranks() const override { return no_ranks_; }

 private:
  torch_dcp::Reader reader_;
  std::map<std::string, std::string> titan_to_dcp_;  // titan key -> torchtitan key
  std::optional<int64_t> step_;
  nlohmann::json metadata_ = nlohmann::json::object(), no_ranks_ = nlohmann::json::array();
};

}  // namespace titan::checkpoint
