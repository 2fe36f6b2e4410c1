// PipelineRunner on the fake backend (comm.mode = "fake_backend"): a stage after the first takes stand-ins of the
// shape it says it takes, since nothing arrives from its neighbour; without that shape it cannot run.
#include <gtest/gtest.h>

#include "titan/common/error.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/pipeline/runner.h"

namespace titan::distributed::pipeline {
namespace {

// Rank 1 of a 2-rank pipeline (1F1B, 2 stages, 2 micro-batches): it holds the last stage.
PipelineRunner last_stage_of_two(std::vector<std::vector<int64_t>>& inputs, bool says_shape) {
  Stage stage{1, [&inputs](const at::Tensor& input, int) {
                inputs.push_back(input.sizes().vec());
                EXPECT_EQ(input.scalar_type(), at::kBFloat16);
                return input.to(at::kFloat).square().sum();
              }};
  if (says_shape) stage.input_shape = [] { return Stage::Shape{at::kBFloat16, {2, 16, 8}}; };
  std::vector<Stage> stages;
  stages.push_back(std::move(stage));
  return PipelineRunner(Schedule::make("1F1B", 2, 2, 2), std::move(stages), make_fake_world(1, 2), at::kCPU);
}

TEST(PipelineRunnerOnTheFakeBackend, AStageTakesStandInsOfTheShapeItSays) {
  std::vector<std::vector<int64_t>> inputs;
  PipelineRunner runner = last_stage_of_two(inputs, /*says_shape=*/true);
  const at::Tensor loss = runner.train([](const at::Tensor& out, int) { return out; }, 1);
  ASSERT_EQ(inputs.size(), 2u);
  for (const auto& sizes : inputs) EXPECT_EQ(sizes, (std::vector<int64_t>{2, 16, 8}));
  EXPECT_EQ(runner.bytes_sent(), 2 * 256 * 2);  // the two input gradients (bf16) go back to stage 0

  // Standard normal stand-ins: each micro-batch's sum of squares is about its 256 elements.
  EXPECT_NEAR(loss.item<double>(), 512.0, 100.0);
  EXPECT_EQ(runner.header_reads(), 0);
  // Validation takes the same shape.
  runner.evaluate([](const at::Tensor& out, int) { return out; }, 2);
  EXPECT_EQ(inputs.size(), 4u);
}

TEST(PipelineRunnerOnTheFakeBackend, AStageThatDoesNotSayItsShapeCannotRun) {
  std::vector<std::vector<int64_t>> inputs;
  PipelineRunner runner = last_stage_of_two(inputs, /*says_shape=*/false);
  try {
    runner.train([](const at::Tensor& out, int) { return out; }, 1);
    FAIL() << "a stage without its input's shape ran on the fake backend";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("does not say the shape of its input"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace titan::distributed::pipeline
