// The input shape a pipeline stage says it takes (what the fake backend builds its stand-ins from) is held to what
// the stage before it really sends, on two real MPI ranks: a stage that says the truth trains, one that does not is
// an internal error naming both shapes.
#include <gtest/gtest.h>

#include "titan/common/error.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/pipeline/runner.h"

namespace titan::distributed::pipeline {
namespace {

// Ranks 0 and 1 as a 2-stage pipeline (GPipe, 1 micro-batch): stage 0 sends a (2, 3) float32 activation; stage 1
// says it takes `said`. Trains (or, `forward_only`, validates: stage 0 then waits for nothing from a stage 1 that
// stopped) and returns what stage 1 threw ("" when it ran); the other ranks return "".
std::string run_pair(const std::vector<int64_t>& said, bool forward_only = false) {
  auto world = distributed::world(distributed::detect_launch());
  const int r = world->rank();
  auto pair = world->split(r < 2 ? 0 : -1, r, "pipeline pair", r < 2 ? 2 : 0);
  if (!pair) return "";
  const at::Tensor weight = at::ones({2, 3}).requires_grad_(true);
  Stage stage{r, [weight](const at::Tensor& input, int) { return input.defined() ? input * 2 : weight * 3; }};
  if (r == 1) stage.input_shape = [said] { return Stage::Shape{at::kFloat, said}; };
  std::vector<Stage> stages;
  stages.push_back(std::move(stage));
  PipelineRunner runner(Schedule::make("GPipe", 2, 2, 1), std::move(stages), pair, at::kCPU);
  try {
    if (forward_only) runner.evaluate([](const at::Tensor& out, int) { return out.sum(); }, 1);
    else runner.train([](const at::Tensor& out, int) { return out.sum(); }, 1);
  } catch (const titan::UserError& e) {
    return e.what();
  }
  if (r == 0 && !forward_only) EXPECT_TRUE(at::allclose(weight.grad(), at::full({2, 3}, 6.0)));
  return "";
}

TEST(PipelineShapeCheck, AStageSayingTheShapeItReceivesTrains) { EXPECT_EQ(run_pair({2, 3}), ""); }

TEST(PipelineShapeCheck, AStageSayingAnotherShapeIsAnInternalError) {
  // Stage 0's activation stays unreceived once stage 1 has stopped at the header.
  const std::string error = run_pair({2, 4}, /*forward_only=*/true);
  auto world = distributed::world(distributed::detect_launch());
  if (world->rank() != 1) return;
  EXPECT_NE(error.find("internal: stage 1 expects Float [2, 4] from stage 0, which sent Float [2, 3]"), std::string::npos) << error;
}

}  // namespace
}  // namespace titan::distributed::pipeline
