// The Llama 3 model on CUDA against the same model on the CPU: bitwise identical initialisation, float32 logits,
// loss and every gradient within tolerance (causal and block-causal, MHA and GQA), activation checkpointing that
// keeps the gradients, and bf16 autocast that really computes in bf16; the MoE layer under bf16 autocast against the
// CPU's in float32.
#include "gpu_test_util.h"

#include <ATen/CPUGeneratorImpl.h>

#include "titan/nn/loss.h"
#include "titan/config/job_config.h"
#include "titan/models/llama3/args.h"
#include "titan/models/common/decoder.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/common/moe.h"
#include "titan/nn/autocast.h"

namespace {

using Transformer = titan::models::Decoder;
using titan_gpu_test::figure;
using titan_gpu_test::max_relative_difference;

constexpr int64_t kSeq = 128;
constexpr uint64_t kSeed = 4321;

// The model built directly on `device` (parameters allocated there, initialised from kSeed on the host and
// copied, RoPE table moved), as the trainer builds it.
std::shared_ptr<Transformer> build(const std::string& flavor, const at::Device& device) {
  auto args = titan::llama3::flavor(flavor);
  args.max_seq_len = kSeq;
  auto model = std::make_shared<Transformer>(args, titan::nn::ParameterOptions{at::TensorOptions().device(device), true});
  model->init_weights(kSeed);
  model->move_buffers(device);
  return model;
}

struct Pass {
  at::Tensor logits;  // on the host
  double loss = 0;
  std::vector<at::Tensor> grads;  // on the host, parameter order
};

// Forward, mean cross-entropy and backward of `model` on tokens (batch, kSeq + 1) given on the host.
Pass forward_backward(Transformer& model, const at::Device& device, const at::Tensor& tokens, const at::Tensor& documents = {}) {
  at::Tensor inputs = tokens.narrow(1, 0, kSeq).contiguous().to(device);
  at::Tensor labels = tokens.narrow(1, 1, kSeq).contiguous().to(device);
  model.zero_grad();
  at::Tensor logits = documents.defined() ? model.forward(inputs, {}, documents.to(device)) : model.forward(inputs);
  at::Tensor loss = titan::cross_entropy_sum(logits, labels) / static_cast<double>(labels.numel());
  loss.backward();
  Pass p;
  p.logits = logits.detach().cpu();
  p.loss = loss.item<double>();
  for (auto& param : model.parameters()) p.grads.push_back(param.grad().detach().cpu());
  return p;
}

at::Tensor random_tokens(int64_t vocab, int64_t batch) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(99);
  return at::randint(0, vocab, {batch, kSeq + 1}, generator, at::TensorOptions().dtype(at::kLong));
}

// Compares a device pass with the CPU pass; returns the worst gradient difference (relative per tensor).
double expect_close(const Pass& device, const Pass& cpu, const std::vector<std::string>& names, const std::string& what) {
  const double logits_diff = max_relative_difference(device.logits, cpu.logits);
  const double loss_diff = std::abs(device.loss - cpu.loss) / std::abs(cpu.loss);
  EXPECT_LT(logits_diff, 1e-4) << what << ": logits differ from the CPU's";
  EXPECT_LT(loss_diff, 1e-5) << what << ": loss " << device.loss << " vs CPU " << cpu.loss;
  double worst = 0;
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    const double d = max_relative_difference(device.grads[i], cpu.grads[i]);
    EXPECT_LT(d, 1e-4) << what << ": gradient of " << names[i] << " differs from the CPU's";
    worst = std::max(worst, d);
  }
  figure("model." + what + ".logits_max_rel_diff", logits_diff);
  figure("model." + what + ".loss_rel_diff", loss_diff);
  figure("model." + what + ".grad_max_rel_diff", worst);
  return worst;
}

std::vector<std::string> parameter_names(Transformer& model) {
  std::vector<std::string> names;
  for (const auto& item : model.named_parameters()) names.push_back(item.key());
  return names;
}

}  // namespace

