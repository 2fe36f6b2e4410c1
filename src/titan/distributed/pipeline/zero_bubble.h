// The zero-bubble split of backward: linear layers whose weight gradient can be deferred. During an input-gradient
// pass (a DeferredWeights::Capture is alive) they compute only the gradient of their input and keep (input,
// output gradient); the schedule's weight step later turns those into the weight gradient, through the weight's
// gradient accumulator as a normal backward would. Outside a capture they are ordinary linears.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "titan/nn/unit.h"

namespace titan::distributed::pipeline {

class DeferredWeights {
 public:
  // Makes the weight gradients computed while it lives go to `target`. One at a time (not nested).
  class Capture {
   public:
    explicit Capture(DeferredWeights& target);
    ~Capture();
    Capture(const Capture&) = delete;
    Capture& operator=(const Capture&) = delete;
  };
  struct Entry {
    at::Tensor weight, input, grad_output;
  };
  void add(Entry entry) { entries_.push_back(std::move(entry)); }
  bool empty() const { return entries_.empty(); }
  // Computes every deferred weight gradient (one per weight) and accumulates it; leaves this empty.
  void apply();

 private:
  std::vector<Entry> entries_;
};

// `linear`'s matmul becomes deferrable (an innermost wrapper: tensor-parallel styles around it still apply).
void defer_weight_gradient(nn::Linear& linear);

}  // namespace titan::distributed::pipeline
