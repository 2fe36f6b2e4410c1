// The zero-bubble split of backward: linear layers whose weight gradient can be deferred. During an input-gradient
// pass (a DeferredWeights::Capture is alive) they compute only the gradient of their input and hand over how to make
// the weight's (nn/weight_gradients.h: LibTorch's linears from their input and output gradient, float8 and MXFP8
// linears by their recipes); the schedule's weight step later makes it and accumulates it through the weight's
// gradient accumulator as a normal backward would. Outside a capture they are ordinary linears.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "titan/nn/unit.h"
#include "titan/nn/weight_gradients.h"

namespace titan::distributed::pipeline {

class DeferredWeights final : public nn::WeightGradientTarget {
 public:
  // Makes the weight gradients computed while it lives go to `target` (nn/weight_gradients.h). One at a time (not
  // nested).
  class Capture {
   public:
    explicit Capture(DeferredWeights& target);
    ~Capture();
    Capture(const Capture&) = delete;
    Capture& operator=(const Capture&) = delete;
  };
  void defer(const at::Tensor& weight, std::function<at::Tensor()> compute) override {
    entries_.push_back({weight, std::move(compute)});
  }
  bool empty() const { return entries_.empty(); }
  // Computes every deferred weight gradient and accumulates it (one accumulation per weight); leaves this empty.
  void apply();

 private:
  struct Entry {
    at::Tensor weight;
    std::function<at::Tensor()> compute;
  };
  std::vector<Entry> entries_;
};

// `linear`'s matmul becomes deferrable (an innermost wrapper: tensor-parallel styles around it still apply).
void defer_weight_gradient(nn::Linear& linear);

}  // namespace titan::distributed::pipeline
