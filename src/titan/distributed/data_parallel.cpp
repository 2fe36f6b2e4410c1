#include "titan/distributed/data_parallel.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "titan/nn/torch_compat.h"

namespace titan::distributed {

NoDataParallel::~NoDataParallel() { *alive_ = false; }

void NoDataParallel::set_gradient_listener(GradientListener listener) {
  DataParallel::set_gradient_listener(std::move(listener));
  if (!accumulators_.empty()) return;
  // A parameter's accumulator runs its post-hooks once autograd has added the last contribution of this backward to
  // .grad: in the last micro-batch that gradient is the step's.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;  // never has a gradient: the optimizer skips it
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i, alive = alive_](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (*alive && last_microbatch_ && listener_) listener_({params_[i]});
          return outputs;
        }));
    accumulators_.push_back(std::make_shared<nn::GradAccumulatorHandle>(accumulator));
  }
}

}  // namespace titan::distributed
