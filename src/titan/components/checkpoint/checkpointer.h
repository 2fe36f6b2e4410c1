// Checkpointer: torchtitan's [checkpoint] behaviour over the titan-dcp format (dcp.h). It walks the job's parts of
// the training state (protocols/stateful.h: the model's weights, the optimizer, the LR schedule, the data loader, the
// train state), each of which names its keys, pieces and metadata fields, and saves or loads them without knowing
// any by type; on load each rank reads just the boxes it holds, so a checkpoint saved under one layout loads under
// any other. torchtitan's torch DCP directories and Hugging Face directories load through the same parts.
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/protocols/model_args.h"
#include "titan/protocols/state_dict_adapter.h"
#include "titan/protocols/stateful.h"

namespace titan::checkpoint {

// What Hugging Face imports and exports of the model need: its arguments, the family's adapter (names, layouts,
// config.json) and the run's tokenizer (its files go into exports; may be null).
struct HfModel {
  const protocols::ModelArgs& args;
  const protocols::StateDictAdapter& adapter;
  const tokenizer::Tokenizer* tokenizer = nullptr;
};

class Checkpointer {
 public:
  // `background_timeout_seconds`: how long rank 0's background commit waits for the other ranks' parts.
  Checkpointer(const config::Checkpoint& config, const std::string& dump_folder, double background_timeout_seconds,
               const distributed::DeviceMesh& mesh);
  ~Checkpointer();

  // Removes incomplete saves and loads checkpoint.load_step (-1: the newest complete one, titan's or a torchtitan
  // step-N torch DCP directory); when the folder has none, checkpoint.initial_load_path (a titan checkpoint
  // directory, a torch DCP one, or with initial_load_in_hf a Hugging Face one). Parts named in
  // checkpoint.exclude_from_loading keep their state. Returns whether anything was loaded. Collective.
  bool load(const protocols::StatefulParts& parts, const HfModel& hf);
  // torchtitan's rule: every `interval` steps, the first step when enable_first_step_checkpoint, and the last.
  bool should_save(int64_t step, bool last) const;
  // Saves the parts as step-`step`. Collective. The last save is model-only (the part named "model", in
  // export_dtype) when last_save_model_only, and with last_save_in_hf a Hugging Face directory (weights, config, the
  // run's tokenizer) in place of the titan checkpoint.
  void save(const protocols::StatefulParts& parts, const HfModel& hf, int64_t step, bool last);
  // Async modes: makes, in the background, the host memory a save of `parts` copies into (a mapping whose pages are
  // touched, or pinned buffers for device state), so that the first save blocks training no longer than later
  // ones, which reuse it. Nothing is made when no save of the whole state falls in (step, last_step]. Call when the
  // state has its shapes for good (after the first optimizer step). Not collective.
  void prepare_staging(const protocols::StatefulParts& parts, int64_t step, int64_t last_step);
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
  // The checkpoint directory load() resumes from (checkpoint.load_step's, else the newest complete one in
  // checkpoint.folder), when there is one; what the folder will hold after load() tidies it is not considered.
  static std::optional<std::string> resume_directory(const config::Checkpoint& config, const std::string& dump_folder);

 private:
  void purge(int64_t newest_step);
  // Loads every part not excluded (only "model" when weights_only) from `source`.
  void load_parts(const protocols::StatefulParts& parts, protocols::StateSource& source, bool weights_only);
  bool load_directory(const protocols::StatefulParts& parts, const std::string& directory, bool weights_only);
  void load_hf_weights(const protocols::StatefulParts& parts, const HfModel& hf, const std::string& directory);
  // Replaces the committed model-only checkpoint `directory` by a Hugging Face directory of the same weights.
  void export_hf_in_place(const HfModel& hf, const std::string& directory);
  // torchtitan's checkpoints (torch DCP directories): weights, and unless weights_only the AdamW state, step,
  // token count and LR schedule (torch_dcp_source.h).
  bool load_torch_dcp(const protocols::StatefulParts& parts, const std::string& directory, bool weights_only);
  const config::Checkpoint& config_;
  const distributed::DeviceMesh& mesh_;
  std::string root_;
  double background_timeout_seconds_;
  std::thread purge_thread_;
  std::thread background_;  // async_mode: the write of the last save
  std::thread staging_thread_;  // prepare_staging's (the buffers below are its until save joins it)
  std::mutex error_mutex_;
  std::string background_error_;
  std::atomic<bool> abandon_{false};
  std::map<std::string, at::Tensor> pinned_buffers_;  // async_with_pinned_mem: host copies reused by every save
  std::map<std::string, at::Tensor> host_buffers_;    // async saves of host-resident state: its copies, reused
  at::Tensor host_arena_;                             // ... all in this one mapping
};

}  // namespace titan::checkpoint