TEST(CudaModel, InitialisationOnTheGpuIsBitwiseTheCpus) {
  // Counter-based initialisation is computed on the host, so the weights must not depend on the device.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  const at::Device device = titan_gpu_test::test_device();
  for (const char* flavor : {"debugmodel", "debugmodel_gqa"}) {
    auto gpu = build(flavor, device);
    auto cpu = build(flavor, at::kCPU);
    auto a = gpu->named_parameters(), b = cpu->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].value().device(), device) << a[i].key();
      EXPECT_TRUE(titan_gpu_test::bitwise_equal(a[i].value(), b[i].value())) << flavor << ": " << a[i].key();
    }
  }
}

TEST(CudaModel, Float32ForwardBackwardMatchesTheCpu) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  const at::Device device = titan_gpu_test::test_device();
  for (const char* flavor : {"debugmodel", "debugmodel_gqa"}) {
    auto gpu = build(flavor, device);
    auto cpu = build(flavor, at::kCPU);
    at::Tensor tokens = random_tokens(gpu->args().vocab_size, 4);
    Pass on_device = forward_backward(*gpu, device, tokens);
    Pass on_cpu = forward_backward(*cpu, at::kCPU, tokens);
    EXPECT_EQ(on_device.logits.scalar_type(), at::kFloat);
    expect_close(on_device, on_cpu, parameter_names(*cpu), std::string(flavor) + ".fp32");
  }
}

TEST(CudaModel, BlockCausalAttentionMatchesTheCpu) {
  // Packed documents: SDPA with a boolean mask takes another kernel than the causal path.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  const at::Device device = titan_gpu_test::test_device();
  auto gpu = build("debugmodel", device);
  auto cpu = build("debugmodel", at::kCPU);
  at::Tensor tokens = random_tokens(gpu->args().vocab_size, 2);
  // Row 0: documents of 50, 50 and 28 tokens; row 1: one document.
  at::Tensor documents = at::cat({at::arange(50), at::arange(50), at::arange(28)}).view({1, kSeq});
  documents = at::cat({documents, at::arange(kSeq).view({1, kSeq})}, 0);
  Pass on_device = forward_backward(*gpu, device, tokens, documents);
  Pass on_cpu = forward_backward(*cpu, at::kCPU, tokens, documents);
  expect_close(on_device, on_cpu, parameter_names(*cpu), "debugmodel.block_causal.fp32");
}

TEST(CudaModel, ActivationCheckpointingKeepsTheGradients) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  const at::Device device = titan_gpu_test::test_device();
  at::Tensor tokens = random_tokens(2048, 4);
  auto run = [&](const std::string& mode, const std::string& option) {
    auto model = build("debugmodel", device);
    titan::config::ActivationCheckpoint ac;
    ac.mode = mode;
    ac.selective_ac_option = option;
    titan::models::apply_activation_checkpointing(*model, titan::distributed::ModuleRange::whole(*model), ac);
    return forward_backward(*model, device, tokens);
  };
  Pass none = run("none", "2");
  for (auto [mode, option] : {std::pair<const char*, const char*>{"full", "2"}, {"selective", "2"}, {"selective", "op"}}) {
    Pass with = run(mode, option);
    const std::string what = std::string("ac_") + mode + "_" + option;
    // The forward runs under no-grad with checkpointing, where SDPA may pick another kernel: near, not bitwise.
    EXPECT_NEAR(with.loss, none.loss, 1e-6 * std::abs(none.loss)) << what << ": checkpointing changed the forward pass";
    double worst = 0;
    bool bitwise = true;
    for (size_t i = 0; i < none.grads.size(); ++i) {
      worst = std::max(worst, max_relative_difference(with.grads[i], none.grads[i]));
      bitwise = bitwise && titan_gpu_test::bitwise_equal(with.grads[i], none.grads[i]);
    }
    EXPECT_LT(worst, 1e-5) << what << ": gradients differ from no checkpointing";
    figure("model." + what + ".grad_max_rel_diff_vs_none", worst);
    figure("model." + what + ".grads_bitwise_equal", bitwise ? "yes" : "no");
  }
}

