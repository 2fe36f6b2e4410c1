#include "titan/distributed/pipeline/zero_bubble.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>


#include "titan/common/error.h"
#include "titan/nn/kept_ops.h"
#include "titan/nn/matmul.h"

namespace titan::distributed::pipeline {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `kept`: empty, or the output of the same call in forward (op-level selective checkpointing), returned as it is.
struct DeferrableLinear : torch::autograd::Function<DeferrableLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& kept) {
    ctx->save_for_backward({x, weight});
    if (kept.numel() > 0) return kept;
    return nn::linear(x, weight);  // under autocast in the compute dtype, as nn::Linear
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& dy = grads[0];
    at::Tensor dx = nn::matmul(dy, weight.to(dy.scalar_type())).to(x.scalar_type());
    const auto dw = [x, dy, dtype = weight.scalar_type()] {
      return nn::matmul(dy.reshape({-1, dy.size(-1)}).t(), x.reshape({-1, x.size(-1)}).to(dy.scalar_type())).to(dtype);
    };
    if (nn::defer_weight_gradient(weight, dw)) return {dx, at::Tensor(), at::Tensor()};
    return {dx, dw(), at::Tensor()};
  }
};

}  // namespace

DeferredWeights::Capture::Capture(DeferredWeights& target) { nn::install_weight_gradient_target(&target); }

DeferredWeights::Capture::~Capture() { nn::install_weight_gradient_target(nullptr); }

void DeferredWeights::apply() {
  // One weight at a time: its deferred products summed (a weight used twice accumulates once, so its accumulator and
  // hooks run once per weight step), landed through its gradient accumulator, and freed before the next weight's are
  // made. Each entry's operands are released as soon as it has run, so the step holds one weight's gradient and
  // what the remaining entries read, never the whole stage's weight gradients at once.
  std::vector<Entry> entries = std::move(entries_);
  entries_.clear();
  std::vector<bool> done(entries.size(), false);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (done[i]) continue;
    const at::Tensor weight = entries[i].weight;
    at::Tensor dw;
    {
      at::NoGradGuard no_grad;  // the products themselves record no graph (their inputs may require gradients)
      for (size_t j = i; j < entries.size(); ++j) {
        if (done[j] || !entries[j].weight.is_same(weight)) continue;
        at::Tensor part = entries[j].compute();
        entries[j] = Entry{};
        done[j] = true;
        if (dw.defined()) dw.add_(part);
        else dw = std::move(part);
      }
    }
    torch::autograd::backward({weight}, {dw.to(weight.scalar_type())});
  }
}

void defer_weight_gradient(nn::Linear& linear) {
  nn::Linear* self = &linear;
  linear.add_innermost_wrapper("zero_bubble", [self](const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next&) {
    const at::Tensor& x = inputs[0];
    if (!context.kept_ops || self->recompute_under_op_checkpointing)
      return DeferrableLinear::apply(x, self->weight, at::empty({0}, x.options()));
    return context.kept_ops->product([&](const at::Tensor& kept) {
      return DeferrableLinear::apply(x, self->weight, kept.defined() ? kept : at::empty({0}, x.options()));
    });
  });
}

}  // namespace titan::distributed::pipeline
