// titan's CUDA kernels (kernels/cuda: SwiGLU, RoPE, the cross-entropy rows) against the unfused ATen compositions
// they replace, computed in float64 on the host from the same inputs: values and gradients, float32 and bfloat16,
// odd sizes, strided inputs, inputs larger than the first-call check's slice; then the first-call checks' verdicts.
// Their time against the ATen compositions: bench/bench_kernels.cpp --device cuda (scripts/test_gpu.sh runs it).
// With TITAN_GPU_TESTS_DRY_RUN=1 on a machine without a GPU the same comparisons run on the CPU kernels.
#include "gpu_test_util.h"

#include <torch/csrc/autograd/autograd.h>

#include <iostream>

#include "titan/distributed/loss_parallel.h"
#include "titan/kernels/fused_ops.h"
#include "titan/kernels/grouped_mm.h"
#include "titan/models/llama3/args.h"
#include "titan/models/common/decoder.h"
#include "titan/nn/float8.h"

namespace {

using titan_gpu_test::figure;
using titan_gpu_test::max_relative_difference;
using titan_gpu_test::test_device;

// float32 kernels against float64; bf16 kernels round each result to 8 bits of mantissa.
double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 2e-6 : 1.6e-2; }

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// In this binary a CUDA kernel that disagrees with ATen on its first call fails the test that called it, instead of
// giving way to the ATen composition (which the comparisons below would then measure).
class StrictChecks : public testing::Environment {
 public:
  void SetUp() override { titan::kernels::set_cuda_checks_strict(true); }
};
const auto* const g_strict_checks = testing::AddGlobalTestEnvironment(new StrictChecks);
at::Tensor host64(const at::Tensor& t) { return t.detach().to(at::kCPU, at::kDouble); }

TEST(GpuKernels, SwiGluMatchesAtenInFloat64) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  at::manual_seed(12);
  const at::Device device = test_device();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(testing::Message() << dtype);
    auto opts = at::TensorOptions().dtype(dtype).device(device);
    // 3 x 97 x 1031 elements: more than the first-call check's slice, not a multiple of any block size.
    at::Tensor gate = at::randn({3, 97, 1031}, opts) * 4;
    at::Tensor up = at::randn({3, 1031, 97}, opts).transpose(1, 2);  // not contiguous
    at::Tensor grad = at::randn({3, 97, 1031}, opts);
    at::Tensor g1 = leaf(gate), u1 = leaf(up);
    ASSERT_TRUE(titan::kernels::fused_kernel_applies(titan::kernels::Op::swiglu, {g1, u1}));
    at::Tensor y = titan::kernels::swiglu(g1, u1);
    y.backward(grad);
    at::Tensor g2 = leaf(host64(gate)), u2 = leaf(host64(up));
    at::Tensor ref = at::silu(g2) * u2;
    ref.backward(host64(grad));
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_EQ(y.device(), device);
    EXPECT_LT(max_relative_difference(y, ref), tolerance(dtype));
    EXPECT_LT(max_relative_difference(g1.grad(), g2.grad()), tolerance(dtype));
    EXPECT_LT(max_relative_difference(u1.grad(), u2.grad()), tolerance(dtype));
  }
}

