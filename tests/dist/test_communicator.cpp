// The Communicator and DeviceMesh on real MPI ranks (run under `mpirun -np 4`): every collective, in float32,
// bfloat16 and int64, synchronous and asynchronous, on the world and on split groups.
#include <gtest/gtest.h>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/distributed/checking_communicator.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/mpi_runtime.h"
#include "titan/distributed/parallel_dims.h"

using namespace titan::distributed;

namespace {
std::shared_ptr<Communicator> g_world;
}

TEST(Communicator, AllReduceOpsAndDtypes) {
  const int r = g_world->rank(), n = g_world->size();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    at::Tensor t = at::full({5}, r + 1, at::TensorOptions().dtype(dtype));
    g_world->all_reduce(t, ReduceOp::Sum);
    EXPECT_TRUE(at::all(t == n * (n + 1) / 2).item<bool>()) << c10::toString(dtype);
    at::Tensor m = at::arange(3, at::TensorOptions().dtype(dtype)) * (r + 1);
    g_world->all_reduce(m, ReduceOp::Max);
    EXPECT_EQ(m[2].item<double>(), 2.0 * n);
    g_world->all_reduce(m, ReduceOp::Min);
    EXPECT_EQ(m[2].item<double>(), 2.0 * n);
  }
  at::Tensor avg = at::full({4}, static_cast<double>(r), at::kFloat);
  g_world->all_reduce(avg, ReduceOp::Avg);
  EXPECT_FLOAT_EQ(avg[0].item<float>(), (n - 1) / 2.0f);
}

TEST(Communicator, BoolReductionsAreLogicalAndStayBooleans) {
  // A sum of flags is their logical or: every byte stays 0 or 1 (a byte sum would leave n in a bool).
  const int r = g_world->rank(), n = g_world->size();
  at::Tensor any = at::tensor({1, r == 0 ? 1 : 0, 0}, at::kByte).to(at::kBool);
  g_world->all_reduce(any, ReduceOp::Sum);
  at::Tensor bytes = any.view(at::kByte);
  EXPECT_EQ(bytes[0].item<int>(), 1);
  EXPECT_EQ(bytes[1].item<int>(), 1);
  EXPECT_EQ(bytes[2].item<int>(), 0);
  at::Tensor all = at::tensor({1, r != 0 ? 1 : 0}, at::kByte).to(at::kBool);
  g_world->all_reduce(all, ReduceOp::Min);
  EXPECT_EQ(all.view(at::kByte)[0].item<int>(), 1);
  EXPECT_EQ(all.view(at::kByte)[1].item<int>(), n == 1 ? 1 : 0);
  at::Tensor flags = at::ones({n}, at::kBool), mine = at::empty({1}, at::kBool);
  g_world->reduce_scatter(mine, flags, ReduceOp::Sum);
  EXPECT_EQ(mine.view(at::kByte)[0].item<int>(), 1);
}

TEST(Communicator, GatherScatterBroadcast) {
  const int r = g_world->rank(), n = g_world->size();
  at::Tensor in = at::full({3}, r, at::kFloat);
  at::Tensor out = at::empty({n * 3}, at::kFloat);
  g_world->all_gather_into(out, in);
  for (int i = 0; i < n; ++i) EXPECT_EQ(out[i * 3 + 2].item<float>(), i);

  at::Tensor blocks = at::arange(n * 2, at::kFloat) + r;  // block i = [2i, 2i+1] + r
  at::Tensor mine = at::empty({2}, at::kFloat);
  g_world->reduce_scatter(mine, blocks, ReduceOp::Sum);
  const float rank_sum = n * (n - 1) / 2.0f;
  EXPECT_FLOAT_EQ(mine[0].item<float>(), n * 2.0f * r + rank_sum);

  at::Tensor b = r == 1 ? at::full({2}, 42.0, at::kBFloat16) : at::zeros({2}, at::kBFloat16);
  g_world->broadcast(b, 1);
  EXPECT_EQ(b[1].item<float>(), 42.0f);
}

