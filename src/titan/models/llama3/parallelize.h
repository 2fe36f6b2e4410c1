// The Llama 3 parallelization plan, as torchtitan's models/llama3/infra/parallelize.py: tensor + sequence
// parallelism (loss parallel by default), activation checkpointing, then FSDP/HSDP or DDP, applied in that order
// from outside to a model that may be built on the meta device. The generic styles live in distributed/.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/activation_checkpoint.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/models/llama3/model.h"

namespace titan::llama3 {

// Cross-entropy summed over valid tokens (float32) of the logits the parallelized model's forward returns:
// whole-vocabulary logits, or this rank's vocabulary shard under loss parallelism.
using LossFunction = std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& labels)>;

// Async TP's batch slices per attention / feed-forward call (fewer when the local batch is smaller).
constexpr int64_t kAsyncTensorParallelSlices = 4;

// A contiguous run [begin, end) of the forward order tok_embeddings, layers.0 .. layers.{n-1}, norm, output
// (Transformer::module_names()): the whole model, or one pipeline stage's part of it.
struct ModuleRange {
  int64_t begin = 0, end = 0;
  bool contains(int64_t module) const { return begin <= module && module < end; }
  std::vector<int64_t> layers(const Transformer& model) const;  // the block indices inside
  static ModuleRange whole(const Transformer& model);
};

struct ParallelModel {
  std::vector<distributed::ShardedParameter> parameters;  // what the optimizer, clipping and checkpoints work on
  std::unique_ptr<distributed::DataParallel> data_parallel;
  LossFunction loss;
  // The fused output projection and loss (training.fused_kernels, unless TP gathers the logits): the model's forward
  // takes the labels and returns the summed loss itself (Transformer::forward), and `loss` is not used.
  bool fused_loss = false;
  // The summed loss of a forward's result: that result under the fused loss, else `loss` of its logits.
  at::Tensor loss_sum(const at::Tensor& output, const at::Tensor& labels) const { return fused_loss ? output : loss(output, labels); }
  std::vector<std::string> description;  // one line per parallelism, for the start-up log
  std::shared_ptr<distributed::Communicator> tp_group;  // null without tensor parallelism

  // After the last backward of a step: data-parallel reductions, then the sum over TP ranks of the gradients of
  // weights replicated across them.
  void finish_gradients();
};

// Throws UserError naming the numbers when the model cannot be split over `tp` ranks: query heads, key/value
// heads, the feed-forward width, the vocabulary and every sequence length (name -> length) must divide by it.
void check_tensor_parallel(const ModelArgs& args, int64_t tp, const std::vector<std::pair<std::string, int64_t>>& seq_lens);
// Every check of the layout against the model and the configuration, before anything is built or communicated
// (so that all ranks fail the same way, without a hang): TP divisibility, options TP cannot run, tied
// embeddings under FSDP.
void check_parallelism(const ModelArgs& args, const distributed::ParallelDims& dims, const config::JobConfig& config);

// torchtitan's modes: full (every block), selective N (every N-th block), selective "op" (RMSNorm and the SwiGLU
// gating recomputed). Throws UserError for memory_budget (needs a graph compiler).
distributed::ActivationCheckpointSummary apply_activation_checkpointing(Transformer& model, const ModuleRange& part,
                                                                         const config::ActivationCheckpoint& ac);

// TP over mesh "tp" (when > 1), activation checkpointing, then data parallelism over the mesh, applied to the
// modules of `part` (each pipeline stage's part is parallelized on its own, as torchtitan's model_parts). The model
// may be built without storage (on fsdp.device, in fsdp.shard_dtype): each rank then allocates only its pieces,
// whose values are set afterwards by distributed::initialize or a checkpoint load. `split_backward` (zero-bubble
// schedules) makes the blocks' matmul weight gradients deferrable (distributed/pipeline/zero_bubble.h).
ParallelModel parallelize(Transformer& model, const distributed::DeviceMesh& mesh, const config::JobConfig& config,
                          const distributed::FsdpOptions& fsdp, const ModuleRange& part, bool split_backward = false);

}  // namespace titan::llama3
