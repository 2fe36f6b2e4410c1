// PyTorch's torch.distributed.checkpoint (DCP) directories as FileSystemWriter lays them out, read and written
// without Python: `.metadata` (a pickled Metadata object: every key's dtype, global shape and chunk boxes, and
// where each chunk's bytes lie) and `__R_N.distcp` data files, each a run of torch.save archives, one per chunk
// or non-tensor value. torchtitan saves its checkpoints this way (docs/checkpoint.md, "torch DCP").
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "titan/components/checkpoint/formats/pickle.h"

namespace titan::checkpoint::torch_dcp {

struct Location {
  std::string file;  // relative to the checkpoint directory
  uint64_t offset = 0, length = 0;
};

struct Chunk {
  std::vector<int64_t> offsets, sizes;
  Location where;
};

struct TensorItem {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<Chunk> chunks;
};

// True when `directory` holds a torch DCP checkpoint (its .metadata file).
bool is_checkpoint(const std::string& directory);
// True when it holds a training state to resume (torchtitan's train_state.step), not only model weights.
bool has_training_state(const std::string& directory);

class Reader {
 public:
  // Parses .metadata; throws UserError naming the directory and what is malformed or unsupported.
  explicit Reader(const std::string& directory);
  const std::string& directory() const { return directory_; }
  const std::map<std::string, TensorItem>& tensors() const { return tensors_; }
  const std::map<std::string, Location>& objects() const { return objects_; }  // non-tensor values
  bool has_tensor(const std::string& key) const { return tensors_.count(key) > 0; }
  // Fills `out` (any dtype and device) with the box of `key` that starts at `offsets`, from every chunk it
  // overlaps: any layout that saved it, any layout that reads it.
  void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) const;
  at::Tensor read(const std::string& key) const;  // the whole tensor, in its stored dtype, on the CPU
  pickle::Ptr read_object(const std::string& key) const;
  // A non-negative integer stored as a pickled int or as a one-element tensor (older torchtitan versions saved
  // train_state.step as an int32 tensor); nothing when the key is absent.
  std::optional<int64_t> read_integer(const std::string& key) const;

 private:
  std::string directory_;
  std::map<std::string, TensorItem> tensors_;
  std::map<std::string, Location> objects_;
};

// "model." when every tensor outside torchtitan's training state (optimizer., lr_scheduler., train_state.,
// dataloader.) lies under it, as in a DCP save of {"model": model.state_dict()}: the model's keys are then read one
// level down. Empty otherwise (torchtitan's own checkpoints keep the model's keys at the top).
std::string nested_model_prefix(const Reader& reader);

struct TensorToWrite {
  std::string key;                // the flat key, e.g. "optimizer.state.norm.weight.exp_avg"
  std::vector<std::string> path;  // the nested state-dict path it flattens, e.g. {"optimizer", "state.norm.weight.exp_avg"}
  at::Tensor tensor;              // written whole, as one chunk
};

struct ObjectToWrite {
  std::string key;
  std::vector<std::string> path;
  std::string pickle;  // a whole pickle of the Python value (pickle_writer.h)
};

// Writes a complete checkpoint into `directory` (which must not exist) from one process: one data file
// `__0_0.distcp` and `.metadata`, via "<directory>.partial" renamed at the end.
void write_checkpoint(const std::string& directory, const std::vector<TensorToWrite>& tensors,
                      const std::vector<ObjectToWrite>& objects);

}  // namespace titan::checkpoint::torch_dcp
