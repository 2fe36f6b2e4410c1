// The zero-bubble schedules' split backward (distributed/pipeline/zero_bubble.h, nn/weight_gradients.h): under a
// capture (an input-gradient step) a linear's backward gives its input's gradient and leaves its weight's for the
// weight step, which then accumulates exactly what a whole backward would have. For LibTorch's linears (the
// pipeline's deferrable ones) and for float8 and MXFP8 linears, whose weight gradients are their recipes' products.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <functional>
#include <string>

#include "titan/common/error.h"
#include "titan/distributed/pipeline/zero_bubble.h"
#include "titan/nn/float8.h"
#include "titan/nn/unit.h"

namespace titan::distributed::pipeline {
namespace {

using Product = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& weight)>;

// One backward of sum(product(x, w) * r), whole, against the same split into an input-gradient step under a capture
// and a weight step: the input gradients are equal, no weight gradient exists after the first step, and the weight
// step's is equal to the whole backward's.
void check_split(const std::string& what, const Product& product) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor x0 = at::randn({2, 32, 64}, gen), w0 = at::randn({96, 64}, gen) * 0.1, r = at::randn({2, 32, 96}, gen);

  at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  (product(x, w) * r).sum().backward();
  const at::Tensor dx = x.grad().clone(), dw = w.grad().clone();

  at::Tensor xs = x0.clone().requires_grad_(true), ws = w0.clone().requires_grad_(true);
  DeferredWeights deferred;
  {
    DeferredWeights::Capture capture(deferred);
    (product(xs, ws) * r).sum().backward();
  }
  EXPECT_TRUE(at::equal(xs.grad(), dx)) << what;
  EXPECT_FALSE(ws.grad().defined()) << what << ": the weight gradient was not deferred";
  ASSERT_FALSE(deferred.empty()) << what;
  deferred.apply();
  EXPECT_TRUE(deferred.empty());
  ASSERT_TRUE(ws.grad().defined()) << what;
  EXPECT_TRUE(at::equal(ws.grad(), dw)) << what << ": max difference " << (ws.grad() - dw).abs().max().item<double>();
}

TEST(ZeroBubble, LinearsOfEveryKindDeferTheirWeightGradients) {
  check_split("LibTorch linear", [](const at::Tensor& x, const at::Tensor& w) {
    nn::Linear linear(64, 96, nn::ParameterOptions{at::TensorOptions().dtype(at::kFloat), /*allocate=*/false});
    linear.weight = w;
    defer_weight_gradient(linear);
    return linear(x, nn::Context{});
  });
  for (const std::string recipe : {"tensorwise", "rowwise", "rowwise_with_gw_hp"})
    check_split("float8 " + recipe, [recipe](const at::Tensor& x, const at::Tensor& w) {
      return nn::float8::linear(x, w, nn::float8::recipe(recipe), /*emulate=*/true);
    });
  check_split("MXFP8", [](const at::Tensor& x, const at::Tensor& w) {
    return nn::float8::mx_linear(x, w, nn::float8::MxScaleRounding::rceil, /*emulate=*/true);
  });
}

TEST(ZeroBubble, CapturesDoNotNest) {
  DeferredWeights a, b;
  DeferredWeights::Capture capture(a);
  EXPECT_THROW({ DeferredWeights::Capture nested(b); }, titan::UserError);
}

}  // namespace
}  // namespace titan::distributed::pipeline
