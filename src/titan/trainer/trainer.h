// Trainer: builds tokenizer, model, activation checkpointing, optimizer, schedule and data from a JobConfig and
// runs torchtitan's training loop (gradient accumulation, loss over global valid tokens, clipping, metrics).
#pragma once
#include <c10/core/Event.h>

#include <memory>
#include <optional>
#include <vector>

#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/lr_scheduler.h"
#include "titan/components/metrics/memory.h"
#include "titan/components/metrics/metric_logger.h"
#include "titan/components/metrics/peak_flops.h"
#include "titan/components/optimizer.h"
#include "titan/components/profiling.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/loader.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/model_part.h"
#include "titan/distributed/pipeline/stages.h"
#include "titan/nn/model.h"
#include "titan/protocols/model_spec.h"

namespace titan {

struct StepResult {
  double loss = 0;       // global average loss over valid tokens
  double grad_norm = 0;  // total L2 norm before clipping
  double lr = 0;         // learning rate used by this step
  int64_t tokens = 0;    // tokens processed (all label positions)
  bool skipped = false;  // the loss or gradient norm was not finite: no update was applied
};

class Trainer {
 public:
  explicit Trainer(config::LoadedConfig loaded);
  ~Trainer();

  // The loop: steps until training.steps or a stop request (SIGINT/SIGTERM after the current step).
  // Returns the process exit code.
  int train();

  // One optimizer step over the given micro-batches, its results read at once (exposed for tests and tools; the
  // loop reads them only when it needs them).
  StepResult train_step(const std::vector<data::Batch>& microbatches);
  std::vector<data::Batch> next_microbatches();
  // Runs validation now (validation.steps batches, or one pass when -1) and logs it; returns the global mean
  // loss. Collective over the data-parallel ranks.
  double validate();

  nn::Model& model() { return *model_; }
  const protocols::ModelArgs& model_args() const { return *model_args_; }
  AdamW& optimizer() { return *optimizer_; }
  LRScheduler& lr_scheduler() { return *lr_scheduler_; }
  const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
  const config::JobConfig& config() const { return loaded_.config; }
  int64_t gradient_accumulation_steps() const { return grad_accum_steps_; }
  int64_t step() const { return step_; }
  const at::Device& device() const { return device_; }
  const distributed::DeviceMesh& mesh() const { return *mesh_; }
  // Every parameter as this rank holds it, over all its model parts (what the optimizer updates and where it lies
  // in the global tensor).
  const std::vector<distributed::ShardedParameter>& parameters() const { return parameters_; }
  // The parallelized model parts on this rank: the whole model, or its pipeline stages' parts (torchtitan's
  // model_parts).
  std::vector<distributed::ModelPart>& model_parts() { return pipeline_ ? pipeline_->parts() : whole_; }
  distributed::pipeline::Pipeline* pipeline() { return pipeline_.get(); }

 private:
  // A step launched on the device: its loss, gradient norm and non-finite flag stay there until settle() reads
  // them (with the fused optimizer, which skips a non-finite step on the device, that can wait).
  struct DeviceStep {
    int64_t step = 0, tokens = 0;
    double lr = 0;
    at::Tensor values;                  // float64 (3): loss, gradient norm, 1 where either is not finite
    at::Tensor host_values;             // on a GPU: their pinned host copy, complete once `ready` has passed
    std::shared_ptr<c10::Event> ready;
    std::optional<StepResult> settled;  // already read (an optimizer that decides on the host)
  };
  DeviceStep launch_step(const std::vector<data::Batch>& microbatches, int64_t global_valid_tokens);
  // Reads a step's values and keeps the count of non-finite steps; throws UserError when they stop the run.
  StepResult settle(const DeviceStep& step);
  std::optional<StepResult> settle_pending();  // the launched step not read yet, if any
  at::Tensor read_host_tensor(const at::Tensor& t);  // t on the host (counted when it was on a device)
  at::Tensor to_device(const at::Tensor& t);         // a batch tensor to the device without waiting for it
  static int64_t local_valid_tokens(const std::vector<data::Batch>& microbatches);
  struct Control {
    bool exhausted = false, save_failed = false;
    int signal = 0;            // the stop signal that reached some rank, or 0
    int64_t valid_tokens = 0;  // valid label tokens of the step's global batch
  };
  // The one control reduction of a step (on the host where the launcher gives an MPI world); every rank gets the same.
  Control exchange_control(bool exhausted, int64_t valid_tokens, int signal, bool save_failed);
  void log_step(const StepResult& result, double data_seconds);
  void finish_gradients();  // every part's data-parallel and tensor-parallel gradient reductions
  void check_memory(const distributed::ParallelDims& dims);
  void write_pipeline_timeline();
  // Logits of device inputs, or the summed loss when `labels` are given (the fused output projection and loss).
  at::Tensor forward(const at::Tensor& inputs, const data::Batch& batch, const at::Tensor& labels = {});

  config::LoadedConfig loaded_;
  at::Device device_{at::kCPU};
  distributed::LaunchInfo launch_;
  std::unique_ptr<distributed::DeviceMesh> mesh_;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  const protocols::ModelSpec* spec_ = nullptr;  // the family (models/registry.h)
  std::shared_ptr<const protocols::ModelArgs> model_args_;
  std::unique_ptr<protocols::StateDictAdapter> hf_adapter_;
  std::shared_ptr<nn::Model> model_;
  std::vector<distributed::ModelPart> whole_;  // without pipeline parallelism: one part, the whole model
  std::unique_ptr<distributed::pipeline::Pipeline> pipeline_;
  std::unique_ptr<distributed::ContextParallel> cp_;  // how batches are cut over the "cp" group (context parallelism)
  std::vector<distributed::ShardedParameter> parameters_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<LRScheduler> lr_scheduler_;
  std::unique_ptr<data::DataLoader> dataloader_;
  std::vector<data::SourceSpec> validation_sources_;
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_;
  checkpoint::TrainState train_state_;
  checkpoint::CheckpointedState checkpoint_view();
  bool block_causal_ = false;
  int64_t nonfinite_in_row_ = 0, nonfinite_total_ = 0;  // steps skipped for a NaN/inf loss or gradient norm
  std::optional<DeviceStep> unsettled_;                   // the last launched step, until read
  std::shared_ptr<distributed::Communicator> control_;     // the per-step control reduction's ranks (all of them)
  int64_t reads_at_once_ = 0, reads_a_step_later_ = 0, control_reductions_ = 0, device_reads_ = 0;
  int64_t steps_since_log_ = 0;
  std::unique_ptr<metrics::MemoryMonitor> memory_;
  std::unique_ptr<metrics::MetricLogger> metric_logger_;  // TensorBoard / JSONL
  std::unique_ptr<Profiler> profiler_;
  metrics::PeakFlops peak_;
  bool peak_remeasured_ = false;  // at most once per run (log_step)
  std::optional<at::ScalarType> autocast_dtype_;
  bool weight_casts_per_step_ = true;  // autocast's weight copies kept over the step (TITAN_WEIGHT_CASTS)
  double flops_per_token_ = 0;
  int64_t grad_accum_steps_ = 1;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  int64_t tokens_since_log_ = 0;
  double data_seconds_since_log_ = 0;
  double time_last_log_ = 0;
};

}  // namespace titan
