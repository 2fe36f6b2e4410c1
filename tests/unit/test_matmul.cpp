// nn/matmul.h: bf16 products computed in float32 (the path for x86 CPUs without AVX512_BF16) against float64 products
// of the same bf16-rounded inputs and against LibTorch's own bf16 kernels, forward and backward, under autocast
// and on bf16 tensors; the rule that picks the path against /proc/cpuinfo.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "titan/distributed/loss_parallel.h"
#include "titan/nn/autocast.h"
#include "titan/nn/matmul.h"

namespace {

// Restores the CPU's rule when a test ends.
struct ForceEmulation {
  explicit ForceEmulation(bool on) { titan::nn::set_bf16_gemm_emulation(on); }
  ~ForceEmulation() { titan::nn::set_bf16_gemm_emulation(std::nullopt); }
};

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(1e-12, b.abs().max().item<double>());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

at::Tensor bf16_rounded(const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); }

// One bf16 rounding of the result (2^-8 relative) plus float32 accumulation over a few hundred terms.
constexpr double kOneRounding = 1.0 / 256 + 1e-5;

TEST(Matmul, RuleFollowsTheCpusAvx512Bf16Flags) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(cpuinfo, line))
    if (line.rfind("flags", 0) == 0) {
      flags = " " + line.substr(line.find(':') + 1) + " ";
      break;
    }
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line on this machine";
  if (std::getenv("TITAN_TEST_BF16_PRODUCTS_IN_FLOAT")) GTEST_SKIP() << "TITAN_TEST_BF16_PRODUCTS_IN_FLOAT chooses the path";
#if defined(__x86_64__)
  bool bf16_hardware = true;
  for (const char* f : {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    bf16_hardware = bf16_hardware && flags.find(std::string(" ") + f + " ") != std::string::npos;
  EXPECT_EQ(titan::nn::emulates_bf16_gemm(), !bf16_hardware) << "flags:" << flags;
#else
  EXPECT_FALSE(titan::nn::emulates_bf16_gemm());
#endif
}

TEST(Matmul, LinearUnderAutocastMatchesFloat64AndLibTorchForwardAndBackward) {
  at::manual_seed(3);
  const at::Tensor x0 = at::randn({2, 37, 96}), w0 = at::randn({130, 96}) * 0.1, dy = at::randn({2, 37, 130}).to(at::kBFloat16);
  // The float64 reference from the bf16-rounded inputs autocast would multiply.
  const at::Tensor xd = bf16_rounded(x0), wd = bf16_rounded(w0), dyd = dy.to(at::kDouble);
  const at::Tensor y_ref = at::linear(xd, wd), dx_ref = at::matmul(dyd, wd);
  const at::Tensor dw_ref = at::mm(dyd.reshape({-1, 130}).t(), xd.reshape({-1, 96}));
  at::Tensor y_by[2], dx_by[2], dw_by[2];
  for (bool emulate : {false, true}) {
    ForceEmulation force(emulate);
    at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    at::Tensor y;
    {
      titan::nn::AutocastRegion autocast(titan::nn::AutocastState::enabled_for(at::kCPU, at::kBFloat16));
      y = titan::nn::linear(x, w);
    }
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.backward(dy);
    EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
    EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
    EXPECT_LT(relative_error(y, y_ref), kOneRounding) << "emulate " << emulate;
    EXPECT_LT(relative_error(x.grad(), dx_ref), kOneRounding) << "emulate " << emulate;
    EXPECT_LT(relative_error(w.grad(), dw_ref), kOneRounding) << "emulate " << emulate;
    y_by[emulate] = y.detach(), dx_by[emulate] = x.grad(), dw_by[emulate] = w.grad();
  }
  // Both paths round the same float32-accumulated sums once: at most one bf16 step apart.
  EXPECT_LT(relative_error(y_by[1], y_by[0]), 2 * kOneRounding);
  EXPECT_LT(relative_error(dx_by[1], dx_by[0]), 2 * kOneRounding);
  EXPECT_LT(relative_error(dw_by[1], dw_by[0]), 2 * kOneRounding);
}

TEST(Matmul, Bf16TensorsWithoutAutocastAndTheMatrixProducts) {
  ForceEmulation force(true);
  at::manual_seed(4);
  const at::Tensor a = at::randn({33, 70}).to(at::kBFloat16), b = at::randn({70, 21}).to(at::kBFloat16);
  const at::Tensor ref = at::mm(a.to(at::kDouble), b.to(at::kDouble));
  const at::Tensor product = titan::nn::mm(a, b);
  EXPECT_EQ(product.scalar_type(), at::kBFloat16);
  EXPECT_LT(relative_error(product, ref), kOneRounding);
  at::Tensor out = at::empty({33, 21}, a.options());
  titan::nn::mm_out(out, a, b);
  EXPECT_TRUE(out.equal(product));
  at::Tensor out_float = at::empty({33, 21});
  titan::nn::mm_out(out_float, a, b);
  EXPECT_LT(relative_error(out_float, ref), 1e-5);
  const at::Tensor batched = at::randn({3, 33, 70}).to(at::kBFloat16);
  EXPECT_LT(relative_error(titan::nn::matmul(batched, b), at::matmul(batched.to(at::kDouble), b.to(at::kDouble))), kOneRounding);
  // bf16 parameters, no autocast: the weight's gradient stays bf16.
  at::Tensor x = at::randn({5, 70}).to(at::kBFloat16).requires_grad_(), w = at::randn({9, 70}).to(at::kBFloat16).requires_grad_();
  at::Tensor y = titan::nn::linear(x, w);
  EXPECT_LT(relative_error(y, at::linear(x.to(at::kDouble), w.to(at::kDouble))), kOneRounding);
  y.sum().backward();
  EXPECT_EQ(w.grad().scalar_type(), at::kBFloat16);
  EXPECT_LT(relative_error(w.grad(), at::ones({5, 9}, at::kDouble).t().mm(x.detach().to(at::kDouble))), kOneRounding);
  // float32 is never touched: bitwise LibTorch's.
  const at::Tensor af = at::randn({8, 8}), bf = at::randn({8, 8});
  EXPECT_TRUE(titan::nn::mm(af, bf).equal(at::mm(af, bf)));
}

TEST(Matmul, FusedProjectionAndLossAgreeOnBothPaths) {
  at::manual_seed(5);
  const at::Tensor x0 = at::randn({64, 48}), w0 = at::randn({300, 48}) * 0.1, labels = at::randint(0, 300, {64}, at::kLong);
  double loss[2];
  at::Tensor dx[2], dw[2];
  for (bool emulate : {false, true}) {
    ForceEmulation force(emulate);
    at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    at::Tensor total;
    {
      titan::nn::AutocastRegion autocast(titan::nn::AutocastState::enabled_for(at::kCPU, at::kBFloat16));
      total = titan::distributed::linear_cross_entropy_sum(x, w, labels, 0, nullptr, -100);
    }
    total.backward();
    loss[emulate] = total.item<double>(), dx[emulate] = x.grad(), dw[emulate] = w.grad();
  }
  EXPECT_NEAR(loss[1], loss[0], 1e-2 * std::abs(loss[0]));
  EXPECT_LT(relative_error(dx[1], dx[0]), 2 * kOneRounding);
  EXPECT_LT(relative_error(dw[1], dw[0]), 2 * kOneRounding);
}

}  // namespace
