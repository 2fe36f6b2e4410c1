// Checkpointer: torchtitan's [checkpoint] behaviour over the titan-dcp format (dcp.h). It walks the trainer's
// state -- every parameter's and its optimizer state's piece as its placement says, the LR schedule, every rank's
// dataloader state, the step and token count, RNG state -- and saves or loads it; on load each rank reads just
// the boxes it holds, so a checkpoint saved under one layout loads under any other.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <mutex>
#include <atomic>
#include <thread>

#include "titan/components/data/dataloader.h"
#include "titan/components/lr_scheduler.h"
#include "titan/components/optimizer.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/loader.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/protocols/model_args.h"
#include "titan/protocols/model_spec.h"

namespace titan::checkpoint {

struct TrainState {
  int64_t step = 0;
  int64_t tokens_seen = 0;
};

// References to what a checkpoint holds. The optimizer's state i belongs to parameters[i].
struct CheckpointedState {
  std::vector<distributed::ShardedParameter>& parameters;
  const protocols::ModelArgs& model_args;            // the model's shapes and metadata
  const protocols::StateDictAdapter& hf_adapter;     // Hugging Face names, layouts and config.json
  Adam& optimizer;
  LRScheduler& lr_scheduler;
  data::DataLoader& dataloader;
  TrainState& train;
  const tokenizer::Tokenizer* tokenizer = nullptr;  // recorded in metadata; its files go into Hugging Face exports
};

class Checkpointer {
 public:
  Checkpointer(const config::LoadedConfig& loaded, const distributed::DeviceMesh& mesh);
  ~Checkpointer();

  // Removes incomplete saves and loads checkpoint.load_step (-1: the newest complete one, titan's or a torchtitan
  // step-N torch DCP directory); when the folder has none, checkpoint.initial_load_path (a titan checkpoint
  // directory, a torch DCP one, or with initial_load_in_hf a Hugging Face one).
  // Returns whether anything was loaded. Collective.
  bool load(CheckpointedState& state);
  // torchtitan's rule: every `interval` steps, the first step when enable_first_step_checkpoint, and the last.
  bool should_save(int64_t step, bool last) const;
  // Collective. The last save is model-only in export_dtype when last_save_model_only, and with last_save_in_hf a
  // Hugging Face directory (weights, config, the run's tokenizer) in place of the titan checkpoint.
  void save(CheckpointedState& state, bool last);
  // Waits for the background write (async_mode) and purge of old checkpoints. A background write that failed is an
  // error (UserError naming the checkpoint and the cause): a run must not go on, or end successfully, without the
  // checkpoint it asked for.
  void wait();
  // Without blocking: the error of a background write that has already failed on this rank, or empty.
  std::string background_failure();
  // Stops waiting for other ranks' parts of a background save (a rank's save failed and the job is stopping).
  void abandon_background();

  std::string folder() const { return root_; }
  static std::optional<int64_t> latest_complete_step(const std::string& root);

 private:
  void purge(int64_t newest_step);
  bool load_directory(CheckpointedState& state, const std::string& directory, bool weights_only);
  void load_hf_weights(CheckpointedState& state, const std::string& directory);
  // Replaces the committed model-only checkpoint `directory` by a Hugging Face directory of the same weights.
  void export_hf_in_place(const CheckpointedState& state, const std::string& directory);
  // torchtitan's checkpoints (torch DCP directories): weights, and unless weights_only the AdamW state, step,
  // token count and LR schedule (checkpointer_torch_dcp.cpp).
  bool load_torch_dcp(CheckpointedState& state, const std::string& directory, bool weights_only);
  const config::LoadedConfig& loaded_;
  const config::Checkpoint& config_;
  const distributed::DeviceMesh& mesh_;
  std::string root_;
  std::thread purge_thread_;
  std::thread background_;  // async_mode: the write of the last save
  std::mutex error_mutex_;
  std::string background_error_;
  std::atomic<bool> abandon_{false};
  std::map<std::string, at::Tensor> pinned_buffers_;  // async_with_pinned_mem: host copies reused by every save
};

}  // namespace titan::checkpoint