TEST(GpuKernels, RopeMatchesComplexRotationInFloat64) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  at::manual_seed(13);
  const at::Device device = test_device();
  const int64_t b = 3, s = 301, d = 128;  // Llama 3's head_dim; more positions than the check's slice
  const auto table = titan::models::precompute_rope(d, 512, 500000.0, titan::llama3::flavor("8B").rope_scaling);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (bool with_positions : {false, true}) {
      SCOPED_TRACE(testing::Message() << dtype << (with_positions ? " positions" : " sequence order"));
      auto opts = at::TensorOptions().dtype(dtype).device(device);
      at::Tensor q = at::randn({b, s, 8 * d}, opts).view({b, s, 8, d});
      // k strided as a slice of wider rows (GQA: 2 heads), made a leaf before slicing so that the kernel sees it so.
      at::Tensor k_rows = leaf(at::randn({b, s, 3 * d + 6}, opts));
      at::Tensor k = k_rows.narrow(2, 6, 2 * d).view({b, s, 2, d});
      at::Tensor positions = with_positions ? at::randint(0, 512, {b, s}, at::kLong) : at::Tensor();
      // The gradients in the layout attention's backward hands RoPE: (batch, heads, seq, head_dim) memory.
      at::Tensor gq = at::randn({b, 8, s, d}, opts).transpose(1, 2), gk = at::randn({b, 2, s, d}, opts).transpose(1, 2);
      at::Tensor q1 = leaf(q);
      auto [rq, rk] = titan::kernels::rope(q1, k, table.to(device), with_positions ? positions.to(device) : at::Tensor());
      torch::autograd::backward({rq, rk}, {gq, gk});
      const at::Tensor k_grad = k_rows.grad().narrow(2, 6, 2 * d).view({b, s, 2, d});
      at::Tensor q2 = leaf(host64(q)), k2 = leaf(host64(k));
      auto rotate = [&](const at::Tensor& x) {
        at::Tensor xc = at::view_as_complex(x.reshape({x.size(0), s, x.size(2), d / 2, 2}));
        at::Tensor t = table.to(at::kComplexDouble);
        t = with_positions ? t.index_select(0, positions.reshape({-1})).view({b, s, 1, d / 2})
                           : t.narrow(0, 0, s).view({1, s, 1, d / 2});
        return at::view_as_real(xc * t).flatten(3);
      };
      at::Tensor fq = rotate(q2), fk = rotate(k2);
      (fq * host64(gq)).sum().add((fk * host64(gk)).sum()).backward();
      EXPECT_EQ(rq.device(), device);
      EXPECT_LT(max_relative_difference(rq, fq), tolerance(dtype));
      EXPECT_LT(max_relative_difference(rk, fk), tolerance(dtype));
      EXPECT_LT(max_relative_difference(q1.grad(), q2.grad()), tolerance(dtype));
      EXPECT_LT(max_relative_difference(k_grad, k2.grad()), tolerance(dtype));
    }
  }
}

// Both passes on Llama 3's 128,256-column vocabulary and an odd one: labels here, elsewhere (-1), a row of -inf,
// a row with scale 0.
TEST(GpuKernels, CrossEntropyRowsMatchFloat64) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  at::manual_seed(14);
  const at::Device device = test_device();
  for (int64_t vocab : {int64_t{128256}, int64_t{1003}}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(testing::Message() << dtype << " vocab " << vocab);
      const int64_t rows = 70;  // more than the check's slice
      at::Tensor logits = (at::randn({rows, vocab}) * 4).to(dtype);
      logits[3].fill_(-INFINITY);
      at::Tensor labels = at::randint(0, vocab, {rows}, at::kLong);
      labels[2] = -1;
      labels[3] = -1;
      const at::Tensor x = logits.to(at::kDouble);
      auto stats = titan::kernels::cross_entropy_row_stats(logits.to(device), labels.to(device));
      at::Tensor max = std::get<0>(x.max(1));
      max[3] = 0;
      EXPECT_TRUE(at::allclose(host64(stats.max), max));
      // A float32 sum of `vocab` terms: its rounding grows with the square root of their number.
      const double sum_tolerance = 2e-6 * std::max(1.0, std::sqrt(vocab / 1000.0));
      EXPECT_LT(max_relative_difference(stats.sum_exp, (x - max.unsqueeze(1)).exp().sum(1)), sum_tolerance);
      at::Tensor target = x.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1).masked_fill(labels.lt(0), 0.0);
      EXPECT_TRUE(at::equal(host64(stats.target), target));
      at::Tensor lse = (stats.sum_exp.log() + stats.max).contiguous();
      at::Tensor scale = at::ones({rows});
      scale[5] = 0;
      at::Tensor grad = logits.to(device);
      titan::kernels::cross_entropy_row_grad_(grad, labels.to(device), lse, scale.to(device));
      at::Tensor ref = (x - host64(lse).unsqueeze(1)).exp();
      for (int64_t r = 0; r < rows; ++r)
        if (labels[r].item<int64_t>() >= 0) ref[r][labels[r].item<int64_t>()] -= 1;
      ref.mul_(scale.to(at::kDouble).unsqueeze(1));
      const at::Tensor got = host64(grad);
      EXPECT_LT(max_relative_difference(got.narrow(0, 0, 3), ref.narrow(0, 0, 3)), tolerance(dtype));
      EXPECT_LT(max_relative_difference(got.narrow(0, 4, rows - 4), ref.narrow(0, 4, rows - 4)), tolerance(dtype));
      EXPECT_EQ(got[5].abs().sum().item<double>(), 0.0);
    }
  }
}