TEST(Communicator, ReduceScatterOfEveryOpAndDtypeOnEvenAndOddGroups) {
  // The MPI backend reduce-scatters as a ring of messages (mpi_communicator.cpp): every op and dtype, on the world
  // and on groups of 3 and 1 ranks (4 ranks split {0, 1, 2} and {3}), chunks of 0, 1 and 1,000 elements, against
  // the reduction of every rank's input computed here (integer values: exact in every dtype); the input is left
  // as it was.
  const int world_rank = g_world->rank();
  std::vector<std::shared_ptr<Communicator>> groups = {g_world};
  if (g_world->size() == 4) groups.push_back(g_world->split(world_rank == 3 ? 1 : 0, world_rank, "three and one"));
  for (const auto& group : groups) {
    const int r = group->rank(), n = group->size();
    const auto input_of = [&](int rank, int64_t chunk, at::ScalarType dtype) {
      // Values in [-8, 23]: sums over 4 ranks stay exact in bfloat16.
      return (at::arange(n * chunk, at::kLong) * (rank + 3) % 32 - 8).to(dtype);
    };
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
      for (int64_t chunk : {0, 1, 1000}) {
        for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg}) {
          if (op == ReduceOp::Avg && dtype == at::kLong) continue;
          at::Tensor in = input_of(r, chunk, dtype), kept = in.clone(), out = at::empty({chunk}, dtype);
          group->reduce_scatter(out, in, op);
          at::Tensor expected = input_of(0, chunk, at::kDouble);
          for (int q = 1; q < n; ++q) {
            at::Tensor other = input_of(q, chunk, at::kDouble);
            expected = op == ReduceOp::Max ? at::maximum(expected, other) : op == ReduceOp::Min ? at::minimum(expected, other) : expected + other;
          }
          // The average divides the exact sum in the tensor's dtype.
          if (op == ReduceOp::Avg) expected = (expected.to(dtype) / n).to(at::kDouble);
          expected = expected.slice(0, r * chunk, (r + 1) * chunk);
          const std::string what = titan::cat(c10::toString(dtype), " chunk ", chunk, " ", reduce_op_name(op), " on ", n, " ranks");
          EXPECT_TRUE(at::equal(out.to(at::kDouble), expected)) << what;
          EXPECT_TRUE(at::equal(in, kept)) << what;
        }
      }
    }
  }
}

TEST(Communicator, SendRecvRingAndAsyncOrder) {
  const int r = g_world->rank(), n = g_world->size();
  at::Tensor out = at::full({4}, r, at::kLong), in = at::empty({4}, at::kLong);
  auto s = g_world->send(out, (r + 1) % n, 7, /*async=*/true);
  auto q = g_world->recv(in, (r + n - 1) % n, 7, /*async=*/true);
  q->wait();
  s->wait();
  EXPECT_EQ(in[0].item<int64_t>(), (r + n - 1) % n);
  // Many async collectives in flight complete in order with the right results.
  std::vector<at::Tensor> ts;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(at::full({1000}, i, at::kFloat));
    works.push_back(g_world->all_reduce(ts.back(), ReduceOp::Sum, true));
  }
  for (int i = 7; i >= 0; --i) {
    works[i]->wait();
    EXPECT_EQ(ts[i][999].item<float>(), static_cast<float>(i * n));
  }
  g_world->barrier();
}

TEST(Communicator, SplitIntoGroups) {
  const int r = g_world->rank(), n = g_world->size();
  auto half = g_world->split(r % 2, r, "parity");
  EXPECT_EQ(half->size(), (n + 1 - r % 2) / 2);
  at::Tensor t = at::ones({1}, at::kFloat);
  half->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.item<float>(), half->size());
  EXPECT_EQ(half->name(), "parity");
}

TEST(DeviceMesh, HsdpCoordinatesAndGroups) {
  if (g_world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  titan::config::Parallelism p;
  p.data_parallel_replicate_degree = 2;
  p.data_parallel_shard_degree = -1;
  auto dims = ParallelDims::from_config(p, 4);
  EXPECT_EQ(dims.dp_shard, 2);
  EXPECT_TRUE(dims.hsdp_enabled());
  DeviceMesh mesh(dims, g_world);
  const int r = g_world->rank();
  EXPECT_EQ(mesh.coordinate("dp_replicate"), r / 2);
  EXPECT_EQ(mesh.coordinate("dp_shard"), r % 2);
  EXPECT_EQ(mesh.dp_rank(), r);
  // The shard group of rank r holds {r - r % 2, r - r % 2 + 1}: their ranks' sum tells.
  at::Tensor t = at::full({1}, r, at::kLong);
  mesh.get("dp_shard")->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.item<int64_t>(), 2 * (r - r % 2) + 1);
  at::Tensor u = at::full({1}, r, at::kLong);
  mesh.get("dp_replicate")->all_reduce(u, ReduceOp::Sum);
  EXPECT_EQ(u.item<int64_t>(), 2 * (r % 2) + 2);
  EXPECT_EQ(mesh.get("dp")->size(), 4);
  EXPECT_EQ(mesh.get("tp")->size(), 1);
}

