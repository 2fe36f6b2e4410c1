// What a part of the training state gives a checkpoint and takes back from one (torchtitan's Stateful): the model's
// weights, the optimizer, the LR schedule, the data loader and the train state each name their own keys and decide
// which ranks save what; the checkpointer walks a list of them and knows none by type (components/checkpoint).
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace titan::protocols {

// One piece of a tensor as this rank writes it: `tensor` is the box of a global tensor of `shape` that starts at
// `offsets`.
struct TensorPiece {
  std::string key;
  at::Tensor tensor;
  std::vector<int64_t> offsets;
  std::vector<int64_t> shape;
};

// What one part contributes to a save. The JSON objects are fields of the checkpoint's metadata; two parts never
// write the same field.
struct SavedState {
  std::vector<TensorPiece> tensors;                     // this rank's pieces (a replicated tensor by one rank only)
  nlohmann::json global = nlohmann::json::object();     // the same on every rank; rank 0's are recorded
  nlohmann::json gathered = nlohmann::json::object();   // each rank fills in part; objects are united over ranks
  nlohmann::json rank = nlohmann::json::object();       // this rank's own (metadata "ranks"[r])
};

struct SaveOptions {
  bool model_only = false;                   // the last save of checkpoint.last_save_model_only
  std::optional<at::ScalarType> weights_dtype;  // model-only saves: checkpoint.export_dtype
};

// A checkpoint being loaded, whatever its format (titan's, torchtitan's torch DCP, a Hugging Face directory), in
// titan's key names and metadata fields.
class StateSource {
 public:
  struct Entry {
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kFloat;
  };
  virtual ~StateSource() = default;
  virtual std::string name() const = 0;                                         // for messages: "checkpoint DIR"
  virtual std::string key_name(const std::string& key) const { return key; }   // a key as the source itself names it
  virtual std::vector<std::string> keys() const = 0;                            // every tensor, in titan's names
  virtual std::optional<Entry> entry(const std::string& key) const = 0;
  // Fills `out` (any dtype and device, shaped like the box) with the box of `key` that starts at `offsets`.
  virtual void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) = 0;
  // The global and gathered fields, and every saved rank's own (empty when the source has none).
  virtual const nlohmann::json& metadata() const = 0;
  virtual const nlohmann::json& ranks() const = 0;
  // This rank's own fields when the checkpoint was saved by as many ranks as load it, else null.
  virtual const nlohmann::json* own_rank() const { return nullptr; }
  // Whether tensors must be stored in the dtype training keeps (a resumable titan checkpoint); others convert.
  virtual bool exact_dtypes() const { return false; }
};

class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual SavedState state_dict(const SaveOptions& options) const = 0;
  virtual void load_state_dict(StateSource& source) = 0;
};

// The parts of a training job in the order they are saved and loaded, under the names checkpoint.exclude_from_loading
// uses ("model", "optimizer", "lr_scheduler", "dataloader", "train_state"). The part named "model" holds the weights
// that model-only saves keep.
using StatefulParts = std::vector<std::pair<std::string, Stateful*>>;

}  // namespace titan::protocols
