// Trainer: builds the tokenizer, the family's model (through its spec), the parallelized model parts and their step
// schedule, the optimizer, LR schedule, data and checkpointer from a JobConfig, and runs torchtitan's training loop
// (gradient accumulation, loss over global valid tokens, clipping, metrics, checkpoints, validation, stop signals).
#pragma once
#include <c10/core/Event.h>

#include <memory>
#include <optional>
#include <vector>

#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/model_weights.h"
#include "titan/components/data/dataloader_state.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/lr_scheduler.h"
#include "titan/components/optimizer.h"
#include "titan/components/optimizer_state.h"
#include "titan/trainer/step_in_backward.h"
#include "titan/components/profiling.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/loader.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/model_part.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/pipeline/stages.h"
#include "titan/nn/model.h"
#include "titan/protocols/model_spec.h"
#include "titan/trainer/control.h"
#include "titan/trainer/job_model.h"
#include "titan/trainer/metrics_processor.h"
#include "titan/trainer/step_schedule.h"
#include "titan/trainer/train_state.h"
#include "titan/trainer/validator.h"

namespace titan {

class Trainer {
 public:
  explicit Trainer(config::LoadedConfig loaded);
  ~Trainer();

  // The loop: steps until training.steps or a stop request (SIGINT/SIGTERM after the current step).
  // Returns the process exit code.
  int train();
  // The exit code of a run that ended with an error, for the metric files that record one (W&B's exit record);
  // train() records its own. Never throws.
  void record_failure(int exit_code) noexcept;

  // One optimizer step over the given micro-batches, its results read at once (exposed for tests and tools; the
  // loop reads them only when it needs them).
  StepResult train_step(const std::vector<data::Batch>& microbatches);
  std::vector<data::Batch> next_microbatches();
  // Runs validation now (validation.steps batches, or one pass when -1) and logs it; returns the global mean
  // loss. Collective over the data-parallel ranks.
  double validate();

  nn::Model& model() { return *model_; }
  const protocols::ModelArgs& model_args() const { return *model_args_; }
  Adam& optimizer() { return *optimizer_; }
  LRScheduler& lr_scheduler() { return *lr_scheduler_; }
  const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
  const config::JobConfig& config() const { return loaded_.config; }
  int64_t gradient_accumulation_steps() const { return grad_accum_steps_; }
  int64_t step() const { return train_state_.step; }
  // The device this rank computes on (CUDA with a GPU per rank, else the CPU).
  const at::Device& compute_device() const { return device_; }
  const distributed::DeviceMesh& mesh() const { return *mesh_; }
  // Every parameter as this rank holds it, over all its model parts (what the optimizer updates and where it lies
  // in the global tensor).
  const std::vector<distributed::ShardedParameter>& parameters() const { return parameters_; }
  const std::vector<distributed::ShardedParameter>& buffers() const { return buffers_; }
  // The parallelized model parts on this rank: the whole model, or its pipeline stages' parts (torchtitan's
  // model_parts).
  std::vector<distributed::ModelPart>& model_parts() { return schedule_->parts(); }
  distributed::pipeline::Pipeline* pipeline() { return schedule_->pipeline(); }

 private:
  // The constructor's steps, in order.
  distributed::ParallelDims check_job();            // the configuration against the model, before any communication
  void start_process(const distributed::ParallelDims& dims);  // world, device, mesh, seed
  void build_tokenizer();
  // The tokenizer of the Hugging Face folder the weights come from, as the run's own copy (the default where
  // model.hf_assets_path is not set); model.hf_assets_path where the folder has none.
  std::string hf_folder_tokenizer(const std::string& folder);
  void build_model(const distributed::ParallelDims& dims);   // model, its parts and step schedule, initial weights
  void build_training(const distributed::ParallelDims& dims);  // optimizer, LR schedule, batch sizes, data, checkpoint

