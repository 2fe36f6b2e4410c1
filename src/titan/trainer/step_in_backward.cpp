#include "titan/trainer/step_in_backward.h"

#include "titan/common/error.h"
#include "titan/distributed/grad_norm.h"
#include "titan/distributed/tensor_parallel.h"

namespace titan {

StepInBackward::StepInBackward(Adam& optimizer, const std::vector<distributed::ShardedParameter>& params)
    : optimizer_(optimizer), params_(params) {
  if (optimizer.parameters().size() != params.size())
    fail("internal: the optimizer holds ", optimizer.parameters().size(), " parameters, the model parts ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    index_[optimizer.parameters()[i].unsafeGetTensorImpl()] = i;
    after_tensor_parallel_sum_.push_back(distributed::summed_over(params[i], "tp"));
  }
}

void StepInBackward::on_gradients(const std::vector<at::Tensor>& locals) {
  std::vector<size_t> ready;
  for (const at::Tensor& t : locals) {
    auto it = index_.find(t.unsafeGetTensorImpl());
    if (it == index_.end()) fail("internal: a gradient was reported for a tensor the optimizer does not update");
    if (!after_tensor_parallel_sum_[it->second]) {
      ready.push_back(it->second);
    } else if (at::Tensor& grad = params_[it->second].local.mutable_grad(); grad.defined()) {
      // It waits for its sum over TP: its own copy, so that it does not keep the rest of a DDP bucket alive (the
      // gradients there are views of one flat buffer). These weights are small (norms, routers).
      grad = grad.clone();
    }
  }
  during_ += step(ready);
}

int64_t StepInBackward::step(const std::vector<size_t>& indices) {
  at::NoGradGuard no_grad;
  std::vector<size_t> with_grad;
  for (size_t i : indices) {
    if (!params_[i].local.grad().defined()) continue;
    at::Tensor squares = distributed::owned_grad_squares(params_[i]);
    squares_ = squares_.defined() ? squares_ + squares : squares;
    with_grad.push_back(i);
  }
  if (with_grad.empty()) return 0;
  optimizer_.step_some(with_grad);
  // As torchtitan's hook (step, then zero_grad): the gradient's memory is free for the rest of backward.
  for (size_t i : with_grad) params_[i].local.mutable_grad() = at::Tensor();
  return static_cast<int64_t>(with_grad.size());
}

at::Tensor StepInBackward::finish(distributed::Communicator& world) {
  std::vector<size_t> all(params_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  last_after_ = step(all);
  last_during_ = during_;
  during_ = 0;
  at::Tensor squares = squares_.defined()
                           ? squares_
                           : at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(params_.empty() ? at::kCPU : params_[0].local.device()));
  squares_ = at::Tensor();
  return distributed::global_norm(squares, world);
}

}  // namespace titan
