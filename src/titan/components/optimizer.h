// Adam / AdamW over a list of parameters with PyTorch's update rule and its three kernel paths: "fused" (one
// fused kernel per step, as torch.optim fused=True), "foreach" (horizontally fused ops) and "for-loop".
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "titan/config/job_config.h"

namespace titan {

// One class for both: Adam, and AdamW when the weight decay is decoupled (optimizer.name = "AdamW").
class Adam {
 public:
  // config.name "AdamW": decoupled weight decay; "Adam": weight decay added to the gradient.
  Adam(std::vector<at::Tensor> parameters, const config::Optimizer& config);

  void zero_grad();
  void step();
  // The fused kernel can skip a step on the device: step(skip) applies nothing (not even the step count) where
  // `skip` (a float32 scalar on the parameters' device) is 1, without the host reading it.
  bool skips_on_device() const { return implementation_ == "fused"; }
  void step(const at::Tensor& skip);
  // Steps only the parameters at these indices into parameters() that hold gradients (an update during backward,
  // optimizer.early_step_in_backward). Adam works element by element: stepping a parameter alone gives bitwise what
  // stepping it with the others gives.
  void step_some(const std::vector<size_t>& indices);
  void set_lr(double lr) { lr_ = lr; }
  double lr() const { return lr_; }

  const std::vector<at::Tensor>& parameters() const { return params_; }
  // Optimizer state per parameter: created by init_state() (the trainer does it before the first step) or else on the
  // first step, as PyTorch does.
  struct State {
    at::Tensor step;  // float32 scalar
    at::Tensor exp_avg, exp_avg_sq;
  };
  const std::vector<State>& state() const { return state_; }
  std::vector<State>& mutable_state() { return state_; }
  // Creates the zero state of parameters that have none yet (step() does it lazily; loading a checkpoint first).
  void init_state();

 private:
  void step_indices(const std::vector<size_t>& indices, const at::Tensor& skip);

  std::vector<at::Tensor> params_;
  std::vector<State> state_;
  bool all_state_ = false;  // every parameter has its state (set by init_state)
  double lr_, beta1_, beta2_, eps_, weight_decay_;
  bool decoupled_;
  std::string implementation_;
};

}  // namespace titan
