#include "titan/nn/unit.h"

#include "titan/common/strings.h"
#include "titan/kernels/fused_ops.h"
#include "titan/nn/kept_ops.h"
#include "titan/nn/matmul.h"

namespace titan::nn {

void Unit::add_wrapper(std::string name, Wrapper wrapper) { wrappers_.emplace_back(std::move(name), std::move(wrapper)); }

void Unit::add_innermost_wrapper(std::string name, Wrapper wrapper) {
  wrappers_.insert(wrappers_.begin(), {std::move(name), std::move(wrapper)});
}

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

Linear::Linear(int64_t in_features, int64_t out_features, const ParameterOptions& options) {
  weight = register_parameter("weight", new_parameter({out_features, in_features}, options));
}

at::Tensor Linear::forward(const Inputs& inputs, const Context& context) {
  if (context.kept_ops && !recompute_under_op_checkpointing) return context.kept_ops->linear(inputs[0], weight);
  return nn::linear(inputs[0], weight);
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, const ParameterOptions& options) {
  weight = register_parameter("weight", new_parameter({num_embeddings, dim}, options));
}

at::Tensor Embedding::forward(const Inputs& inputs, const Context&) { return at::embedding(weight, inputs[0]); }

RMSNorm::RMSNorm(int64_t dim, double eps, const ParameterOptions& options) : dim_(dim), eps_(eps) {
  weight = register_parameter("weight", options.allocate ? at::ones({dim}, options.tensor) : without_storage({dim}, options.tensor));
}

at::Tensor RMSNorm::forward(const Inputs& inputs, const Context&) {
  const at::Tensor& x = inputs[0];
  double eps = eps_;
  if (eps < 0) {
    // torch.nn.RMSNorm built without eps: the machine epsilon of the dtype it normalises in.
    switch (x.scalar_type()) {
      case at::kBFloat16: eps = 0.0078125; break;
      case at::kHalf: eps = 0.0009765625; break;
      case at::kDouble: eps = 2.220446049250313e-16; break;
      default: eps = 1.1920928955078125e-07; break;
    }
  }
  if (x.scalar_type() != weight.scalar_type()) {
    // Under autocast a norm can meet a bf16 input (Qwen3's q/k norms after their projections) and its float32
    // weight: normalised in float32, as transformers' Qwen3RMSNorm does, and handed on in the input's dtype. The
    // fused kernel takes the weight in the input's dtype (as FSDP's mixed precision hands it over) and keeps the
    // bf16 input for backward; the ATen composition keeps float32 copies, four times the memory.
    const at::Tensor cast_weight = weight.to(x.scalar_type());
    if (kernels::fused_kernel_applies(kernels::Op::rms_norm, {x, cast_weight})) return kernels::rms_norm(x, cast_weight, eps);
    return at::rms_norm(x.to(at::kFloat), {dim_}, weight.to(at::kFloat), eps).to(x.scalar_type());
  }
  if (kernels::fused_kernel_applies(kernels::Op::rms_norm, {x, weight})) return kernels::rms_norm(x, weight, eps);
  return at::rms_norm(x, {dim_}, weight, eps);
}

void Unit::pretty_print(std::ostream& stream) const {
  stream << name();
  std::vector<std::string> parts;
  for (const auto& item : named_parameters(/*recurse=*/false)) {
    std::string dims;
    for (int64_t d : item.value().sizes()) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
    parts.push_back(item.key() + " [" + dims + "]");
  }
  for (const auto& [wname, wrapper] : wrappers_) parts.push_back(wname);
  if (!parts.empty()) stream << "(" << join(parts, ", ") << ")";
}

at::Tensor SwiGLU::forward(const Inputs& inputs, const Context&) {
  if (kernels::fused_kernel_applies(kernels::Op::swiglu, {inputs[0], inputs[1]})) return kernels::swiglu(inputs[0], inputs[1]);
  return kernels::swiglu_reference(inputs[0], inputs[1]);
}

}  // namespace titan::nn
