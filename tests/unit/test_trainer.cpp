// The trainer end to end on a tiny corpus: deterministic losses for a fixed seed, and a loss that falls.
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "test_util.h"
#include "titan/common/error.h"
#include "titan/config/loader.h"
#include "titan/trainer/trainer.h"

namespace {

std::vector<std::string> tiny_job(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
                                   "--training.seq_len", "64", "--training.local_batch_size", "2",
                                   "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "100",
                                   "--job.dump_folder", (std::filesystem::temp_directory_path() / "titan_unit_trainer").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<double> train_losses(const std::vector<std::string>& extra) {
  titan::Trainer trainer(titan::config::load_job_config(tiny_job(extra)));
  std::vector<double> losses;
  for (int64_t s = 0; s < trainer.config().training.steps; ++s) losses.push_back(trainer.train_step(trainer.next_microbatches()).loss);
  return losses;
}

}  // namespace

TEST(Trainer, SameSeedSameConfigGivesBitwiseIdenticalLosses) {
  if (!std::filesystem::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes package not installed";
  std::vector<std::string> cfg = {"--training.steps", "4", "--debug.seed", "7", "--debug.deterministic"};
  auto a = train_losses(cfg);
  auto b = train_losses(cfg);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  auto other_seed = train_losses({"--training.steps", "4", "--debug.seed", "8"});
  EXPECT_NE(a[0], other_seed[0]);
}

TEST(Trainer, LossFallsOnRealText) {
  if (!std::filesystem::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes package not installed";
  auto losses = train_losses({"--training.steps", "12", "--debug.seed", "1", "--optimizer.lr", "3e-3"});
  EXPECT_LT(losses.back(), losses.front() - 1.0) << losses.front() << " -> " << losses.back();
}

TEST(Trainer, GradientAccumulationFromGlobalBatchSize) {
  if (!std::filesystem::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes package not installed";
  std::vector<std::string> args = {"--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "32",
                                   "--training.local_batch_size", "2", "--training.global_batch_size", "6", "--job.dump_folder",
                                   (std::filesystem::temp_directory_path() / "titan_unit_trainer").string()};
  titan::Trainer trainer(titan::config::load_job_config(args));
  EXPECT_EQ(trainer.gradient_accumulation_steps(), 3);
  auto mbs = trainer.next_microbatches();
  EXPECT_EQ(mbs.size(), 3u);
  EXPECT_EQ(trainer.train_step(mbs).tokens, 3 * 2 * 32);
  args[9] = "5";
  EXPECT_THROW(titan::Trainer(titan::config::load_job_config(args)), titan::UserError);
}

TEST(Trainer, Bfloat16ParametersTrain) {
  if (!std::filesystem::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes package not installed";
  auto losses = train_losses({"--training.steps", "8", "--training.dtype", "bfloat16", "--debug.seed", "2", "--optimizer.lr", "3e-3"});
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front() - 0.5);
}

TEST(Trainer, ActivationCheckpointingUnderAutocastKeepsLossesAcrossSteps) {
  // bf16 autocast (the default) with checkpointed blocks: recomputation must not leave low-precision weight copies
  // behind for the next step's forward.
  if (!std::filesystem::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes package not installed";
  std::vector<std::string> base = {"--training.steps", "4", "--debug.seed", "3", "--optimizer.lr", "3e-3"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), base.begin(), base.end());
    return train_losses(extra);
  };
  auto none = with({"--activation_checkpoint.mode", "none"});
  auto full = with({"--activation_checkpoint.mode", "full"});
  auto every2 = with({"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"});
  for (size_t i = 0; i < none.size(); ++i) {
    EXPECT_EQ(full[i], none[i]) << "step " << i + 1;
    EXPECT_EQ(every2[i], none[i]) << "step " << i + 1;
  }
}

namespace {

struct StepCasts {
  std::vector<double> losses, grad_norms;
  int64_t most_casts_of_one_weight = 0;  // in the last step
  int64_t weights_cast = 0;
};

// Trains `steps` steps, counting through LibTorch's op observer how often each parameter is cast (aten::_to_copy
// with the parameter as its input) in the last step.
StepCasts train_counting_casts(const std::vector<std::string>& extra, int steps) {
  titan::Trainer trainer(titan::config::load_job_config(tiny_job(extra)));
  static std::mutex mutex;
  static std::unordered_map<const c10::TensorImpl*, int64_t>* counts = nullptr;
  std::unordered_map<const c10::TensorImpl*, int64_t> casts;
  for (const auto& p : trainer.parameters()) casts[p.local.unsafeGetTensorImpl()] = 0;
  // Stops counting and removes the observer however this function ends.
  struct Observer {
    at::CallbackHandle handle;
    ~Observer() {
      {
        std::lock_guard<std::mutex> lock(mutex);
        counts = nullptr;
      }
      at::removeCallback(handle);
    }
  } observer{};
  observer.handle = at::addGlobalCallback(at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                                        if (std::string_view(fn.name()) != "aten::_to_copy") return nullptr;
                                        const auto inputs = fn.inputs();
                                        if (inputs.empty() || !inputs[0].isTensor()) return nullptr;
                                        std::lock_guard<std::mutex> lock(mutex);
                                        if (!counts) return nullptr;
                                        auto it = counts->find(inputs[0].toTensor().unsafeGetTensorImpl());
                                        if (it != counts->end()) ++it->second;
                                        return nullptr;
                                      })
                                          .needsInputs(true)
                                          .scopes({at::RecordScope::FUNCTION}));
  StepCasts out;
  for (int s = 0; s < steps; ++s) {
    if (s + 1 == steps) {
      std::lock_guard<std::mutex> lock(mutex);
      counts = &casts;
    }
    const auto r = trainer.train_step(trainer.next_microbatches());
    out.losses.push_back(r.loss);
    out.grad_norms.push_back(r.grad_norm);
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    counts = nullptr;
  }
  for (const auto& [impl, n] : casts) {
    out.most_casts_of_one_weight = std::max(out.most_casts_of_one_weight, n);
    out.weights_cast += n > 0;
  }
  return out;
}

}  // namespace

TEST(Trainer, EachWeightIsCastOncePerStepUnderAutocast) {
  // Two micro-batches with every block checkpointed: LibTorch's autocast alone casts each weight in both forwards
  // and both recomputations (training.autocast_weight_casts = "forward"); titan's default keeps the copies over the step. The
  // losses and gradient norms are the same bit for bit either way, and the same as without checkpointing.
  if (!std::filesystem::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes package not installed";
  const std::vector<std::string> job = {"--training.steps", "3", "--debug.seed", "5", "--optimizer.lr", "3e-3", "--debug.deterministic",
                                        "--training.global_batch_size", "4", "--activation_checkpoint.mode", "full"};
  std::vector<std::string> no_ac = job;
  no_ac.back() = "none";
  StepCasts once, every_use, plain;
  std::vector<std::string> forward = job;
  forward.insert(forward.end(), {"--training.autocast_weight_casts", "forward"});
  once = train_counting_casts(job, 3);
  plain = train_counting_casts(no_ac, 3);
  every_use = train_counting_casts(forward, 3);

  EXPECT_GE(once.weights_cast, 6 * 7 + 1) << "the debug model: six blocks of seven matrices, and the output";
  EXPECT_EQ(once.most_casts_of_one_weight, 1);
  EXPECT_EQ(every_use.most_casts_of_one_weight, 4) << "two forwards and two recomputations";
  EXPECT_EQ(plain.most_casts_of_one_weight, 1);
  for (size_t i = 0; i < once.losses.size(); ++i) {
    EXPECT_EQ(once.losses[i], every_use.losses[i]) << "step " << i + 1;
    EXPECT_EQ(once.grad_norms[i], every_use.grad_norms[i]) << "step " << i + 1;
    EXPECT_EQ(once.losses[i], plain.losses[i]) << "step " << i + 1;
    EXPECT_EQ(once.grad_norms[i], plain.grad_norms[i]) << "step " << i + 1;
  }
}

TEST(Trainer, RefusesAnUnknownWeightCastSetting) {
  try {
    titan::Trainer trainer(
        titan::config::load_job_config(tiny_job({"--training.steps", "1", "--training.autocast_weight_casts", "sometimes"})));
    FAIL() << "training.autocast_weight_casts = sometimes was accepted";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("training.autocast_weight_casts"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sometimes"), std::string::npos) << e.what();
  }
}
