// Expert parallelism on real MPI ranks: titan's MoE layer with its experts split over every rank gives each rank the
// output and gradients the whole layer gives on one process (every rank holding all weights), and the dispatch and
// combine move exactly the bytes the routed counts call for.
#include <gtest/gtest.h>

#include "titan/distributed/communicator.h"
#include "titan/distributed/expert_parallel.h"
#include "titan/models/common/moe.h"

using namespace titan;

namespace {

std::shared_ptr<distributed::Communicator> comm() { return distributed::world(distributed::detect_launch()); }

at::Tensor seeded(std::vector<int64_t> shape, uint64_t seed, double scale) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return (at::randn(shape, gen, at::kDouble) * scale).to(at::kFloat);
}

models::MoEArgs args() {
  models::MoEArgs a;
  a.num_experts = 8;
  a.num_shared_experts = 1;
  a.top_k = 2;
  a.score_func = "softmax";
  a.route_norm = true;
  a.score_before_experts = false;
  a.hidden_dim = 12;
  a.load_balance_coeff.reset();
  return a;
}

// The same weights on every rank, from fixed seeds.
void fill(models::MoE& moe) {
  at::NoGradGuard no_grad;
  uint64_t seed = 10;
  for (auto& item : moe.named_parameters()) item.value().copy_(seeded(item.value().sizes().vec(), seed++, item.key().find("router") != std::string::npos ? 0.5 : 0.1));
}

}  // namespace

TEST(ExpertParallel, LayerMatchesTheWholeLayerAndMovesTheRoutedBytes) {
  auto group = comm();
  const int n = group->size(), r = group->rank();
  if (8 % n != 0) GTEST_SKIP() << "8 experts over " << n << " ranks";
  constexpr int64_t dim = 16;
  models::MoE whole(dim, args(), {}), split(dim, args(), {});
  fill(whole);
  fill(split);
  std::vector<distributed::ShardedParameter> params = distributed::describe_parameters(split);
  distributed::ExpertParallel ep(group, 8);
  ep.apply("moe.experts", *split.experts, {split.experts->w1, split.experts->w2, split.experts->w3}, params);
  EXPECT_EQ(split.experts->w1.size(0), 8 / n);

  // Each rank its own tokens (a different number per rank); the same upstream gradient for both layers.
  const at::Tensor x = seeded({1, 5 + 3 * r, dim}, 100 + r, 1.0), grad = seeded({1, 5 + 3 * r, dim}, 200 + r, 1.0);
  const at::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  const at::Tensor ya = whole(xa, nn::Context{});
  ya.backward(grad);
  const int64_t before = group->bytes_communicated();
  const at::Tensor yb = split(xb, nn::Context{});
  yb.backward(grad);
  const int64_t moved = group->bytes_communicated() - before;
  EXPECT_TRUE(at::allclose(ya, yb, 1e-5, 1e-6)) << (ya - yb).abs().max();
  EXPECT_TRUE(at::allclose(xa.grad(), xb.grad(), 1e-5, 1e-6)) << (xa.grad() - xb.grad()).abs().max();
  // This rank's experts saw every rank's tokens for them: their weight gradients are the whole layer's summed over
  // the ranks, at their rows. The router's are this rank's tokens' share, as in the whole layer on the same tokens.
  const int64_t local = 8 / n;
  for (auto [a, b] : {std::pair{whole.experts->w1, split.experts->w1}, std::pair{whole.experts->w2, split.experts->w2},
                      std::pair{whole.experts->w3, split.experts->w3}}) {
    at::Tensor total = a.grad().contiguous();
    group->all_reduce(total, distributed::ReduceOp::Sum);
    EXPECT_TRUE(at::allclose(total.narrow(0, r * local, local), b.grad(), 1e-5, 1e-6)) << (total.narrow(0, r * local, local) - b.grad()).abs().max();
  }
  EXPECT_TRUE(at::allclose(whole.router->gate->weight.grad(), split.router->gate->weight.grad(), 1e-5, 1e-6));

  // Bytes: from this rank's routing, the rows it sends to each rank; from every rank's, the rows it receives. Forward
  // sends S (dispatch) and R (combine) rows, backward R and S again; plus the all-gather of counts and headroom.
  const at::Tensor counts = whole.router->route(x.view({-1, dim}), at::Tensor(), nn::Context{}).counts.to(at::kLong);
  at::Tensor all = at::empty({n * 8}, at::kLong);
  group->all_gather_into(all, counts.contiguous());
  int64_t sent = 0, received = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (j == r) continue;
    sent += counts.narrow(0, j * local, local).sum().item<int64_t>();
    received += all.view({n, 8})[j].narrow(0, r * local, local).sum().item<int64_t>();
  }
  const int64_t tables = (n - 1) * (8 + 1) * 8;  // the counts-and-headroom all-gather, in ring bytes
  EXPECT_EQ(moved, 2 * (sent + received) * dim * 4 + tables) << "sent " << sent << " received " << received;
  EXPECT_GT(sent + received, 0);
}