// The fused projection + cross-entropy (chunked; the row kernels inside) on the device against ATen in float64.
TEST(GpuKernels, LinearCrossEntropyMatchesFloat64) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  at::manual_seed(15);
  const at::Device device = test_device();
  const int64_t tokens = 2100, dim = 64, vocab = 5003;
  at::Tensor x = at::randn({tokens, dim}), w = at::randn({vocab, dim}) * 0.2;
  at::Tensor labels = at::randint(0, vocab, {tokens}, at::kLong);
  labels.narrow(0, 100, 40).fill_(-100);
  at::Tensor x1 = leaf(x.to(device)), w1 = leaf(w.to(device));
  at::Tensor loss = titan::distributed::linear_cross_entropy_sum(x1, w1, labels.to(device), 0, nullptr, -100);
  loss.backward();
  at::Tensor x2 = leaf(x.to(at::kDouble)), w2 = leaf(w.to(at::kDouble));
  at::Tensor ref = at::cross_entropy_loss(at::linear(x2, w2), labels, {}, at::Reduction::Sum, -100);
  ref.backward();
  // float32 on a GPU: cuBLAS may use TF32 only if LibTorch allows it (off by default for matmuls).
  EXPECT_LT(std::abs(loss.item<double>() - ref.item<double>()) / ref.item<double>(), 1e-5);
  EXPECT_LT(max_relative_difference(x1.grad(), x2.grad()), 1e-5);
  EXPECT_LT(max_relative_difference(w1.grad(), w2.grad()), 1e-5);
}

// Each kernel checks itself against ATen on its first call per dtype; the verdicts are listed and all agree.
TEST(GpuKernels, FirstCallChecksAgreeWithAten) {
  TITAN_REQUIRE_CUDA();
  const at::Device device = test_device();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto opts = at::TensorOptions().dtype(dtype).device(device);
    at::Tensor x = at::randn({4, 33, 6, 64}, opts);
    titan::kernels::swiglu(x, x);
    titan::kernels::rope(x, x, titan::models::precompute_rope(64, 64, 10000.0, {}).to(device), at::Tensor());
    titan::kernels::cross_entropy_row_stats(x.view({-1, 64}), at::zeros({x.numel() / 64}, opts.dtype(at::kLong)));
  }
  const auto lines = titan::kernels::cuda_kernel_checks();
  for (const auto& line : lines) {
    std::printf("first-call check: %s\n", line.c_str());
    EXPECT_NE(line.find("agrees with"), std::string::npos) << line;
  }
  EXPECT_EQ(lines.size(), 6u);  // 3 kernels x 2 dtypes
  for (auto op : {titan::kernels::Op::swiglu, titan::kernels::Op::rope, titan::kernels::Op::cross_entropy})
    EXPECT_TRUE(titan::kernels::fused_kernel_applies(op, {at::ones({2}, at::TensorOptions().device(device).dtype(at::kBFloat16))}));
  figure("cuda kernel first-call checks agreeing", static_cast<double>(lines.size()));
}

