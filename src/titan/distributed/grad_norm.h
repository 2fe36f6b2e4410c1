// Gradient clipping over sharded parameters: the global L2 norm across every mesh dimension, each element of
// the global gradient counted once (replicated copies only on their owner), equal to one process's norm.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/sharded_parameter.h"

namespace titan::distributed {

// Sum of squares of this rank's owned gradient pieces (float64 scalar). Each tensor's rows are reduced in float32
// first (keeps rounding near 1e-7 for large tensors), and the partial sums are added in float64.
at::Tensor owned_grad_squares(const std::vector<ShardedParameter>& params);
// The same for one parameter: zero where this rank does not own its piece or it has no gradient.
at::Tensor owned_grad_squares(const ShardedParameter& param);
// The global norm (float32 scalar on `squares`' device) from each rank's sum of squares: one all-reduce over `world`.
at::Tensor global_norm(const at::Tensor& squares, Communicator& world);

// Scales every local gradient so that the global norm is at most max_norm (coefficient max_norm / (norm + 1e-6),
// at most 1, as PyTorch's clip_grad_norm_) and returns the norm before clipping (float32 scalar on the gradients'
// device, whatever `world`'s device is). Collective over `world`: one all-reduce of one value.
at::Tensor clip_grad_norm(const std::vector<ShardedParameter>& params, double max_norm, Communicator& world);

// Scales gradients so that their global L2 norm (already reduced across ranks) is at most max_norm: coefficient
// max_norm / (norm + 1e-6), at most 1, as PyTorch's clip_grad_norm_.
void scale_gradients_(const std::vector<at::Tensor>& grads, const at::Tensor& total_norm, double max_norm);

}  // namespace titan::distributed
