// The NCCL backend of Communicator on one GPU (a single-rank world: a machine with one GPU cannot run two ranks):
// every collective's result against the expected values, ordering with the caller's stream (also a side stream),
// send_recv to itself, split into sub-communicators, the device mesh on an NCCL world, and the errors for host
// tensors and unsupported dtypes.
#include "gpu_test_util.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "titan/common/error.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/parallel_dims.h"

namespace {

using titan::distributed::Communicator;
using titan::distributed::ReduceOp;

// One NCCL world for the suite, destroyed in TearDownTestSuite: ncclCommDestroy must run before the CUDA runtime
// shuts down at exit.
class Nccl : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!titan_gpu_test::cuda_available()) return;
    titan::distributed::LaunchInfo launch;  // rank 0 of 1, local rank 0
    // The unique id travels over the bootstrap communicator; on one rank the local one suffices.
    world_ = titan::distributed::make_nccl_world(launch, titan::distributed::make_local_communicator(), 0,
                                                       std::chrono::seconds(60));
  }
  static void TearDownTestSuite() { world_.reset(); }

  static at::TensorOptions on_gpu(at::ScalarType dtype = at::kFloat) {
    return at::TensorOptions().device(at::kCUDA, 0).dtype(dtype);
  }
  // A value produced by a long chain of kernels on the current stream: a collective that did not wait for the
  // caller's stream would read it before it is written.
  static at::Tensor slow_value(int64_t n) {
    at::Tensor big = at::randn({2048, 2048}, on_gpu());
    for (int i = 0; i < 8; ++i) big = at::tanh(big.mm(big) / 64.0);
    return big.flatten().narrow(0, 0, n).contiguous() + 1.0;
  }

  static std::shared_ptr<Communicator> world_;
};

std::shared_ptr<Communicator> Nccl::world_;

}  // namespace

TEST_F(Nccl, WorldIsOneRankOnThisGpu) {
  TITAN_REQUIRE_CUDA();
  ASSERT_TRUE(world_);
  EXPECT_EQ(world_->backend(), "nccl");
  EXPECT_EQ(world_->rank(), 0);
  EXPECT_EQ(world_->size(), 1);
  EXPECT_EQ(world_->tensor_device(), at::Device(at::kCUDA, 0));
  EXPECT_EQ(world_->name(), "world");
}

TEST_F(Nccl, AllReduceEveryOpAndDtypeLeavesOneRanksValues) {
  TITAN_REQUIRE_CUDA();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kInt, at::kLong, at::kChar, at::kByte}) {
    const bool floating = at::isFloatingType(dtype);
    std::vector<ReduceOp> ops = {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min};
    if (floating) ops.push_back(ReduceOp::Avg);
    for (ReduceOp op : ops) {
      at::Tensor expected = at::arange(1, 1001, on_gpu(at::kLong)).remainder(97).to(dtype);
      at::Tensor t = expected.clone();
      world_->all_reduce(t, op);
      EXPECT_TRUE(at::equal(t.cpu(), expected.cpu())) << c10::toString(dtype) << " " << titan::distributed::reduce_op_name(op);
    }
  }
}

TEST_F(Nccl, AllGatherWaitsForTheCallersStream) {
  TITAN_REQUIRE_CUDA();
  // On the default stream, then on a side stream made current: the operation must follow whichever is current.
  for (bool side : {false, true}) {
    c10::cuda::CUDAStream stream = side ? c10::cuda::getStreamFromPool(false, 0) : c10::cuda::getDefaultCUDAStream(0);
    c10::cuda::CUDAStreamGuard guard(stream);
    at::Tensor in = slow_value(1 << 16);
    at::Tensor out = at::zeros_like(in);
    auto work = world_->all_gather_into(out, in, /*async=*/true);
    work->wait();
    EXPECT_TRUE(at::equal(out, in)) << (side ? "side stream" : "default stream");
    stream.synchronize();
    EXPECT_TRUE(work->completed());
  }
}

TEST_F(Nccl, ReduceScatterAndAllToAllOnOneRankCopy) {
  TITAN_REQUIRE_CUDA();
  at::Tensor in = slow_value(4096);
  at::Tensor out = at::zeros_like(in);
  world_->reduce_scatter(out, in, ReduceOp::Sum);
  EXPECT_TRUE(at::equal(out, in));
  at::Tensor bf = in.to(at::kBFloat16), bf_out = at::zeros_like(bf);
  world_->reduce_scatter(bf_out, bf, ReduceOp::Avg);
  EXPECT_TRUE(at::equal(bf_out, bf));
  at::Tensor shuffled = at::zeros_like(in);
  world_->all_to_all(shuffled, in);
  EXPECT_TRUE(at::equal(shuffled, in));
  // Sizes that do not match one rank's blocks are refused, naming the operation.
  at::Tensor wrong = at::zeros({4095}, on_gpu());
  EXPECT_THROW(world_->reduce_scatter(wrong, in, ReduceOp::Sum), titan::UserError);
  EXPECT_THROW(world_->all_gather_into(wrong, in), titan::UserError);
}