  // A step launched on the device: its loss, gradient norm and non-finite flag stay there until settle() reads
  // them (with the fused optimizer, which skips a non-finite step on the device, that can wait).
  struct DeviceStep {
    int64_t step = 0, tokens = 0;
    double lr = 0;
    at::Tensor values;                  // float64 (3): loss, gradient norm, 1 where either is not finite
    at::Tensor host_values;             // on a GPU: their pinned host copy, complete once `ready` has passed
    std::shared_ptr<c10::Event> ready;
    std::optional<StepResult> settled;  // already read (an optimizer that decides on the host)
    int64_t figure_count = 0;  // the model parts' combined step figures in `values`, after the first 3
  };
  DeviceStep launch_step(const std::vector<data::Batch>& microbatches, int64_t global_valid_tokens);
  void update(DeviceStep& step, const at::Tensor& nonfinite);  // the optimizer step and the LR schedule
  // Reads a step's values and keeps the count of non-finite steps; throws UserError when they stop the run.
  StepResult settle(const DeviceStep& step);
  std::optional<StepResult> settle_pending();  // the launched step not read yet, if any
  at::Tensor read_host_tensor(const at::Tensor& t);  // t on the host (counted when it was on a device)
  static int64_t local_valid_tokens(const std::vector<data::Batch>& microbatches);
  Control exchange_control(bool exhausted, int64_t valid_tokens, int signal, bool save_failed);
  // The loop's parts: the seed checkpoint, a stop for a signal (saving the step), the end of a complete run, and the
  // communication summary.
  int create_seed_checkpoint();
  int stop_for_signal(int signal, int64_t first_step, std::vector<data::LaneState> position_before);
  void after_step(std::optional<StepResult> result, int64_t first_step);
  void check_last_save();
  void log_summary(int64_t first_step, double train_start);
  void check_memory(const distributed::ParallelDims& dims);
  void write_pipeline_timeline();
  // memory_estimation.enable: the job is estimated instead of trained (torchtitan's memory estimation).
  void restrict_to_memory_estimation();
  // Checkpoints are written (checkpoint.enable, unless checkpoint.load_only).
  bool saves_checkpoints() const { return loaded_.config.checkpoint.enable && !loaded_.config.checkpoint.load_only; }
  bool estimate_only() const { return loaded_.config.memory_estimation.enable && !loaded_.config.memory_estimation.disable_fake_mode; }
  int report_memory_estimation(int64_t steps_run);  // 0: the estimate alone

  config::LoadedConfig loaded_;
  at::Device device_{at::kCPU};
  distributed::LaunchInfo launch_;
  std::unique_ptr<distributed::DeviceMesh> mesh_;
  std::shared_ptr<distributed::Communicator> control_;  // the per-step control reduction's ranks (all of them)
  uint64_t seed_ = 0;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  const protocols::ModelSpec* spec_ = nullptr;  // the family (models/registry.h)
  std::shared_ptr<const protocols::ModelArgs> model_args_;
  std::string model_name_;                      // for logs: the flavor, or what set the shape
  std::string checkpoint_flavor_;                // the flavor name checkpoints record (job_model.h)
  std::unique_ptr<protocols::StateDictAdapter> hf_adapter_;
  std::shared_ptr<nn::Model> model_;
  std::unique_ptr<StepSchedule> schedule_;      // this rank's model parts and how a step runs through them
  std::vector<distributed::ShardedParameter> parameters_;
  std::vector<distributed::ShardedParameter> buffers_;  // checkpointed untrained state (MoE balancing biases)
  std::unique_ptr<Adam> optimizer_;
  std::unique_ptr<StepInBackward> step_in_backward_;  // optimizer.early_step_in_backward: updates during backward
  bool step_in_backward_logged_ = false;
  std::unique_ptr<LRScheduler> lr_scheduler_;
  std::unique_ptr<data::DataLoader> dataloader_;
  std::unique_ptr<Validator> validator_;
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_;
  TrainState train_state_;  // the step and tokens seen (the loop's counters live here)
  // What checkpoints hold (the model's weights, the optimizer's state, the data position; with the LR schedule and
  // the train state), in torchtitan's order, and what Hugging Face imports and exports need.
  std::unique_ptr<checkpoint::ModelWeights> model_weights_;
  std::unique_ptr<OptimizerState> optimizer_state_;
  std::unique_ptr<data::DataLoaderState> dataloader_state_;
  protocols::StatefulParts checkpoint_parts_;
  checkpoint::HfModel hf_model() const { return {*model_args_, *hf_adapter_, tokenizer_.get()}; }
  void save_checkpoint(bool last) { checkpointer_->save(checkpoint_parts_, hf_model(), train_state_.step, last); }
  std::unique_ptr<MetricsProcessor> metrics_;
  std::unique_ptr<Profiler> profiler_;
  std::optional<at::ScalarType> autocast_dtype_;
  bool weight_casts_per_step_ = true;  // autocast's weight copies kept over the step (training.autocast_weight_casts)
  int64_t nonfinite_in_row_ = 0, nonfinite_total_ = 0;  // steps skipped for a NaN/inf loss or gradient norm
  std::optional<DeviceStep> unsettled_;                   // the last launched step, until read
  int64_t reads_at_once_ = 0, reads_a_step_later_ = 0, control_reductions_ = 0, device_reads_ = 0;
  int64_t grad_accum_steps_ = 1;
  double estimated_bytes_ = 0, available_bytes_ = 0;  // this rank's start-up memory estimate, and what it had
};

}  // namespace titan
