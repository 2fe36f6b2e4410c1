// comm.mode = "fake_backend"'s communicator (distributed/communicator.h, make_fake_world): each operation's answer is
// what it would be if every rank were a copy of this one, and its bytes what the real collective would send.
#include <gtest/gtest.h>

#include <cmath>

#include "titan/common/error.h"
#include "titan/distributed/communicator.h"

using titan::distributed::make_fake_world;
using titan::distributed::make_local_communicator;
using titan::distributed::ReduceOp;

namespace {

// Rank 2 of 4.
constexpr int kRank = 2, kSize = 4;

}  // namespace

TEST(FakeCommunicator, ReductionsAreThoseOfIdenticalRanks) {
  auto world = make_fake_world(kRank, kSize);
  EXPECT_EQ(world->rank(), kRank);
  EXPECT_EQ(world->size(), kSize);
  at::Tensor x = at::tensor({1.5, -2.0}, at::kDouble);
  world->all_reduce(x, ReduceOp::Sum);
  EXPECT_TRUE(at::equal(x, at::tensor({6.0, -8.0}, at::kDouble)));
  // A ring all-reduce sends 2 (n - 1) / n of the tensor: 2 x 3 / 4 x 16 bytes.
  EXPECT_EQ(world->bytes_communicated(), 24);
  for (ReduceOp op : {ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    at::Tensor y = at::tensor({1.5, -2.0}, at::kDouble);
    world->all_reduce(y, op);
    EXPECT_TRUE(at::equal(y, at::tensor({1.5, -2.0}, at::kDouble)));
  }
  at::Tensor flag = at::tensor({1, 0}, at::kInt).to(at::kBool);
  world->all_reduce(flag, ReduceOp::Sum);  // a logical or of equal flags
  EXPECT_TRUE(at::equal(flag, at::tensor({1, 0}, at::kInt).to(at::kBool)));
}

TEST(FakeCommunicator, GathersAndScattersThisRanksBlocks) {
  auto world = make_fake_world(kRank, kSize);
  const at::Tensor mine = at::tensor({7, 8, 9}, at::kLong);  // 24 bytes, sent to the 3 others
  at::Tensor gathered = at::empty({kSize * 3}, at::kLong);
  world->all_gather_into(gathered, mine);
  EXPECT_TRUE(at::equal(gathered, mine.repeat({kSize})));
  EXPECT_EQ(world->bytes_communicated(), 3 * 24);
  // Reduce-scatter: block `rank` of every (identical) rank's input, summed or averaged.
  const at::Tensor input = at::arange(kSize * 2, at::kFloat);
  at::Tensor out = at::empty({2}, at::kFloat);
  world->reduce_scatter(out, input, ReduceOp::Sum);
  EXPECT_TRUE(at::equal(out, at::tensor({4.0f * kSize, 5.0f * kSize})));
  world->reduce_scatter(out, input, ReduceOp::Avg);
  EXPECT_TRUE(at::equal(out, at::tensor({4.0f, 5.0f})));
}

TEST(FakeCommunicator, AllToAllHandsBackWhatThisRankSendsItself) {
  auto world = make_fake_world(kRank, kSize);
  const at::Tensor input = at::arange(kSize * 2, at::kLong);  // block j = {2j, 2j + 1}
  at::Tensor out = at::empty({kSize * 2}, at::kLong);
  world->all_to_all(out, input);
  EXPECT_TRUE(at::equal(out, at::tensor({4, 5}, at::kLong).repeat({kSize})));
  // Uneven: this rank sends 1, 2, 3, 1 elements to ranks 0..3; every copy sends it what it sends itself (3 elements).
  const at::Tensor uneven = at::tensor({10, 20, 21, 30, 31, 32, 40}, at::kLong);
  const int64_t before = world->bytes_communicated();
  at::Tensor received = at::empty({12}, at::kLong);
  world->all_to_all_v(received, uneven, {3, 3, 3, 3}, {1, 2, 3, 1});
  EXPECT_TRUE(at::equal(received, at::tensor({30, 31, 32}, at::kLong).repeat({kSize})));
  // Bytes: what goes to the other ranks (1 + 2 + 1 elements).
  EXPECT_EQ(world->bytes_communicated() - before, 4 * 8);
  // The way back, where blocks have other lengths: the same rows, repeated or cut to fit.
  at::Tensor back = at::empty({7}, at::kLong);
  world->all_to_all_v(back, received, {1, 2, 3, 1}, {3, 3, 3, 3});
  EXPECT_TRUE(at::equal(back, at::tensor({30, 30, 31, 30, 31, 32, 30}, at::kLong)));
  // A ring shift receives what it sends.
  at::Tensor shifted = at::empty({2}, at::kLong);
  world->send_recv(at::tensor({5, 6}, at::kLong), 3, shifted, 1);
  EXPECT_TRUE(at::equal(shifted, at::tensor({5, 6}, at::kLong)));
}

TEST(FakeCommunicator, SplitsTakeTheirSize) {
  auto world = make_fake_world(kRank, kSize);
  auto pair = world->split(0, 1, "pair", 2);
  ASSERT_NE(pair, nullptr);
  EXPECT_EQ(pair->rank(), 1);
  EXPECT_EQ(pair->size(), 2);
  EXPECT_TRUE(pair->simulated());
  EXPECT_EQ(world->split(-1, 0, "none", 2), nullptr);
  EXPECT_THROW(world->split(0, 0, "unsized"), titan::UserError);
}

TEST(FakeCommunicator, ReceivesFillTheCallersBufferWithTheSameStandInsEveryRun) {
  // A pipeline neighbour's message is no copy of this rank's: standard normal values of the caller's shape, from a
  // fixed seed (so two runs, or two communicators, agree), zeros for integer buffers; the process's generator is
  // left alone.
  EXPECT_FALSE(make_local_communicator()->simulated());
  auto first = make_fake_world(kRank, kSize), second = make_fake_world(kRank, kSize);
  EXPECT_TRUE(first->simulated());
  at::manual_seed(7);
  const at::Tensor expected_draw = at::randn({3});
  at::manual_seed(7);
  at::Tensor a = at::full({64, 32}, 5.0, at::kBFloat16), b = at::empty({64, 32}, at::kBFloat16);
  first->recv(a, 1)->wait();
  second->recv(b, 2)->wait();
  EXPECT_TRUE(at::equal(a, b));
  const double mean = a.to(at::kFloat).mean().item<double>(), std = a.to(at::kFloat).std().item<double>();
  EXPECT_LT(std::abs(mean), 0.1);
  EXPECT_NEAR(std, 1.0, 0.1);
  EXPECT_TRUE(at::equal(at::randn({3}), expected_draw)) << "the receive drew from the process's generator";
  at::Tensor next = at::empty({64, 32}, at::kBFloat16);
  first->recv(next, 1);
  EXPECT_FALSE(at::equal(next, a)) << "each receive draws new values";
  at::Tensor header = at::full({8}, 3, at::kLong);
  first->recv(header, 1);
  EXPECT_EQ(header.abs().sum().item<int64_t>(), 0);
  EXPECT_THROW(first->recv(header, kSize), titan::UserError);
}
