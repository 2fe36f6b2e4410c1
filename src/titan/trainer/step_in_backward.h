// optimizer.early_step_in_backward (torchtitan's optimizers in backward): each parameter is updated as soon as its
// gradient for the step is final, and that gradient freed, so the step never holds every gradient at once.
#pragma once
#include <ATen/ATen.h>

#include <unordered_map>
#include <vector>

#include "titan/components/optimizer.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/sharded_parameter.h"

namespace titan {

class StepInBackward {
 public:
  // `params` are the optimizer's parameters, in its order; both outlive this object.
  StepInBackward(Adam& optimizer, const std::vector<distributed::ShardedParameter>& params);

  // The data parallelisms' listener (distributed/data_parallel.h): steps those of `locals` whose gradient is final,
  // adding its square to the step's norm. Weights replicated over tensor-parallel ranks wait for finish(): their
  // gradients are summed over those ranks after data parallelism is done.
  void on_gradients(const std::vector<at::Tensor>& locals);
  // After the model parts' finish_gradients(): steps every parameter that still holds a gradient, and returns the
  // step's global gradient norm (float32 scalar, unclipped). Collective over `world`.
  at::Tensor finish(distributed::Communicator& world);
  // Of the last finished step's parameter tensors on this rank: how many were updated during backward, and how many
  // only in finish() (after the last reductions: tensor-parallel sums, the last unit's gradients).
  int64_t stepped_during_backward() const { return last_during_; }
  int64_t stepped_after_backward() const { return last_after_; }

 private:
  int64_t step(const std::vector<size_t>& indices);  // returns how many it stepped

  Adam& optimizer_;
  const std::vector<distributed::ShardedParameter>& params_;
  std::unordered_map<const c10::TensorImpl*, size_t> index_;
  std::vector<bool> after_tensor_parallel_sum_;
  at::Tensor squares_;  // float64 scalar: this rank's owned gradient squares stepped so far this step
  int64_t during_ = 0, last_during_ = 0, last_after_ = 0;
};

}  // namespace titan
