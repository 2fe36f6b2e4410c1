// How one step's micro-batches run through this rank's model parts: a single stage (the whole model, gradient
// accumulation over micro-batches) or the pipeline (each local batch cut into micro-batches for the schedule). Each
// implementation writes the path batch -> device -> context-parallel split -> autocast -> forward -> loss once, for
// training and validation alike.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "titan/components/data/dataloader.h"
#include "titan/config/job_config.h"
#include "titan/distributed/model_part.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/pipeline/stages.h"
#include "titan/nn/model.h"
#include "titan/protocols/model_spec.h"

namespace titan {

class StepSchedule {
 public:
  virtual ~StepSchedule() = default;
  // Forward and backward of the step's micro-batches, each one's loss sum divided by `global_valid` (the step's
  // valid label tokens over all ranks); returns this rank's share of the step loss, float32 (1) on the device.
  virtual at::Tensor train(const std::vector<data::Batch>& microbatches, double global_valid, int64_t step) = 0;
  // Adds up the step loss over the ranks that computed parts of it beside the data-parallel ones (the last stage's).
  virtual void gather_loss(at::Tensor& loss_total) = 0;
  // After the step's last backward: every part's data-parallel and tensor-parallel gradient reductions.
  virtual void finish_gradients() = 0;
  // The cross-entropy sum of one batch without gradients, over this rank's context-parallel and pipeline groups.
  virtual double evaluate(const data::Batch& batch) = 0;
  virtual std::vector<distributed::ModelPart>& parts() = 0;
  virtual distributed::pipeline::Pipeline* pipeline() { return nullptr; }
  virtual std::vector<std::string> describe() const = 0;
};

// The schedule for the mesh: pipelined when it has a pipeline dimension, else one stage; each part parallelized
// with the family's plan (spec.parallelize).
std::unique_ptr<StepSchedule> make_step_schedule(nn::Model& model, const protocols::ModelSpec& spec,
                                                 const protocols::ModelArgs& args, const distributed::DeviceMesh& mesh,
                                                 const config::JobConfig& config, const distributed::FsdpOptions& fsdp,
                                                 std::optional<at::ScalarType> autocast_dtype);

}  // namespace titan
