// The trainer on one GPU, in process: it picks the GPU, bf16-autocast and bf16-parameter training lower the loss,
// the three AdamW implementations agree, optimizer steps in backward equal the ordinary step, deterministic mode repeats losses bitwise, and a checkpoint saved from
// GPU tensors loads back bitwise (weights, AdamW moments and steps, the data stream) in every async mode.
#include "gpu_test_util.h"

#include <sstream>

#include "titan/config/loader.h"
#include "titan/trainer/trainer.h"

namespace {

using titan_gpu_test::figure;

std::vector<double> train_losses(titan::Trainer& trainer, int64_t steps) {
  std::vector<double> losses;
  for (int64_t s = 0; s < steps; ++s) losses.push_back(trainer.train_step(trainer.next_microbatches()).loss);
  return losses;
}

std::string join(const std::vector<double>& values) {
  std::ostringstream out;
  out.precision(9);
  for (size_t i = 0; i < values.size(); ++i) out << (i ? " " : "") << values[i];
  return out.str();
}

// What a checkpoint must bring back, copied to the host.
struct Snapshot {
  std::vector<std::string> names;
  std::vector<at::Tensor> params, exp_avg, exp_avg_sq;
  std::vector<double> steps;
};

Snapshot snapshot(titan::Trainer& trainer) {
  Snapshot s;
  const auto& params = trainer.parameters();
  const auto& state = trainer.optimizer().state();
  for (size_t i = 0; i < params.size(); ++i) {
    s.names.push_back(params[i].name);
    s.params.push_back(params[i].local.detach().cpu().clone());
    s.exp_avg.push_back(state.at(i).exp_avg.detach().cpu().clone());
    s.exp_avg_sq.push_back(state.at(i).exp_avg_sq.detach().cpu().clone());
    s.steps.push_back(state.at(i).step.item<double>());
  }
  return s;
}

}  // namespace

TEST(CudaTrainer, PicksTheGpuAndBfloat16AutocastLowersTheLoss) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  titan_gpu_test::ScratchDir dump("titan_gpu_trainer");
  titan::Trainer trainer(titan::config::load_job_config(titan_gpu_test::debug_trainer_args(dump.path(), {"--training.steps", "30"})));
  if (titan_gpu_test::cuda_available()) {
    EXPECT_TRUE(trainer.compute_device().is_cuda()) << "the trainer chose " << trainer.compute_device().str() << " on a machine with a GPU";
    for (const auto& p : trainer.parameters()) EXPECT_TRUE(p.local.is_cuda()) << p.name;
    EXPECT_EQ(trainer.mesh().world()->backend(), "local");  // one process: no NCCL needed
  }
  auto losses = train_losses(trainer, 30);
  for (double l : losses) ASSERT_TRUE(std::isfinite(l)) << join(losses);
  EXPECT_LT(losses.back(), losses.front() - 1.0) << join(losses);
  figure("trainer.bf16_autocast.loss_first", losses.front());
  figure("trainer.bf16_autocast.loss_last_of_30", losses.back());
}

TEST(CudaTrainer, Bfloat16ParametersTrain) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  titan_gpu_test::ScratchDir dump("titan_gpu_trainer");
  titan::Trainer trainer(titan::config::load_job_config(
      titan_gpu_test::debug_trainer_args(dump.path(), {"--training.steps", "20", "--training.dtype", "bfloat16"})));
  for (const auto& p : trainer.parameters()) ASSERT_EQ(p.local.scalar_type(), at::kBFloat16) << p.name;
  auto losses = train_losses(trainer, 20);
  for (double l : losses) ASSERT_TRUE(std::isfinite(l)) << join(losses);
  EXPECT_LT(losses.back(), losses.front() - 0.5) << join(losses);
  figure("trainer.bf16_params.loss_first", losses.front());
  figure("trainer.bf16_params.loss_last_of_20", losses.back());
}

TEST(CudaTrainer, AdamWImplementationsAgree) {
  // PyTorch's fused kernel (step count on the device), foreach and for-loop: the same float32 training.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  std::vector<double> reference;
  std::vector<at::Tensor> reference_params;
  for (const char* implementation : {"fused", "foreach", "for-loop"}) {
    titan_gpu_test::ScratchDir dump("titan_gpu_trainer");
    titan::Trainer trainer(titan::config::load_job_config(titan_gpu_test::debug_trainer_args(
        dump.path(), {"--training.steps", "5", "--optimizer.implementation", implementation,
                      "--training.mixed_precision_param", "float32"})));
    auto losses = train_losses(trainer, 5);
    std::vector<at::Tensor> params;
    for (const auto& p : trainer.parameters()) params.push_back(p.local.detach().cpu().clone());
    if (reference.empty()) {
      reference = losses;
      reference_params = params;
      continue;
    }
    double worst_loss = 0, worst_param = 0;
    for (size_t i = 0; i < losses.size(); ++i) worst_loss = std::max(worst_loss, std::abs(losses[i] - reference[i]) / reference[i]);
    for (size_t i = 0; i < params.size(); ++i)
      worst_param = std::max(worst_param, titan_gpu_test::max_relative_difference(params[i], reference_params[i]));
    EXPECT_LT(worst_loss, 1e-5) << implementation << " vs fused: " << join(losses) << " / " << join(reference);
    EXPECT_LT(worst_param, 1e-4) << implementation << " vs fused: weights after 5 steps";
    figure(std::string("trainer.adamw_") + implementation + "_vs_fused.loss_max_rel_diff", worst_loss);
    figure(std::string("trainer.adamw_") + implementation + "_vs_fused.weight_max_rel_diff", worst_param);
  }
}

