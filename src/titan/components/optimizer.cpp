#include "titan/components/optimizer.h"

#include <cmath>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan {

Adam::Adam(std::vector<at::Tensor> parameters, const config::Optimizer& c)
    : params_(std::move(parameters)), lr_(c.lr), beta1_(c.beta1), beta2_(c.beta2), eps_(c.eps),
      weight_decay_(c.weight_decay), decoupled_(c.name == "AdamW"), implementation_(c.implementation) {}

void Adam::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
}

void Adam::init_state() {
  // Cheap when done: steps in backward call it once per parameter.
  if (all_state_ && state_.size() == params_.size()) return;
  state_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (state_[i].exp_avg.defined()) continue;
    // The fused kernel reads the step on the device; the other paths read it on the host (no device sync).
    const at::Device step_device = implementation_ == "fused" ? params_[i].device() : at::Device(at::kCPU);
    state_[i].step = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(step_device));
    state_[i].exp_avg = at::zeros_like(params_[i], at::MemoryFormat::Preserve);
    state_[i].exp_avg_sq = at::zeros_like(params_[i], at::MemoryFormat::Preserve);
  }
  all_state_ = true;
}

void Adam::step() { step(at::Tensor()); }

void Adam::step(const at::Tensor& skip) {
  std::vector<size_t> all(params_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  step_indices(all, skip);
}

void Adam::step_some(const std::vector<size_t>& indices) { step_indices(indices, at::Tensor()); }

void Adam::step_indices(const std::vector<size_t>& indices, const at::Tensor& skip) {
  if (skip.defined() && !skips_on_device())
    fail("internal: optimizer.implementation = ", quote(implementation_), " cannot skip a step on the device");
  at::NoGradGuard no_grad;
  init_state();
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  for (size_t i : indices) {
    if (!params_[i].grad().defined()) continue;
    params.push_back(params_[i]);
    grads.push_back(params_[i].grad());
    exp_avgs.push_back(state_[i].exp_avg);
    exp_avg_sqs.push_back(state_[i].exp_avg_sq);
    steps.push_back(state_[i].step);
  }
  if (params.empty()) return;

  if (implementation_ == "fused") {
    // found_inf: the kernel leaves everything as it was; the step count is not advanced either.
    std::optional<at::Tensor> found_inf;
    if (skip.defined()) {
      found_inf = skip.to(params[0].device(), at::kFloat).reshape({});
      at::_foreach_add_(steps, 1 - *found_inf);
    } else {
      at::_foreach_add_(steps, 1);
    }
    if (decoupled_)
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr_, beta1_, beta2_,
                        weight_decay_, eps_, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, found_inf);
    else
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr_, beta1_, beta2_,
                       weight_decay_, eps_, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, found_inf);
    return;
  }

  if (implementation_ == "foreach") {
    at::_foreach_add_(steps, 1);
    if (weight_decay_ != 0) {
      if (decoupled_) at::_foreach_mul_(params, 1 - lr_ * weight_decay_);
      else grads = at::_foreach_add(grads, params, weight_decay_);
    }
    at::_foreach_lerp_(exp_avgs, grads, 1 - beta1_);
    at::_foreach_mul_(exp_avg_sqs, beta2_);
    at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2_);
    std::vector<double> step_sizes, bias2_sqrt;
    for (auto& s : steps) {
      const double t = s.item<double>();
      step_sizes.push_back(-lr_ / (1 - std::pow(beta1_, t)));
      bias2_sqrt.push_back(std::sqrt(1 - std::pow(beta2_, t)));
    }
    auto denom = at::_foreach_sqrt(exp_avg_sqs);
    at::_foreach_div_(denom, at::ArrayRef<at::Scalar>(std::vector<at::Scalar>(bias2_sqrt.begin(), bias2_sqrt.end())));
    at::_foreach_add_(denom, eps_);
    at::_foreach_addcdiv_(params, exp_avgs, denom,
                          at::ArrayRef<at::Scalar>(std::vector<at::Scalar>(step_sizes.begin(), step_sizes.end())));
    return;
  }

  for (size_t i = 0; i < params.size(); ++i) {
    steps[i].add_(1);
    const double t = steps[i].item<double>();
    at::Tensor grad = grads[i];
    if (weight_decay_ != 0) {
      if (decoupled_) params[i].mul_(1 - lr_ * weight_decay_);
      else grad = grad.add(params[i], weight_decay_);
    }
    exp_avgs[i].lerp_(grad, 1 - beta1_);
    exp_avg_sqs[i].mul_(beta2_).addcmul_(grad, grad, 1 - beta2_);
    const double step_size = lr_ / (1 - std::pow(beta1_, t));
    at::Tensor denom = (exp_avg_sqs[i].sqrt() / std::sqrt(1 - std::pow(beta2_, t))).add_(eps_);
    params[i].addcdiv_(exp_avgs[i], denom, -step_size);
  }
}

}  // namespace titan
