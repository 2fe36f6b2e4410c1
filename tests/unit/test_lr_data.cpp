// LR schedule values and loss normalisation.
#include <gtest/gtest.h>

#include "test_util.h"
#include "titan/common/error.h"
#include "titan/nn/loss.h"
#include "titan/components/lr_scheduler.h"

using titan::LRScheduler;

TEST(LRScheduler, WarmupThenLinearDecay) {
  titan::config::LRScheduler c;
  c.warmup_steps = 2;
  c.decay_ratio = 0.8;
  c.decay_type = "linear";
  LRScheduler s(c, 8e-4, 10);  // torchtitan's debug TOML
  EXPECT_EQ(s.warmup_steps(), 2);
  EXPECT_EQ(s.decay_steps(), 8);
  EXPECT_EQ(s.stable_steps(), 1);
  const double expected[] = {0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125};
  for (int i = 0; i < 10; ++i) EXPECT_DOUBLE_EQ(s.factor(i), expected[i]) << i;
  EXPECT_DOUBLE_EQ(s.current_lr(), 4e-4);
  s.step();
  EXPECT_DOUBLE_EQ(s.current_lr(), 8e-4);
}

TEST(LRScheduler, SqrtCosineAndMinFactor) {
  titan::config::LRScheduler c;
  c.warmup_steps = 0;
  c.decay_type = "cosine";
  c.min_lr_factor = 0.1;
  LRScheduler cosine(c, 1.0, 4);  // decay over all 4 steps, stable 1
  EXPECT_DOUBLE_EQ(cosine.factor(0), 1.0);
  EXPECT_NEAR(cosine.factor(1), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_NEAR(cosine.factor(4), 0.1, 1e-15);
  c.decay_type = "sqrt";
  c.min_lr_factor = 0;
  LRScheduler sqrt_s(c, 1.0, 4);
  EXPECT_NEAR(sqrt_s.factor(2), 1 - std::sqrt(0.5), 1e-15);
}

TEST(LRScheduler, WarmupLongerThanTrainingIsClamped) {
  titan::config::LRScheduler c;
  c.warmup_steps = 200;
  LRScheduler s(c, 1.0, 10);
  EXPECT_EQ(s.warmup_steps(), 10);
  EXPECT_DOUBLE_EQ(s.factor(4), 0.5);
}

TEST(Loss, SumsInFloat32AndIgnoresPadding) {
  at::Tensor logits = at::randn({2, 3, 5}).to(at::kBFloat16);
  at::Tensor labels = at::tensor({1, 2, -100, 4, -100, 0}, at::kLong).view({2, 3});
  at::Tensor loss = titan::cross_entropy_sum(logits, labels);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_EQ(titan::count_valid_tokens(labels), 4);
  at::Tensor logp = at::log_softmax(logits.to(at::kFloat).view({6, 5}), 1);
  double expected = -(logp[0][1] + logp[1][2] + logp[3][4] + logp[5][0]).item<double>();
  EXPECT_NEAR(loss.item<double>(), expected, 1e-5);
}
