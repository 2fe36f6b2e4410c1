// Differentiable collectives and the vocabulary-parallel loss on real MPI ranks: forward values and input
// gradients against the same global computation differentiated by LibTorch's autograd in one process.
#include <gtest/gtest.h>

#include "titan/distributed/communicator.h"
#include "titan/distributed/functional_collectives.h"
#include "titan/distributed/loss_parallel.h"

using namespace titan::distributed;
namespace fc = titan::distributed::functional;

namespace {

std::shared_ptr<Communicator> comm() { return world(detect_launch()); }

// The same tensor on every rank: drawn from a generator seeded with `seed`.
at::Tensor global(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble).to(at::kFloat);
}

at::Tensor my_chunk(const at::Tensor& t, int64_t dim) {
  return t.chunk(comm()->size(), dim)[comm()->rank()].contiguous();
}

}  // namespace

TEST(FunctionalCollectives, AllGatherWithPartialGradientsReduceScattersThem) {
  auto group = comm();
  const int n = group->size(), r = group->rank();
  for (int64_t dim : {0, 1}) {
    at::Tensor X = global(dim == 0 ? std::vector<int64_t>{2L * n, 3} : std::vector<int64_t>{3, 2L * n}, 1);
    at::Tensor x = my_chunk(X, dim).requires_grad_(true);
    at::Tensor y = fc::all_gather(x, dim, group, fc::GatheredGradient::Partial);
    EXPECT_TRUE(at::equal(y, X));
    // Each rank uses the gathered tensor in its own computation (weights C_r): the total loss is their sum.
    (y * global(X.sizes().vec(), 100 + r)).sum().backward();
    at::Tensor expected = at::zeros_like(X);
    for (int q = 0; q < n; ++q) expected += global(X.sizes().vec(), 100 + q);
    EXPECT_TRUE(at::allclose(x.grad(), my_chunk(expected, dim), 1e-6, 1e-6)) << "dim " << dim;
  }
}

TEST(FunctionalCollectives, AllGatherWithReplicatedGradientsTakesTheLocalChunk) {
  auto group = comm();
  const int n = group->size();
  at::Tensor X = global({4, 2L * n}, 2);
  at::Tensor x = my_chunk(X, -1).requires_grad_(true);
  at::Tensor C = global({4, 2L * n}, 3);
  // Every rank computes the same loss from the gathered tensor: one loss, whose gradient is C.
  (fc::all_gather(x, -1, group, fc::GatheredGradient::Replicated) * C).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), my_chunk(C, -1)));
}

TEST(FunctionalCollectives, ReduceScatterAndAllReduce) {
  auto group = comm();
  const int n = group->size(), r = group->rank();
  at::Tensor A = global({3, 2L * n, 5}, 10 + r).requires_grad_(true);
  at::Tensor y = fc::reduce_scatter(A, 1, group);
  at::Tensor sum = at::zeros({3, 2L * n, 5});
  for (int q = 0; q < n; ++q) sum += global({3, 2L * n, 5}, 10 + q);
  EXPECT_TRUE(at::allclose(y, my_chunk(sum, 1), 1e-6, 1e-6));
  // L = sum_r <chunk_r(sum_q A_q), D_r> = <sum_q A_q, cat_r D_r>: every A_q's gradient is cat_r D_r.
  std::vector<at::Tensor> D;
  for (int q = 0; q < n; ++q) D.push_back(global({3, 2, 5}, 50 + q));
  (y * D[r]).sum().backward();
  EXPECT_TRUE(at::allclose(A.grad(), at::cat(D, 1), 1e-6, 1e-6));

  at::Tensor a = global({7}, 20 + r).requires_grad_(true);
  at::Tensor total = fc::all_reduce(a, group);
  at::Tensor expected = at::zeros({7});
  for (int q = 0; q < n; ++q) expected += global({7}, 20 + q);
  EXPECT_TRUE(at::allclose(total, expected, 1e-6, 1e-6));
  at::Tensor E = global({7}, 30);
  (total * E).sum().backward();  // the same loss on every rank
  EXPECT_TRUE(at::equal(a.grad(), E));
}

TEST(FunctionalCollectives, AllToAllSwapsShardedDimensionsBothWays) {
  auto group = comm();
  const int n = group->size(), r = group->rank();
  at::Tensor X = global({2L * n, 3L * n}, 4);
  at::Tensor x = my_chunk(X, 0).requires_grad_(true);  // rows of X
  at::Tensor y = fc::all_to_all(x, /*split_dim=*/1, /*concat_dim=*/0, group);
  EXPECT_TRUE(at::equal(y, my_chunk(X, 1)));  // columns of X
  std::vector<at::Tensor> F;
  for (int q = 0; q < n; ++q) F.push_back(global({2L * n, 3}, 70 + q));
  (y * F[r]).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), my_chunk(at::cat(F, 1), 0)));
  // bfloat16 travels too.
  at::Tensor h = my_chunk(X, 0).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(fc::raw::all_to_all(h, 1, 0, *group), my_chunk(X, 1).to(at::kBFloat16)));
}

