// The decoders' parallelization plan (Llama 3, Qwen3), as torchtitan's models/llama3/infra/parallelize.py and
// models/qwen3/infra/parallelize.py: context parallelism, tensor + sequence parallelism (loss parallel by default;
// Qwen3's q/k norms replicated), activation checkpointing, then FSDP/HSDP or DDP, applied in that order from
// outside to a model that may be built without storage. The generic styles live in distributed/.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/activation_checkpoint.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/distributed/model_part.h"
#include "titan/models/common/decoder.h"

namespace titan::models {

// Async TP's batch slices per attention / feed-forward call (fewer when the local batch is smaller).
constexpr int64_t kAsyncTensorParallelSlices = 4;

using distributed::ModelPart;
using distributed::ModuleRange;

// The block indices a range of the forward order holds.
std::vector<int64_t> block_indices(const ModuleRange& range, int64_t n_layers);

// Throws UserError naming the numbers when the model cannot be split over `tp` ranks: query heads, key/value
// heads, the feed-forward width, the vocabulary and every sequence length (name -> length) must divide by it.
// `degree` names the setting in the message.
void check_tensor_parallel(const DecoderArgs& args, int64_t tp, const std::vector<std::pair<std::string, int64_t>>& seq_lens,
                           const std::string& degree = "parallelism.tensor_parallel_degree");
// Every check of the layout against the model and the configuration, before anything is built or communicated
// (so that all ranks fail the same way, without a hang): TP divisibility, options TP cannot run, tied
// embeddings under FSDP.
void check_parallelism(const DecoderArgs& args, const distributed::ParallelDims& dims, const config::JobConfig& config);

// torchtitan's modes: full (every block), selective N (every N-th block), selective "op" (every block, keeping
// attention's output and every other linear's: nn/kept_ops.h). Throws UserError for memory_budget (needs a graph
// compiler).
distributed::ActivationCheckpointSummary apply_activation_checkpointing(Decoder& model, const ModuleRange& part,
                                                                         const config::ActivationCheckpoint& ac);

// TP over mesh "tp" (when > 1), activation checkpointing, then data parallelism over the mesh, applied to the
// modules of `part` (each pipeline stage's part is parallelized on its own, as torchtitan's model_parts). The model
// may be built without storage (on fsdp.device, in fsdp.shard_dtype): each rank then allocates only its pieces,
// whose values are set afterwards by distributed::initialize or a checkpoint load. `split_backward` (zero-bubble
// schedules) makes the blocks' matmul weight gradients deferrable (distributed/pipeline/zero_bubble.h).
// `cp`: the job's one ContextParallel under context parallelism (made here when null).
ModelPart parallelize(Decoder& model, const distributed::DeviceMesh& mesh, const config::JobConfig& config,
                      const distributed::FsdpOptions& fsdp, const ModuleRange& part, bool split_backward = false,
                      std::shared_ptr<distributed::ContextParallel> cp = nullptr);

// Tensor parallelism for sampling (titan generate) over `group`, as torchtitan's generation script applies it:
// the training plan without sequence parallelism, so that each rank holds its share of the heads, of the
// feed-forward (and experts') hidden units and of the vocabulary, every activation between them whole, and the
// logits gathered on every rank. A model built without storage stays without (allocate each rank's slices with
// distributed::materialize); one with storage keeps its slices of it. Returns every parameter with its placement.
// Throws UserError naming the numbers that do not divide by the group's size. Nothing is communicated here.
std::vector<distributed::ShardedParameter> parallelize_for_sampling(Decoder& model, std::shared_ptr<distributed::Communicator> group);

}  // namespace titan::models
