// The LibTorch API differences between the versions titan builds against (2.11 to 2.15), in one place.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace titan::nn {

// What holds a leaf tensor's gradient accumulator alive: std::shared_ptr<Node> in LibTorch 2.11,
// c10::intrusive_ptr<Node> in later versions.
using GradAccumulatorHandle =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::autograd::Variable&>()));

}  // namespace titan::nn