TEST_F(Nccl, BroadcastFromRootKeepsValues) {
  TITAN_REQUIRE_CUDA();
  at::Tensor t = slow_value(1000);
  at::Tensor expected = t.clone();
  world_->broadcast(t, 0);
  EXPECT_TRUE(at::equal(t, expected));
  at::Tensor id_like = at::arange(128, on_gpu(at::kByte));
  world_->broadcast(id_like, 0);
  EXPECT_TRUE(at::equal(id_like, at::arange(128, on_gpu(at::kByte))));
}

TEST_F(Nccl, SendRecvToItself) {
  // A ring shift on one rank: both halves in one NCCL group, so sending to oneself cannot deadlock.
  TITAN_REQUIRE_CUDA();
  at::Tensor send = slow_value(3000);
  at::Tensor recv = at::zeros_like(send);
  auto work = world_->send_recv(send, 0, recv, 0, /*async=*/true);
  work->wait();
  EXPECT_TRUE(at::equal(recv, send));
  at::Tensor longs = at::arange(77, on_gpu(at::kLong)), longs_back = at::zeros_like(longs);
  world_->send_recv(longs, 0, longs_back, 0);
  EXPECT_TRUE(at::equal(longs_back, longs));
}

TEST_F(Nccl, BarrierAndAsyncWorkComplete) {
  TITAN_REQUIRE_CUDA();
  at::Tensor t = slow_value(1 << 20);
  auto work = world_->all_reduce(t, ReduceOp::Sum, /*async=*/true);
  world_->barrier();  // issued after it on the same communicator: completes after it
  work->wait();
  at::cuda::getCurrentCUDAStream(0).synchronize();
  EXPECT_TRUE(work->completed());
}

TEST_F(Nccl, SplitGivesWorkingSubCommunicators) {
  TITAN_REQUIRE_CUDA();
  auto sub = world_->split(/*color=*/0, /*key=*/0, "sub");
  ASSERT_TRUE(sub);
  EXPECT_EQ(sub->backend(), "nccl");
  EXPECT_EQ(sub->name(), "sub");
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->rank(), 0);
  at::Tensor t = at::full({16}, 3.0, on_gpu());
  sub->all_reduce(t, ReduceOp::Sum);
  EXPECT_TRUE(at::equal(t, at::full({16}, 3.0, on_gpu())));
  sub->barrier();
  // A split of a split, then leaving the rank out: no communicator.
  auto subsub = sub->split(5, 0, "subsub");
  ASSERT_TRUE(subsub);
  subsub->barrier();
  EXPECT_EQ(world_->split(-1, 0, "none"), nullptr);
}

TEST_F(Nccl, DeviceMeshOnAnNcclWorld) {
  // The trainer's mesh on an NCCL world. On one rank every group has one member, which the mesh serves with a local
  // communicator by design; what matters here is that building it and using its groups on GPU tensors works.
  TITAN_REQUIRE_CUDA();
  titan::distributed::ParallelDims dims;
  titan::distributed::DeviceMesh mesh(dims, world_);
  EXPECT_EQ(mesh.world()->backend(), "nccl");
  for (const char* name : {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "loss", "dp_shard_cp"}) {
    auto group = mesh.get(name);
    ASSERT_TRUE(group) << name;
    EXPECT_EQ(group->size(), 1) << name;
    at::Tensor t = at::full({4}, 2.0, on_gpu());
    group->all_reduce(t, ReduceOp::Max);
    EXPECT_TRUE(at::equal(t, at::full({4}, 2.0, on_gpu()))) << name;
  }
}

TEST_F(Nccl, StringsTravelThroughDeviceTensors) {
  TITAN_REQUIRE_CUDA();
  auto all = titan::distributed::all_gather_strings(*world_, "checkpoint index of rank 0");
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0], "checkpoint index of rank 0");
}

TEST_F(Nccl, RefusesHostTensorsAndUnsupportedDtypes) {
  TITAN_REQUIRE_CUDA();
  at::Tensor host = at::ones({8});
  try {
    world_->all_reduce(host, ReduceOp::Sum);
    FAIL() << "a host tensor was accepted";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA tensors"), std::string::npos) << e.what();
  }
  at::Tensor complex = at::ones({8}, on_gpu(at::kComplexFloat));
  try {
    world_->all_reduce(complex, ReduceOp::Sum);
    FAIL() << "a complex tensor was accepted";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("dtype"), std::string::npos) << e.what();
  }
  at::Tensor strided = at::ones({8, 8}, on_gpu()).t();
  EXPECT_THROW(world_->all_reduce(strided, ReduceOp::Sum), titan::UserError);
}