// The checking wrapper (TITAN_CHECK_COLLECTIVES=1; the test suite runs every multi-rank test with it) refuses what
// the NCCL backend would reject, hang on or corrupt: bad arguments on the calling rank, and ranks that issue
// different collectives or a receive of another size than was sent, on every rank involved.
TEST(CheckingCommunicator, RefusesWhatNcclWouldRejectHangOrCorruptOn) {
  auto checked = make_checking_communicator(g_world->split(0, g_world->rank(), "checked"));
  const int r = checked->rank(), n = checked->size();
  auto expect_violation = [](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no violation; expected " << needle;
    } catch (const titan::UserError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("collective check (TITAN_CHECK_COLLECTIVES) on communicator \"checked\""), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
  };
  at::Tensor ones = at::ones({3});
  checked->all_reduce(ones, ReduceOp::Sum);
  EXPECT_EQ(ones[0].item<float>(), n);
  // Argument rules, checked on the calling rank before anything is sent.
  at::Tensor shorts = at::ones({2}, at::kShort), strided = at::ones({4, 4}).t(), counts = at::ones({2}, at::kLong);
  expect_violation([&] { checked->all_reduce(shorts, ReduceOp::Max); }, "dtype Short, which the NCCL backend cannot move");
  expect_violation([&] { checked->all_reduce(strided, ReduceOp::Sum); }, "a non-contiguous tensor of shape [4, 4]");
  expect_violation([&] { checked->all_reduce(counts, ReduceOp::Avg); }, "an average of Long");
  at::Tensor short_output = at::empty({n * 3 - 1});
  expect_violation([&] { checked->all_gather_into(short_output, ones); }, "not size");
  expect_violation([&] { checked->send(ones, r, 0); }, "is not another rank of the group");
  // Agreement: rank 0 reduces 4 elements, the others 5; every rank learns what each issued, and nothing was run.
  at::Tensor uneven = at::ones({r == 0 ? 4 : 5});
  expect_violation([&] { checked->all_reduce(uneven, ReduceOp::Sum); },
                   "the ranks issued different operations (rank 0 call #2: all_reduce(Float x 4, sum); rank 1 call #2: "
                   "all_reduce(Float x 5, sum)");
  // A receive that expects another size than the sender sent (MPI would accept the shorter message silently).
  if (n >= 2 && r < 2) {
    if (r == 0) {
      at::Tensor sent = at::arange(6, at::kFloat);
      checked->send(sent, 1, 0);
    } else {
      at::Tensor buffer = at::zeros({8});
      expect_violation([&] { checked->recv(buffer, 0, 0); }, "rank 0 sent Float x 6 but this rank receives Float x 8");
    }
  }
  // The communicator still works after refusals (nothing mismatched was issued).
  at::Tensor again = at::full({2}, 1.0f);
  checked->all_reduce(again, ReduceOp::Sum);
  EXPECT_EQ(again[1].item<float>(), n);
}

// Rank r sends (r + j) % 3 rows of 2 to rank j, each row holding (sender, receiver, index): what arrives is each
// peer's block for this rank, in rank order; empty blocks included.
TEST(Communicator, UnevenAllToAll) {
  for (auto group : {g_world, make_checking_communicator(g_world->split(0, g_world->rank(), "checked_a2a"))}) {
    const int r = group->rank(), n = group->size();
    std::vector<at::Tensor> blocks;
    std::vector<int64_t> in_splits, out_splits;
    for (int j = 0; j < n; ++j) {
      const int64_t rows = (r + j) % 3;
      at::Tensor b = at::empty({rows, 2}, at::kFloat);
      for (int64_t i = 0; i < rows; ++i) b[i][0] = r * 100 + j, b[i][1] = static_cast<float>(i);
      blocks.push_back(b);
      in_splits.push_back(rows * 2);
      out_splits.push_back(((j + r) % 3) * 2);
    }
    at::Tensor input = at::cat(blocks).contiguous();
    int64_t total = 0;
    for (int64_t s : out_splits) total += s;
    at::Tensor output = at::full({total / 2, 2}, -1.0f);
    group->all_to_all_v(output, input, out_splits, in_splits);
    int64_t row = 0;
    for (int i = 0; i < n; ++i)
      for (int64_t k = 0; k < (i + r) % 3; ++k, ++row) {
        EXPECT_EQ(output[row][0].item<float>(), i * 100 + r) << "row " << row;
        EXPECT_EQ(output[row][1].item<float>(), static_cast<float>(k)) << "row " << row;
      }
  }
}

