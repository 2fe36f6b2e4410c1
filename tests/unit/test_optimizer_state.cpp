// The optimizer's part of a checkpoint: the moments the trainer allocates before the first step are not saved until
// an update has reached them, so a checkpoint written before any update holds no optimizer tensors, as before.
#include <gtest/gtest.h>

#include "titan/components/optimizer.h"
#include "titan/components/optimizer_state.h"

using titan::distributed::ShardedParameter;
using titan::distributed::TensorLayout;

TEST(OptimizerState, MomentsNoUpdateReachedAreNotSaved) {
  std::vector<ShardedParameter> params;
  for (int64_t rows : {4, 6}) {
    ShardedParameter p;
    p.name = "w" + std::to_string(rows);
    p.local = at::ones({rows, 3}).requires_grad_();
    p.module_param = p.local;
    p.layout = TensorLayout({rows, 3});
    params.push_back(std::move(p));
  }
  titan::config::Optimizer config;
  titan::Adam adam({params[0].local, params[1].local}, config);
  titan::OptimizerState state(adam, params, config);
  adam.init_state();  // what the trainer does before the first step
  ASSERT_EQ(adam.state().size(), 2u);
  auto saved = state.state_dict({});
  EXPECT_TRUE(saved.tensors.empty());
  EXPECT_TRUE(saved.gathered["optimizer"]["steps"].empty());

  // One update reaching w4 only: its moments and step count are saved, w6's are not.
  params[0].local.mutable_grad() = at::full({4, 3}, 0.5);
  adam.step();
  saved = state.state_dict({});
  ASSERT_EQ(saved.tensors.size(), 2u);
  EXPECT_EQ(saved.tensors[0].key, "optimizer.exp_avg.w4");
  EXPECT_EQ(saved.tensors[1].key, "optimizer.exp_avg_sq.w4");
  EXPECT_EQ(saved.gathered["optimizer"]["steps"], nlohmann::json({{"w4", 1.0}}));
  EXPECT_GT(saved.tensors[0].tensor.abs().sum().item<double>(), 0.0);
}
