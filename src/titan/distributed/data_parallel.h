// Data parallelism applied to a built model from outside: no wrapping for one process, DDP (replicated weights,
// bucketed gradient all-reduce overlapped with backward), FSDP (ZeRO-3 sharding) and HSDP (sharded within a
// group, replicated across groups). The trainer talks to all of them through this interface.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"

namespace titan::llama3 {
class Transformer;
}

namespace titan::distributed {

// A rank's part of one parameter, for checkpoints: rows [row_begin, row_begin + rows) of the global tensor sit in
// the first `rows` rows of `tensor` (FSDP pads the rest).
struct LocalShard {
  at::Tensor tensor;         // the tensor the optimizer updates (same order as optimizer_parameters())
  at::Tensor module_param;   // the model's parameter it belongs to (names come from the model)
  std::vector<int64_t> global_shape;
  int64_t row_begin = 0, rows = 0;
  bool writer = true;        // this rank holds the copy of these rows that a checkpoint writes
};

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  // Called before each micro-batch's backward; gradients are synchronised during the last one.
  virtual void before_backward(bool last_microbatch) = 0;
  // Called after each micro-batch's backward returns.
  virtual void after_backward() {}
  // After the last backward of a step: waits for outstanding communication and leaves final local gradients on
  // optimizer_parameters().
  virtual void finish_gradients() = 0;
  // The tensors the optimizer updates: the model's parameters, or this rank's shards of them.
  virtual std::vector<at::Tensor> optimizer_parameters() = 0;
  // Clips to max_norm by the global L2 norm of all gradients (across shards) and returns that norm before clipping.
  virtual at::Tensor clip_grad_norm(double max_norm) = 0;
  virtual std::string describe() const = 0;
  // Bytes sent into collectives by this rank so far, summed over the groups data parallelism uses.
  virtual int64_t bytes_communicated() const = 0;
  // Seconds the training thread spent blocked on data-parallel communication (parameter gathers, gradient
  // reductions), for the step-time breakdown.
  virtual double wait_seconds() const = 0;
  // Collective: make the model's parameters hold their full values (FSDP gathers them), and release them again.
  virtual void unshard_all() {}
  virtual void reshard_all() {}
  // This rank's parameter pieces, in optimizer_parameters() order.
  virtual std::vector<LocalShard> local_shards() = 0;
};

// Whole parameters as LocalShards (single process, DDP replicas).
std::vector<LocalShard> full_shards(const std::vector<at::Tensor>& params, bool writer);

struct FsdpOptions {
  at::ScalarType param_dtype = at::kFloat;   // all-gather and compute dtype (training.mixed_precision_param)
  at::ScalarType reduce_dtype = at::kFloat;  // gradient reduce-scatter dtype (training.mixed_precision_reduce)
  std::string reshard_after_forward = "default";  // parallelism.fsdp_reshard_after_forward
};

// The right wrapper for `dims`: FSDP/HSDP when dp_shard > 1, DDP when only dp_replicate > 1, a pass-through
// otherwise. DDP broadcasts rank 0's parameters; FSDP relies on every rank initialising the same model (the trainer
// broadcasts the seed) and shards it. Apply activation checkpointing first: its wrappers must sit inside FSDP's.
std::unique_ptr<DataParallel> apply_data_parallel(llama3::Transformer& model, const DeviceMesh& mesh,
                                                  const FsdpOptions& fsdp_options);

}  // namespace titan::distributed
