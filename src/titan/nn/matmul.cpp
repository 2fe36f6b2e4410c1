#include "titan/nn/matmul.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "titan/common/test_faults.h"
#include "titan/kernels/cpu_isa.h"
#include "titan/nn/autocast.h"

namespace titan::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int> g_forced{-1};  // -1: the CPU's rule; 0 or 1: set by set_bf16_gemm_emulation

// x86 CPUs without AVX-512 (LibTorch's scalar loop) or with AVX-512 but not its BF16 extension (oneDNN widening
// each element in software); other CPUs keep LibTorch's own choice.
bool cpu_lacks_fast_bf16_gemm() {
#if defined(__x86_64__) || defined(__i386__)
  return !kernels::cpu_has_avx512_bf16();
#else
  return false;
#endif
}

bool in_float(const at::Tensor& a, const at::Tensor& b) {
  return a.device().is_cpu() && a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && emulates_bf16_gemm();
}

// y = x W^T for bf16 x and W computed in float32; saves the bf16 tensors, as autocast's linear does.
struct Bf16LinearInFloat : torch::autograd::Function<Bf16LinearInFloat> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    NoAutocast no_autocast;
    ctx->save_for_backward({x, weight});
    return at::linear(x.to(at::kFloat), weight.to(at::kFloat)).to(at::kBFloat16);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor dy = grads[0].to(at::kFloat);
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = at::matmul(dy, weight.to(at::kFloat)).to(x.scalar_type());
    if (ctx->needs_input_grad(1))
      dw = at::mm(dy.reshape({-1, dy.size(-1)}).t(), x.reshape({-1, x.size(-1)}).to(at::kFloat)).to(weight.scalar_type());
    return {dx, dw};
  }
};

// y = x W^T whose result `y` is already known (kept by op-level selective checkpointing): returns y with linear's
// backward, dx = dy W and dW = dy^T x, computing no product in forward.
struct LinearWithOutput : torch::autograd::Function<LinearWithOutput> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y) {
    ctx->save_for_backward({x, weight});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor dy = grads[0].to(weight.scalar_type());
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = nn::matmul(dy, weight).to(x.scalar_type());
    if (ctx->needs_input_grad(1)) dw = nn::mm(dy.reshape({-1, dy.size(-1)}).t(), x.reshape({-1, x.size(-1)}).to(weight.scalar_type()));
    return {dx, dw, at::Tensor()};
  }
};

// What autocast hands a lower-precision op (linear, mm) for `t`: its cast (weights through the cast cache), or t.
at::Tensor autocast_operand(const at::Tensor& t) {
  const auto device = t.device().type();
  if ((device != at::kCPU && device != at::kCUDA) || !at::autocast::is_autocast_enabled(device)) return t;
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), t, device);
}

}  // namespace

bool emulates_bf16_gemm() {
  const int forced = g_forced.load();
  if (forced >= 0) return forced == 1;
  // Tests take the other path on any CPU (common/test_faults.h): the AVX2 machines' path, its memory and numerics,
  // on AVX-512 ones.
  static const bool rule = test_faults::bf16_products_in_float().value_or(cpu_lacks_fast_bf16_gemm());
  return rule;
}

void set_bf16_gemm_emulation(std::optional<bool> emulate) { g_forced = emulate ? static_cast<int>(*emulate) : -1; }

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (!in_float(a, b)) return at::mm(a, b);
  NoAutocast no_autocast;
  return at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(at::kBFloat16);
}

void mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (!in_float(a, b)) {
    at::mm_out(out, a, b);
    return;
  }
  NoAutocast no_autocast;
  if (out.scalar_type() == at::kFloat) {
    at::mm_out(out, a.to(at::kFloat), b.to(at::kFloat));
    return;
  }
  out.copy_(at::mm(a.to(at::kFloat), b.to(at::kFloat)));
}

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  if (!in_float(a, b)) return at::matmul(a, b);
  NoAutocast no_autocast;
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(at::kBFloat16);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  if (!x.device().is_cpu() || !emulates_bf16_gemm()) return at::linear(x, weight);
  const bool autocast = at::autocast::is_autocast_enabled(at::kCPU) && at::autocast::get_autocast_dtype(at::kCPU) == at::kBFloat16;
  if (!autocast && !(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16)) return at::linear(x, weight);
  // autocast's own casts: the weight's through its cache (once per step or region), so the gradients reach the
  // float32 weight through the cast exactly as with at::linear.
  const at::Tensor xb = autocast ? at::autocast::cached_cast(at::kBFloat16, x, at::kCPU) : x;
  const at::Tensor wb = autocast ? at::autocast::cached_cast(at::kBFloat16, weight, at::kCPU) : weight;
  return Bf16LinearInFloat::apply(xb, wb);
}

void check_kept_output(const char* what, const at::Tensor& kept, const at::Tensor& x, int64_t out_features, at::ScalarType dtype) {
  TORCH_CHECK(kept.dim() == x.dim() && kept.sizes().slice(0, x.dim() - 1) == x.sizes().slice(0, x.dim() - 1) &&
                  kept.size(-1) == out_features && kept.scalar_type() == dtype,
              what, ": the kept output ", kept.sizes(), " (", kept.scalar_type(), ") does not belong to input ", x.sizes(),
              " and ", out_features, " output features (", dtype, ")");
}

at::Tensor linear_with_output(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y) {
  const at::Tensor xc = autocast_operand(x), wc = autocast_operand(weight);
  check_kept_output("linear", y, x, weight.size(0), wc.scalar_type());
  return LinearWithOutput::apply(xc, wc, y);
}

}  // namespace titan::nn
