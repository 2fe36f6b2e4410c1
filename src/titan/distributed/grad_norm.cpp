#include "titan/distributed/grad_norm.h"


namespace titan::distributed {

at::Tensor owned_grad_squares(const ShardedParameter& p) {
  at::NoGradGuard no_grad;
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(p.local.device()));
  if (!p.layout.owner() || !p.local.grad().defined()) return total;
  at::Tensor g = unpadded(p.local.grad(), p.layout);
  if (g.numel() == 0) return total;
  at::Tensor rows = g.dim() == 0 ? g.reshape({1, 1}) : g.reshape({g.size(0), -1});
  at::Tensor row_norms = at::linalg_vector_norm(rows, 2, /*dim=*/{1}, /*keepdim=*/false, at::kFloat);
  return total + row_norms.to(at::kDouble).pow(2).sum();
}

at::Tensor owned_grad_squares(const std::vector<ShardedParameter>& params) {
  at::NoGradGuard no_grad;
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(params.empty() ? at::kCPU : params[0].local.device()));
  for (const auto& p : params)
    if (p.layout.owner() && p.local.grad().defined()) total += owned_grad_squares(p);
  return total;
}

at::Tensor global_norm(const at::Tensor& squares, Communicator& world) {
  at::NoGradGuard no_grad;
  // The norm stays on the gradients' device; it visits the communicator's device only for the reduction (the
  // same device with NCCL, MPI and the local communicator of a one-GPU job, so no copy and no host sync there).
  at::Tensor sum = squares;
  if (world.size() > 1) {
    at::Tensor buffer = squares.reshape({1}).to(world.tensor_device()).contiguous();
    world.all_reduce(buffer, ReduceOp::Sum);
    sum = buffer.to(squares.device()).reshape({});
  }
  return sum.sqrt().to(at::kFloat);
}

at::Tensor clip_grad_norm(const std::vector<ShardedParameter>& params, double max_norm, Communicator& world) {
  at::NoGradGuard no_grad;
  at::Tensor total = global_norm(owned_grad_squares(params), world);
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.local.grad().defined()) grads.push_back(p.local.grad());
  scale_gradients_(grads, total, max_norm);
  return total;
}

void scale_gradients_(const std::vector<at::Tensor>& grads, const at::Tensor& total_norm, double max_norm) {
  at::NoGradGuard no_grad;
  if (grads.empty()) return;
  at::Tensor coef = at::clamp(max_norm / (total_norm + 1e-6), std::nullopt, 1.0);
  at::_foreach_mul_(grads, coef);
}

}  // namespace titan::distributed
