// Deferred weight gradients, for the zero-bubble pipeline schedules' split backward
// (distributed/pipeline/zero_bubble.h): while a target is installed (a stage's input-gradient step), a linear's
// backward hands over how to compute its weight's gradient instead of computing it, and the schedule's weight step
// runs it later. Every kind of linear meets it here: LibTorch's (the pipeline's deferrable linear), float8's and
// MXFP8's (nn/float8.h), whose weight gradients are their recipes' own products.
#pragma once
#include <ATen/ATen.h>

#include <functional>

namespace titan::nn {

class WeightGradientTarget {
 public:
  virtual ~WeightGradientTarget() = default;
  // `compute` makes `weight`'s gradient (its dtype) from what the backward kept.
  virtual void defer(const at::Tensor& weight, std::function<at::Tensor()> compute) = 0;
};

// Installs `target` (null: none). One at a time: installing over another is an internal error. Set by the
// training thread around an input-gradient step, read by autograd (which on GPUs runs backward on a device thread).
void install_weight_gradient_target(WeightGradientTarget* target);

// A linear's backward: hands `compute` to the installed target and returns true, or returns false when none is
// installed (the caller computes the gradient now).
bool defer_weight_gradient(const at::Tensor& weight, const std::function<at::Tensor()>& compute);

}  // namespace titan::nn