TEST(CudaModel, Bfloat16AutocastComputesInBfloat16) {
  // The trainer's default (float32 parameters, bf16 compute through autocast): the logits come out in bf16 and
  // stay close to float32's.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  const at::Device device = titan_gpu_test::test_device();
  auto model = build("debugmodel", device);
  at::Tensor tokens = random_tokens(model->args().vocab_size, 4).narrow(1, 0, kSeq).contiguous().to(device);
  at::Tensor reference = model->forward(tokens).detach();
  at::Tensor low;
  {
    titan::nn::AutocastRegion autocast(titan::nn::AutocastState::enabled_for(device.type(), at::kBFloat16));
    low = model->forward(tokens).detach();
  }
  EXPECT_EQ(low.scalar_type(), at::kBFloat16) << "autocast did not engage on " << device.str();
  const double diff = max_relative_difference(low, reference);
  EXPECT_GT(diff, 0.0) << "bf16 logits equal float32's bitwise: autocast had no effect";
  EXPECT_LT(diff, 5e-2) << "bf16 logits far from float32's";
  figure("model.autocast_bf16.logits_max_rel_diff_vs_fp32", diff);
  // Leaving the region restores float32.
  EXPECT_EQ(model->forward(tokens).scalar_type(), at::kFloat);
}

TEST(CudaModel, MoeLayerUnderAutocastMatchesTheCpuInFloat32) {
  // The MoE layer as the trainer runs it on one GPU (bf16 autocast, float32 parameters): routing, the grouped
  // experts (LibTorch's grouped matmul where the GPU has it, else the per-expert loop) with one bf16 copy of the
  // sorted tokens for the gate and up products, and the float32 weighted sum that keeps the experts' bf16 outputs.
  // Against the same layer in float32 on the CPU: the output and the gradients of the input, the router and every
  // expert weight within bf16's rounding.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  const at::Device device = titan_gpu_test::test_device();
  for (bool scores_before : {false, true}) {  // the experts gather their sorted copies, or take the scaled ones
    SCOPED_TRACE(scores_before ? "scores before the experts" : "scores after the experts");
    at::manual_seed(17);
    titan::models::MoEArgs args;
    args.num_experts = 8, args.top_k = 2, args.hidden_dim = 128, args.num_shared_experts = 1;
    args.score_before_experts = scores_before;
    args.load_balance_coeff.reset();
    constexpr int64_t dim = 256;
    titan::models::MoE cpu(dim, args, {});
    titan::models::MoE gpu(dim, args, titan::nn::ParameterOptions{at::TensorOptions().device(device), true});
    {
      at::NoGradGuard no_grad;
      auto a = cpu.named_parameters(), b = gpu.named_parameters();
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        a[i].value().normal_(0, 0.05);
        b[i].value().copy_(a[i].value());
      }
    }
    gpu.move_buffers(device);
    const at::Tensor x = at::randn({2, 96, dim}), grad = at::randn({2, 96, dim});
    const at::Tensor x_cpu = x.clone().requires_grad_(true), x_gpu = x.to(device).requires_grad_(true);
    at::Tensor y_cpu = cpu(x_cpu, titan::nn::Context{}), y_gpu;
    y_cpu.backward(grad);
    {
      titan::nn::AutocastRegion autocast(titan::nn::AutocastState::enabled_for(device.type(), at::kBFloat16));
      y_gpu = gpu(x_gpu, titan::nn::Context{});
    }
    y_gpu.backward(grad.to(device).to(y_gpu.scalar_type()));
    EXPECT_EQ(y_gpu.device(), device);
    EXPECT_EQ(x_gpu.grad().scalar_type(), at::kFloat);
    double worst = max_relative_difference(y_gpu.detach().cpu(), y_cpu.detach());
    EXPECT_LT(worst, 3e-2) << "output";
    const double dx = max_relative_difference(x_gpu.grad().cpu(), x_cpu.grad());
    EXPECT_LT(dx, 3e-2) << "input gradient";
    worst = std::max(worst, dx);
    auto a = cpu.named_parameters(), b = gpu.named_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = max_relative_difference(b[i].value().grad().cpu(), a[i].value().grad());
      EXPECT_LT(d, 3e-2) << "gradient of " << a[i].key();
      worst = std::max(worst, d);
    }
    figure(scores_before ? "model.moe_autocast_bf16_scores_before.max_rel_diff_vs_cpu_fp32"
                         : "model.moe_autocast_bf16.max_rel_diff_vs_cpu_fp32", worst);
  }
}