// The MoE experts' grouped products through LibTorch's at::_grouped_mm (bf16, compute capability 9.0 and newer)
// against a per-expert loop in float64 on the host: uneven and empty groups, forward, input and weight gradients.
TEST(GpuKernels, GroupedMatmulMatchesPerExpertLoopInFloat64) {
  TITAN_REQUIRE_CUDA();
  const at::Device device = test_device();
  at::manual_seed(14);
  const std::vector<int64_t> rows = {0, 37, 130, 0, 1, 88, 0};
  const auto experts = static_cast<int64_t>(rows.size());
  const at::Tensor counts = at::tensor(rows, at::kLong);
  const int64_t total = counts.sum().item<int64_t>(), in = 256, out = 384;
  const at::Tensor x = at::randn({total, in}).to(at::kBFloat16), w = (at::randn({experts, out, in}) * 0.05).to(at::kBFloat16);
  const at::Tensor g = at::randn({total, out}).to(at::kBFloat16);
  const at::Tensor xd = x.to(device), wd = w.to(device), gd = g.to(device);
  if (!titan::kernels::libtorch_grouped_mm_applies(xd, wd))
    GTEST_SKIP() << "LibTorch's grouped matmul does not apply on this GPU (bf16 needs compute capability 9.0 or newer)";
  const at::Tensor y = titan::kernels::libtorch_grouped_linear(xd, wd, counts);
  const at::Tensor dx = titan::kernels::libtorch_grouped_linear_input_grad(gd, wd, counts);
  const at::Tensor dw = titan::kernels::libtorch_grouped_linear_weight_grad(gd, xd, counts);
  at::Tensor y_ref = at::zeros({total, out}, at::kDouble), dx_ref = at::zeros({total, in}, at::kDouble);
  at::Tensor dw_ref = at::zeros({experts, out, in}, at::kDouble);
  for (int64_t e = 0, start = 0; e < experts; start += rows[static_cast<size_t>(e)], ++e) {
    const int64_t n = rows[static_cast<size_t>(e)];
    if (n == 0) continue;
    const at::Tensor xe = host64(x).narrow(0, start, n), ge = host64(g).narrow(0, start, n), we = host64(w)[e];
    y_ref.narrow(0, start, n).copy_(at::mm(xe, we.t()));
    dx_ref.narrow(0, start, n).copy_(at::mm(ge, we));
    dw_ref[e].copy_(at::mm(ge.t(), xe));
  }
  EXPECT_EQ(y.device(), device);
  EXPECT_LT(max_relative_difference(y, y_ref), 1.6e-2);
  EXPECT_LT(max_relative_difference(dx, dx_ref), 1.6e-2);
  EXPECT_LT(max_relative_difference(dw, dw_ref), 1.6e-2);
  for (int64_t e = 0; e < experts; ++e) {
    if (rows[static_cast<size_t>(e)] == 0) {
      EXPECT_EQ(dw[e].abs().max().item<double>(), 0.0) << "expert " << e << " received no rows";
    }
  }
}

// titan's fused float8 cast against ATen's composition (times the scale, clamped, converted) on the host, bit for bit:
// both formats, float32 and bf16 inputs, per-tensor, per-row and per-column scales, inputs row- and column-major,
// results row- and column-major; partial 32 x 32 tiles, values past both formats' ranges, tiny values, signed zeros.
TEST(GpuKernels, Float8CastEqualsAtenBitForBit) {
  TITAN_REQUIRE_CUDA();
  const at::Device device = test_device();
  at::manual_seed(19);
  int cases = 0;
  for (const auto in_dtype : {at::kFloat, at::kBFloat16})
    for (const auto format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2})
      for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{37, 45}, {256, 96}})
        for (int scale_kind = 0; scale_kind < 3; ++scale_kind)
          for (const bool column_major_input : {false, true})
            for (const bool column_major : {false, true}) {
              SCOPED_TRACE(testing::Message() << c10::toString(in_dtype) << " -> " << c10::toString(format) << " " << rows
                                              << "x" << cols << " scale kind " << scale_kind << " input "
                                              << (column_major_input ? "column" : "row") << "-major, result "
                                              << (column_major ? "column" : "row") << "-major");
              at::Tensor x = at::randn({rows, cols}) * at::exp2(at::randint(-30, 20, {rows, cols}).to(at::kFloat));
              x[0][0] = 0.0;
              x[0][1] = -0.0;
              x[0][2] = 1e30;
              x[0][3] = -1e30;
              x = x.to(in_dtype);
              if (column_major_input) x = x.t().contiguous().t();
              const at::Tensor scale = scale_kind == 0   ? at::scalar_tensor(0.75, at::kFloat)
                                       : scale_kind == 1 ? at::rand({rows, 1}) + 0.5
                                                         : at::rand({1, cols}) + 0.5;
              const double limit = format == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
              const at::Tensor expected = (x.to(at::kFloat) * scale).clamp(-limit, limit).to(format);
              const at::Tensor got = titan::nn::float8::scaled_cast(x.to(device), scale.to(device), format, column_major);
              ASSERT_EQ(got.scalar_type(), format);
              ASSERT_EQ(got.sizes(), expected.sizes());
              EXPECT_TRUE(column_major ? got.t().is_contiguous() : got.is_contiguous());
              EXPECT_TRUE(at::equal(got.cpu().view(at::kByte), expected.view(at::kByte)));
              ++cases;
            }
  // Every combination the kernel's first-call checks tell apart (input dtype x format x layout x per-tensor, per-row
  // or per-column scale) ran and passed its check.
  const auto checks = titan::nn::float8::fused_cast_checks();
  EXPECT_EQ(checks.size(), 24u);
  for (const auto& line : checks) {
    std::cout << "first-call check: " << line << "\n";
    EXPECT_NE(line.find(" equals "), std::string::npos) << line;
  }
  figure("float8 cast cases equal to ATen bit for bit", cases);
}

