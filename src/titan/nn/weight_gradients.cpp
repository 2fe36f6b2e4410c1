#include "titan/nn/weight_gradients.h"

#include <atomic>

#include "titan/common/error.h"

namespace titan::nn {
namespace {

// Not thread-local: autograd may run the backward on another thread than the one that installed the target.
std::atomic<WeightGradientTarget*> g_target{nullptr};

}  // namespace

void install_weight_gradient_target(WeightGradientTarget* target) {
  if (!target) {
    g_target.store(nullptr);
    return;
  }
  WeightGradientTarget* expected = nullptr;
  if (!g_target.compare_exchange_strong(expected, target)) fail("internal: nested zero-bubble weight captures");
}

bool defer_weight_gradient(const at::Tensor& weight, const std::function<at::Tensor()>& compute) {
  WeightGradientTarget* target = g_target.load();
  if (!target) return false;
  target->defer(weight, compute);
  return true;
}

}  // namespace titan::nn
