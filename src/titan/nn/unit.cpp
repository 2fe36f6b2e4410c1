#include "titan/nn/unit.h"

#include <cmath>

namespace titan::nn {

void Unit::add_wrapper(std::string name, Wrapper wrapper) { wrappers_.emplace_back(std::move(name), std::move(wrapper)); }

bool Unit::has_wrapper(const std::string& name) const {
  for (const auto& [n, w] : wrappers_)
    if (n == name) return true;
  return false;
}

at::Tensor Unit::invoke(size_t depth, const Inputs& inputs, const Context& context) {
  if (depth == 0) return forward(inputs, context);
  Next next = [this, depth](const Inputs& in, const Context& ctx) { return invoke(depth - 1, in, ctx); };
  return wrappers_[depth - 1].second(inputs, context, next);
}

Linear::Linear(int64_t in_features, int64_t out_features) {
  weight = register_parameter("weight", at::empty({out_features, in_features}));
}

at::Tensor Linear::forward(const Inputs& inputs, const Context&) { return at::linear(inputs[0], weight); }

Embedding::Embedding(int64_t num_embeddings, int64_t dim) {
  weight = register_parameter("weight", at::empty({num_embeddings, dim}));
}

at::Tensor Embedding::forward(const Inputs& inputs, const Context&) { return at::embedding(weight, inputs[0]); }

RMSNorm::RMSNorm(int64_t dim, double eps) : dim_(dim), eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

void RMSNorm::reset_parameters() {
  at::NoGradGuard no_grad;
  weight.fill_(1.0);
}

at::Tensor RMSNorm::forward(const Inputs& inputs, const Context&) {
  return at::rms_norm(inputs[0], {dim_}, weight, eps_);
}

at::Tensor SwiGLU::forward(const Inputs& inputs, const Context&) { return at::silu(inputs[0]) * inputs[1]; }

void trunc_normal_(at::Tensor& tensor, double mean, double std, double low, double high) {
  // Inverse-CDF sampling: uniform over the truncated CDF range, then the normal quantile via erfinv.
  at::NoGradGuard no_grad;
  auto cdf = [](double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); };
  double lo = cdf((low - mean) / std), hi = cdf((high - mean) / std);
  at::Tensor sample = at::empty(tensor.sizes(), tensor.options().dtype(at::kFloat));
  sample.uniform_(2 * lo - 1, 2 * hi - 1);
  sample.erfinv_();
  sample.mul_(std * std::sqrt(2.0)).add_(mean).clamp_(low, high);
  tensor.copy_(sample);
}

}  // namespace titan::nn
