// Pipeline parallelism for any registered family, as torchtitan's distributed/pipeline_parallel.py: the model's
// forward order is cut into stages (torchtitan's layer assignment, or parallelism.module_fqns_per_model_part), each
// rank parallelizes the parts its stages hold with the family's parallelize function (TP, CP, AC, FSDP/DDP per
// part), and a schedule (distributed/pipeline/schedule.h) runs the micro-batches.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/model_part.h"
#include "titan/distributed/pipeline/runner.h"

namespace titan::distributed::pipeline {

// torchtitan's generate_llm_fqn_per_model_part: `stages` lists of module names, the embedding counted as
// `input_weight` layers and norm + output as `output_weight`, layers spread as evenly as that allows (earlier
// stages take the remainder). Throws UserError naming the numbers when a stage would be empty.
std::vector<std::vector<std::string>> split_module_names(int64_t stages, int64_t n_layers, int64_t input_weight, int64_t output_weight);

struct StagePlan {
  std::vector<std::vector<std::string>> names;  // per stage
  std::vector<ModuleRange> ranges;              // per stage, into the model's module_names()
  int64_t stages_per_rank = 1;
  std::string schedule;                         // canonical schedule name
  bool v_shape = false, split_backward = false;
  int64_t microbatches = 1;                     // per local batch
  std::optional<Schedule> actions;              // the schedule built and checked for these stages
};

// The stages for this configuration (torchtitan's rules for their number: pipeline_parallel_layers_per_stage, or 1
// per rank for single-stage schedules and 2 for the others), checked before anything is built: every module exactly
// once, in forward order, no stage empty, tied embeddings on one stage, the micro-batch count the schedule needs.
// The forward order is tok_embeddings, layers.0 .. layers.{n_layers - 1}, norm, output; `tied_embeddings`: the output
// reads the embedding's table, so the two share a stage.
StagePlan plan_stages(int64_t n_layers, bool tied_embeddings, const config::JobConfig& config, int64_t pp);

// This rank's stages of a pipelined model and the schedule runner that drives them.
class Pipeline {
 public:
  // `parallelize` is the family's (ModelSpec::parallelize bound to the job's configuration); `cp`, under context
  // parallelism, the one ContextParallel the parts' attention also uses.
  Pipeline(nn::Model& model, int64_t n_layers, bool tied_embeddings, const ParallelizeFunction& parallelize,
           const DeviceMesh& mesh, const config::JobConfig& config, const FsdpOptions& fsdp,
           std::optional<at::ScalarType> autocast_dtype, std::shared_ptr<ContextParallel> cp);

  // One local batch through the schedule with gradients: `tokens`, `labels` and (block-causal) `document_positions`
  // (batch, seq) are cut into micro-batches; each micro-batch's loss sum is divided by `global_valid`. Returns the
  // sum of those losses on this rank (zero unless it holds the last stage), a float64 scalar on the device.
  at::Tensor train(const at::Tensor& tokens, const at::Tensor& labels, const at::Tensor& document_positions, double global_valid,
                   int64_t step);
  // Forward only: the cross-entropy sum of the batch on the last stage's rank (zero elsewhere), on the device.
  at::Tensor evaluate(const at::Tensor& tokens, const at::Tensor& labels, const at::Tensor& document_positions);

  std::vector<ModelPart>& parts() { return parts_; }
  const StagePlan& plan() const { return plan_; }
  PipelineRunner& runner() { return *runner_; }
  const at::Device& device() const { return device_; }
  std::vector<std::string> describe() const;

 private:
  void set_batch(const at::Tensor& tokens, const at::Tensor& labels, const at::Tensor& document_positions, int64_t microbatch_size);
  nn::Model& model_;
  StagePlan plan_;
  std::vector<int> stage_of_part_;
  std::vector<ModelPart> parts_;
  std::unique_ptr<PipelineRunner> runner_;
  std::optional<at::ScalarType> autocast_dtype_;
  int64_t microbatch_size_ = 1, seq_len_ = 0;
  int64_t trained_seq_len_ = -1;  // of the last training batch: activations keep their shape while it stays
  std::vector<at::Tensor> tokens_, labels_, positions_;
  std::shared_ptr<ContextParallel> cp_;  // cuts every sequence over the "cp" group (context parallelism)
  at::Tensor rope_positions_;                         // under CP: this rank's global positions
  at::Device device_;
};

}  // namespace titan::distributed::pipeline
