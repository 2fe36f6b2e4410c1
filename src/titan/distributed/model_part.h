// One model part as the trainer holds it after parallelization (torchtitan's model_parts): the whole model, or one
// pipeline stage's contiguous run of its forward order, with the sharded parameters the optimizer, clipping and
// checkpoints work on, its data parallelism and its loss.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/nn/model.h"

namespace titan::distributed {

// Cross-entropy summed over valid tokens (float32) of the logits the parallelized model's forward returns:
// whole-vocabulary logits, or this rank's vocabulary shard under loss parallelism.
using LossFunction = std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& labels)>;

// A contiguous run [begin, end) of a model's forward order (nn::Model::module_names()): the whole model, or one
// pipeline stage's part of it.
struct ModuleRange {
  int64_t begin = 0, end = 0;
  bool contains(int64_t module) const { return begin <= module && module < end; }
  static ModuleRange whole(const nn::Model& model) { return ModuleRange{0, model.module_count()}; }
};

struct ModelPart {
  std::vector<ShardedParameter> parameters;  // what the optimizer, clipping and checkpoints work on
  std::unique_ptr<DataParallel> data_parallel;
  LossFunction loss;
  // The fused output projection and loss (training.fused_kernels, unless TP gathers the logits): the model's forward
  // takes the labels and returns the summed loss itself, and `loss` is not used.
  bool loss_in_forward = false;
  // The summed loss of a forward's result: that result under the fused loss, else `loss` of its logits.
  at::Tensor loss_sum(const at::Tensor& output, const at::Tensor& labels) const { return loss_in_forward ? output : loss(output, labels); }
  std::vector<std::string> description;  // one line per parallelism, for the start-up log
  // A pipeline stage after the first: the dtype and this rank's sizes of the hidden state the part's first module
  // takes, for `rows` sequences of `seq_len` tokens (the previous stage's output). Every real first message between
  // stages is checked against it; the fake backend, where nothing arrives, builds its stand-ins from it.
  std::function<std::pair<at::ScalarType, std::vector<int64_t>>(int64_t rows, int64_t seq_len)> input_shape;
  std::shared_ptr<Communicator> tp_group;  // null without tensor parallelism
  // State that is not trained but checkpointed with the weights (MoE balancing biases): whole on every rank that
  // holds it, replicated over the mesh (the layout says which rank writes it); `local` is the buffer itself.
  std::vector<ShardedParameter> buffers;
  // After the last backward of a step, before the optimizer step (MoE balancing): `update` does the part's work and
  // returns figures for the step's log, a float64 vector on the device that is read with the loss; every part of the
  // model returns one of the same length, and the model's figures are their element-wise maximum over the parts and
  // the pipeline ranks. `scalars` names them for TensorBoard and `summary` words them for the log line. Unset for
  // most models.
  struct StepHook {
    std::function<at::Tensor()> update;
    std::function<std::vector<std::pair<std::string, double>>(const at::Tensor& figures)> scalars;
    std::function<std::string(const at::Tensor& figures)> summary;
  };
  std::optional<StepHook> before_optimizer_step;

  // After the last backward of a step: data-parallel reductions, then the sum over TP ranks of the gradients of
  // weights replicated across them.
  void finish_gradients();
};

// How a family parallelizes one part of its model (torchtitan's parallelize_fn): TP, CP, activation checkpointing
// and data parallelism over `mesh`, applied to the modules of `part`. `split_backward` (zero-bubble schedules)
// makes the part's matmul weight gradients deferrable (distributed/pipeline/zero_bubble.h).
using ParallelizeFunction = std::function<ModelPart(nn::Model& model, const DeviceMesh& mesh, const FsdpOptions& fsdp,
                                                    const ModuleRange& part, bool split_backward)>;

}  // namespace titan::distributed