// Rank r sends 1 + (r + j) % 2 rows to rank j; backward returns each row's gradient to where the row came from.
TEST(FunctionalCollectives, UnevenAllToAllRowsAndBack) {
  auto group = comm();
  const int n = group->size(), r = group->rank();
  std::vector<int64_t> in_rows, out_rows;
  for (int j = 0; j < n; ++j) in_rows.push_back(1 + (r + j) % 2), out_rows.push_back(1 + (j + r) % 2);
  int64_t mine = 0;
  for (int64_t k : in_rows) mine += k;
  at::Tensor x = global({mine, 3}, 200 + r).requires_grad_(true);
  at::Tensor y = fc::all_to_all_rows(x, out_rows, in_rows, group);
  // Rank i's block for this rank, from rank i's own input.
  std::vector<at::Tensor> expected;
  for (int i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (int j = 0; j < r; ++j) offset += 1 + (i + j) % 2;
    expected.push_back(global({[&] { int64_t t = 0; for (int j = 0; j < n; ++j) t += 1 + (i + j) % 2; return t; }(), 3}, 200 + i)
                           .narrow(0, offset, 1 + (i + r) % 2));
  }
  EXPECT_TRUE(at::equal(y, at::cat(expected)));
  // L = sum over ranks of <y_r, W_r>: x's gradient is the rows of W that its rows landed on.
  at::Tensor W = global(y.sizes().vec(), 300 + r);
  (y * W).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), fc::raw::all_to_all_rows(W, in_rows, out_rows, *group)));
}

TEST(LossParallel, VocabularyShardedCrossEntropyMatchesTheWholeLogits) {
  auto group = comm();
  const int n = group->size();
  const int64_t vocab = 8L * n;
  at::Tensor logits = global({2, 5, vocab}, 5) * 3;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  at::Tensor labels = at::randint(0, vocab, {2, 5}, gen, at::kLong);
  labels[0][1] = -100;
  labels[1][4] = -100;
  at::Tensor full = logits.clone().requires_grad_(true);
  at::Tensor reference = at::cross_entropy_loss(full.flatten(0, 1), labels.flatten(), {}, at::Reduction::Sum, -100);
  reference.backward();
  at::Tensor local = my_chunk(logits, -1).requires_grad_(true);
  at::Tensor loss = vocab_parallel_cross_entropy_sum(local, labels, group->rank() * 8, group, -100);
  EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());
  (loss * 0.5).backward();
  EXPECT_TRUE(at::allclose(local.grad(), my_chunk(full.grad(), -1) * 0.5, 1e-5, 1e-6));
  // Ignored tokens get no gradient.
  EXPECT_EQ(local.grad()[0][1].abs().sum().item<float>(), 0.0f);
}

// The fused projection and loss over this rank's rows of the output weight: the loss of the whole projection,
// this rank's rows of its weight gradient, and a partial input gradient whose sum over ranks is the whole one.
// 1,500 tokens make two chunks, each with its own reductions.
TEST(LossParallel, FusedProjectionOverVocabularyShardsMatchesTheWholeProjection) {
  auto group = comm();
  const int n = group->size();
  const int64_t vocab = 40L * n, dim = 12, tokens = 1500;
  at::Tensor x = global({tokens, dim}, 7);
  at::Tensor weight = global({vocab, dim}, 8) * 0.4;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor labels = at::randint(0, vocab, {tokens}, gen, at::kLong);
  labels.narrow(0, 100, 30).fill_(-100);
  at::Tensor x_full = x.clone().requires_grad_(true), w_full = weight.clone().requires_grad_(true);
  at::Tensor reference = at::cross_entropy_loss(at::linear(x_full, w_full), labels, {}, at::Reduction::Sum, -100);
  reference.backward();
  at::Tensor x_local = x.clone().requires_grad_(true), w_local = my_chunk(weight, 0).requires_grad_(true);
  at::Tensor loss = linear_cross_entropy_sum(x_local, w_local, labels, group->rank() * 40, group, -100);
  EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());
  (loss * 0.5).backward();
  EXPECT_TRUE(at::allclose(w_local.grad(), my_chunk(w_full.grad(), 0) * 0.5, 1e-5, 1e-6));
  at::Tensor summed = x_local.grad().clone();
  group->all_reduce(summed, ReduceOp::Sum);
  EXPECT_TRUE(at::allclose(summed, x_full.grad() * 0.5, 1e-5, 1e-6));
}