TEST(Communicator, UnevenAllToAllWithWrongCountsIsRefusedOnEveryRank) {
  auto checked = make_checking_communicator(g_world->split(0, g_world->rank(), "checked_bad_a2a"));
  const int r = checked->rank(), n = checked->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  // Every rank sends one element to each peer; rank 0 expects two from rank 1.
  std::vector<int64_t> in(static_cast<size_t>(n), 1), out(static_cast<size_t>(n), 1);
  if (r == 0) out[1] = 2;
  at::Tensor input = at::ones({n}), output = at::zeros({r == 0 ? n + 1 : n});
  try {
    checked->all_to_all_v(output, input, out, in);
    ADD_FAILURE() << "no violation";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 sends 1 elements to rank 0, which expects 2"), std::string::npos) << e.what();
  }
  checked->barrier();
}

// The sparse mesh on 4 ranks with ep 2: dp_shard 4 split as efsdp 2 x ep 2 (ep fastest, as torchtitan).
TEST(DeviceMesh, ExpertParallelGroups) {
  if (g_world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  titan::config::Parallelism p;
  p.expert_parallel_degree = 2;
  auto dims = ParallelDims::from_config(p, 4);
  EXPECT_EQ(dims.efsdp(), 2);
  DeviceMesh mesh(dims, g_world);
  const int r = g_world->rank();
  EXPECT_EQ(mesh.coordinate("ep"), r % 2);
  EXPECT_EQ(mesh.coordinate("efsdp"), r / 2);
  at::Tensor t = at::full({1}, r, at::kLong);
  mesh.get("ep")->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.item<int64_t>(), 2 * (r - r % 2) + 1);  // {0, 1} or {2, 3}
  at::Tensor u = at::full({1}, r, at::kLong);
  mesh.get("efsdp")->all_reduce(u, ReduceOp::Sum);
  EXPECT_EQ(u.item<int64_t>(), 2 * (r % 2) + 2);  // {0, 2} or {1, 3}
}

TEST(ParallelDims, ExpertParallelDegreesAreChecked) {
  titan::config::Parallelism p;
  p.expert_parallel_degree = 3;
  try {
    ParallelDims::from_config(p, 4);
    ADD_FAILURE() << "no error";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("expert_parallel_degree = 3 must divide the ranks it borrows"), std::string::npos) << e.what();
  }
  p.expert_parallel_degree = 2;
  p.tensor_parallel_degree = 2;
  p.expert_tensor_parallel_degree = 4;
  EXPECT_THROW(ParallelDims::from_config(p, 4), titan::UserError);
  p.expert_tensor_parallel_degree = 1;  // EP borrows dp_shard x tp = 2 x 2 ranks
  EXPECT_EQ(ParallelDims::from_config(p, 4).efsdp(), 2);
}

TEST(ParallelDims, ProductMustMatchWorld) {
  titan::config::Parallelism p;
  p.data_parallel_shard_degree = 3;
  EXPECT_THROW(ParallelDims::from_config(p, 4), titan::UserError);
  p.data_parallel_shard_degree = -1;
  p.data_parallel_replicate_degree = 3;
  EXPECT_THROW(ParallelDims::from_config(p, 4), titan::UserError);
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto launch = detect_launch();
  g_world = world(launch);
  g_world->set_timeout(std::chrono::seconds(120));
  if (g_world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());  // rank 0 prints for everyone
  }
  int result = RUN_ALL_TESTS();
  // Every rank must agree: a failure on any rank fails the job.
  at::Tensor failed = at::full({1}, result != 0 ? 1 : 0, at::kInt);
  g_world->all_reduce(failed, ReduceOp::Max);
  g_world.reset();
  shutdown();
  return failed.item<int>() != 0 ? 1 : 0;
}