// Float8 linears through at::_scaled_mm (compute capability 8.9 and newer) against the emulation of the same casts
// on the host: every recipe, bf16, an odd token count. The emulation multiplies in float32; the GPU accumulates in
// float32 too (with fast accumulation in the forward matmul) and rounds to bf16.
TEST(GpuKernels, Float8LinearsMatchTheirEmulation) {
  TITAN_REQUIRE_CUDA();
  const at::Device device = test_device();
  std::string why;
  if (!titan::nn::float8::has_float8_matmul(device, &why)) GTEST_SKIP() << why;
  at::manual_seed(13);
  for (const auto& name : titan::nn::float8::recipe_names()) {
    SCOPED_TRACE(name);
    const auto recipe = titan::nn::float8::recipe(name);
    const at::Tensor x = (at::randn({3, 333, 256}) * 2).to(at::kBFloat16), w = (at::randn({512, 256}) * 0.05).to(at::kBFloat16);
    const at::Tensor grad = at::randn({3, 333, 512}).to(at::kBFloat16);
    at::Tensor x1 = leaf(x.to(device)), w1 = leaf(w.to(device));
    at::Tensor y = titan::nn::float8::linear(x1, w1, recipe, /*emulate=*/false);
    y.backward(grad.to(device));
    at::Tensor x2 = leaf(x), w2 = leaf(w);
    at::Tensor ref = titan::nn::float8::linear(x2, w2, recipe, /*emulate=*/true);
    ref.backward(grad);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_LT(max_relative_difference(y, ref.to(at::kDouble)), 1.6e-2);
    EXPECT_LT(max_relative_difference(x1.grad(), x2.grad().to(at::kDouble)), 1.6e-2);
    EXPECT_LT(max_relative_difference(w1.grad(), w2.grad().to(at::kDouble)), 1.6e-2);
  }
  figure("float8 recipes checked on the GPU", static_cast<double>(titan::nn::float8::recipe_names().size()));
}

// MXFP8 linears through at::_scaled_mm with E8M0 block scales (compute capability 10.0 and newer) against the
// emulation of the same casts on the host: both scale roundings, bf16, 320 tokens (a multiple of 32, not of 128,
// so the block scales are padded).
TEST(GpuKernels, MxLinearsMatchTheirEmulation) {
  TITAN_REQUIRE_CUDA();
  const at::Device device = test_device();
  std::string why;
  if (!titan::nn::float8::has_mx_matmul(device, &why)) GTEST_SKIP() << why;
  at::manual_seed(17);
  for (const auto rounding : {titan::nn::float8::MxScaleRounding::floor, titan::nn::float8::MxScaleRounding::rceil}) {
    SCOPED_TRACE(rounding == titan::nn::float8::MxScaleRounding::floor ? "floor" : "rceil");
    const at::Tensor x = (at::randn({2, 160, 256}) * 2).to(at::kBFloat16), w = (at::randn({512, 256}) * 0.05).to(at::kBFloat16);
    const at::Tensor grad = at::randn({2, 160, 512}).to(at::kBFloat16);
    at::Tensor x1 = leaf(x.to(device)), w1 = leaf(w.to(device));
    at::Tensor y = titan::nn::float8::mx_linear(x1, w1, rounding, /*emulate=*/false);
    y.backward(grad.to(device));
    at::Tensor x2 = leaf(x), w2 = leaf(w);
    at::Tensor ref = titan::nn::float8::mx_linear(x2, w2, rounding, /*emulate=*/true);
    ref.backward(grad);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_LT(max_relative_difference(y, ref.to(at::kDouble)), 1.6e-2);
    EXPECT_LT(max_relative_difference(x1.grad(), x2.grad().to(at::kDouble)), 1.6e-2);
    EXPECT_LT(max_relative_difference(w1.grad(), w2.grad().to(at::kDouble)), 1.6e-2);
  }
  figure("MX scale roundings checked on the GPU", 2);
}

}  // namespace