TEST(CudaTrainer, OptimizerStepsInBackwardEqualTheOrdinaryStep) {
  // optimizer.early_step_in_backward: the hooks step each parameter on autograd's device thread, with the fused AdamW
  // kernel on a subset of the parameters; float32 without clipping, so the ordinary step must give the same weights.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<at::Tensor>> weights;
  for (bool early : {false, true}) {
    titan_gpu_test::ScratchDir dump("titan_gpu_trainer");
    std::vector<std::string> extra = {"--training.steps", "5", "--training.mixed_precision_param", "float32", "--training.max_norm", "1e9"};
    if (early) extra.push_back("--optimizer.early_step_in_backward");
    titan::Trainer trainer(titan::config::load_job_config(titan_gpu_test::debug_trainer_args(dump.path(), extra)));
    losses.push_back(train_losses(trainer, 5));
    std::vector<at::Tensor> params;
    for (const auto& p : trainer.parameters()) params.push_back(p.local.detach().cpu().clone());
    weights.push_back(params);
  }
  double worst_loss = 0, worst_param = 0;
  for (size_t i = 0; i < losses[0].size(); ++i) worst_loss = std::max(worst_loss, std::abs(losses[1][i] - losses[0][i]) / losses[0][i]);
  for (size_t i = 0; i < weights[0].size(); ++i)
    worst_param = std::max(worst_param, titan_gpu_test::max_relative_difference(weights[1][i], weights[0][i]));
  // Not bitwise on a GPU: without debug.deterministic the kernels may sum in another order from run to run.
  EXPECT_LT(worst_loss, 1e-5) << join(losses[1]) << " / " << join(losses[0]);
  EXPECT_LT(worst_param, 1e-4) << "weights after 5 steps";
  figure("trainer.early_step_in_backward.loss_max_rel_diff", worst_loss);
  figure("trainer.early_step_in_backward.weight_max_rel_diff", worst_param);
}

TEST(CudaTrainer, DeterministicModeRepeatsLossesBitwise) {
  // debug.deterministic (errors on kernels without a deterministic implementation): the CPU promise, on the GPU.
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  // The trainer switches deterministic algorithms on for the whole process; the tests after this one run without.
  struct Restore {
    ~Restore() { at::globalContext().setDeterministicAlgorithms(false, false); }
  } restore;
  std::vector<std::vector<double>> runs;
  for (int run = 0; run < 2; ++run) {
    titan_gpu_test::ScratchDir dump("titan_gpu_trainer");
    titan::Trainer trainer(titan::config::load_job_config(
        titan_gpu_test::debug_trainer_args(dump.path(), {"--training.steps", "6", "--debug.deterministic"})));
    runs.push_back(train_losses(trainer, 6));
  }
  for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << "step " << i + 1;
  figure("trainer.deterministic.losses", join(runs[0]));
}

TEST(CudaTrainer, CheckpointRoundTripIsBitwise) {
  TITAN_REQUIRE_CUDA_OR_DRY_RUN();
  for (const char* mode : {"disabled", "async", "async_with_pinned_mem"}) {
    SCOPED_TRACE(std::string("checkpoint.async_mode = ") + mode);
    titan_gpu_test::ScratchDir dump("titan_gpu_checkpoint");
    const auto args = titan_gpu_test::debug_trainer_args(
        dump.path(), {"--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "100",
                      "--checkpoint.no_last_save_model_only", "--checkpoint.async_mode", mode});
    titan::Trainer saver(titan::config::load_job_config(args));
    ASSERT_EQ(saver.train(), 0);
    ASSERT_TRUE(std::filesystem::exists(std::filesystem::path(dump.path()) / "checkpoint" / "step-4" / "metadata.json"));
    const Snapshot saved = snapshot(saver);

    titan::Trainer loader(titan::config::load_job_config(args));  // the same folder: resumes from step-4
    EXPECT_EQ(loader.step(), 4);
    const Snapshot loaded = snapshot(loader);
    ASSERT_EQ(loaded.params.size(), saved.params.size());
    int64_t mismatches = 0;
    for (size_t i = 0; i < saved.params.size(); ++i) {
      if (titan_gpu_test::cuda_available()) {
        EXPECT_TRUE(loader.parameters()[i].local.is_cuda()) << saved.names[i];
      }
      const bool same = titan_gpu_test::bitwise_equal(loaded.params[i], saved.params[i]) &&
                        titan_gpu_test::bitwise_equal(loaded.exp_avg[i], saved.exp_avg[i]) &&
                        titan_gpu_test::bitwise_equal(loaded.exp_avg_sq[i], saved.exp_avg_sq[i]) && loaded.steps[i] == saved.steps[i];
      EXPECT_TRUE(same) << saved.names[i] << ": weight, AdamW moments or step differ after the round trip";
      mismatches += !same;
    }
    figure(std::string("checkpoint.") + mode + ".tensors_not_bitwise_after_load", static_cast<double>(mismatches));

    // The data stream and the next step continue as if the run had not stopped.
    auto next_saver = saver.next_microbatches(), next_loader = loader.next_microbatches();
    ASSERT_EQ(next_saver.size(), next_loader.size());
    for (size_t m = 0; m < next_saver.size(); ++m) EXPECT_TRUE(at::equal(next_saver[m].inputs, next_loader[m].inputs)) << "micro-batch " << m;
    const double a = saver.train_step(next_saver).loss, b = loader.train_step(next_loader).loss;
    EXPECT_NEAR(b, a, 1e-6 * std::abs(a)) << "step 5 after resuming";
    figure(std::string("checkpoint.") + mode + ".step5_loss_bitwise_after_resume", a == b ? "yes" : "no");
  }
}
