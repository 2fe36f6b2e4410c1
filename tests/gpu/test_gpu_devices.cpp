// The bugs that would have failed the first GPU runs, each on one GPU: the gradient norm and the seed broadcast of
// a one-GPU job stay on the GPU; context-parallel attention's backward on CUDA (undefined cumulative lengths, the
// forward's random-number state, a contiguous log-sum-exp) against scaled_dot_product_attention differentiated by
// autograd; boolean reductions over NCCL; many communicators at once.
#include "gpu_test_util.h"

#include "titan/common/error.h"
#include "titan/distributed/checking_communicator.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/grad_norm.h"

using namespace titan::distributed;

namespace {

const at::Device kGpu(at::kCUDA, 0);

std::vector<ShardedParameter> gpu_parameters() {
  std::vector<ShardedParameter> params;
  for (int64_t rows : {4, 6}) {
    ShardedParameter p;
    p.name = "w" + std::to_string(rows);
    p.local = at::ones({rows, 3}, at::TensorOptions().device(kGpu)).requires_grad_();
    p.local.mutable_grad() = at::full({rows, 3}, 2.0, at::TensorOptions().device(kGpu));
    p.module_param = p.local;
    p.layout = TensorLayout({rows, 3});
    params.push_back(std::move(p));
  }
  return params;
}

at::Tensor random(std::vector<int64_t> shape, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble).to(at::kFloat).to(kGpu, dtype);
}

}  // namespace

TEST(GpuDevices, GradientNormOfAOneGpuJobStaysOnTheGpu) {
  TITAN_REQUIRE_CUDA();
  for (auto world : {make_local_communicator(kGpu), make_local_communicator(at::kCPU)}) {
    auto params = gpu_parameters();
    at::Tensor norm = clip_grad_norm(params, 1.0, *world);
    EXPECT_EQ(norm.device(), kGpu) << "world on " << world->tensor_device();
    EXPECT_NEAR(norm.item<double>(), std::sqrt(120.0), 1e-5);
    // What the trainer does with it: one stack with the loss on the GPU.
    at::Tensor loss = at::zeros({1}, at::TensorOptions().device(kGpu));
    EXPECT_NO_THROW(at::stack({loss.reshape({}).to(at::kDouble), norm.to(at::kDouble)}));
  }
}

TEST(GpuDevices, SeedBroadcastOfAOneGpuJobPassesTheCollectiveChecks) {
  TITAN_REQUIRE_CUDA();
  auto world = make_checking_communicator(make_local_communicator(kGpu));
  at::Tensor seed = at::full({1}, 1234, at::kLong).to(kGpu);
  world->broadcast(seed, 0);
  EXPECT_EQ(seed.cpu().item<int64_t>(), 1234);
}

// headtail with one rank holds two chunks (0 and 1): the second query chunk's backward reads a slice of the
// log-sum-exp, which the CUDA kernel used to read as dense. The gradients are compared with autograd's.
TEST(GpuDevices, ContextParallelAttentionBackwardMatchesSdpaOnCuda) {
  TITAN_REQUIRE_CUDA();
  for (auto dtype : {at::kBFloat16, at::kHalf})
    for (auto rotate : {CpRotateMethod::AllGather, CpRotateMethod::AllToAll})
      for (int64_t kv_heads : {4, 2}) {
        ContextParallel cp(make_local_communicator(kGpu), CpLoadBalancer::HeadTail, rotate);
        const int64_t batch = 2, heads = 4, seq = 256, dim = 64;
        at::Tensor q = random({batch, heads, seq, dim}, 1, dtype).requires_grad_();
        at::Tensor k = random({batch, kv_heads, seq, dim}, 2, dtype).requires_grad_();
        at::Tensor v = random({batch, kv_heads, seq, dim}, 3, dtype).requires_grad_();
        const at::Tensor grad = random({batch, heads, seq, dim}, 4, dtype);
        // The reference in float32 (math kernel), differentiated by autograd.
        at::Tensor q32 = q.detach().to(at::kFloat).requires_grad_(), k32 = k.detach().to(at::kFloat).requires_grad_(),
                   v32 = v.detach().to(at::kFloat).requires_grad_();
        at::Tensor ref = at::scaled_dot_product_attention(q32, k32, v32, std::nullopt, 0.0, true, std::nullopt, kv_heads != heads);
        ref.backward(grad.to(at::kFloat));

        at::Tensor lq = cp.shard(q.detach(), 2).requires_grad_(), lk = cp.shard(k.detach(), 2).requires_grad_(),
                   lv = cp.shard(v.detach(), 2).requires_grad_();
        at::Tensor out = cp.attention(lq, lk, lv);
        out.backward(cp.shard(grad, 2));
        const std::string what = std::string(c10::toString(dtype)) + (rotate == CpRotateMethod::AllGather ? " allgather" : " ring") +
                                 " kv_heads " + std::to_string(kv_heads);
        const double tolerance = dtype == at::kHalf ? 5e-3 : 2e-2;  // relative to the largest reference value
        auto close = [&](const at::Tensor& mine, const at::Tensor& full, const char* name) {
          const double err = titan_gpu_test::max_relative_difference(mine, cp.shard(full.detach(), 2));
          EXPECT_LE(err, tolerance) << what << ": " << name;
          titan_gpu_test::figure("cp_attention." + what + "." + name + ".max_relative_difference", err);
        };
        close(out, ref, "output");
        close(lq.grad(), q32.grad(), "grad q");
        close(lk.grad(), k32.grad(), "grad k");
        close(lv.grad(), v32.grad(), "grad v");
      }
}

TEST(GpuDevices, NcclBooleanReductionsStayBooleans) {
  TITAN_REQUIRE_CUDA();
  LaunchInfo launch;
  auto world = make_nccl_world(launch, make_local_communicator(), 0, std::chrono::seconds(60));
  at::Tensor flags = at::tensor({1, 0, 1}, at::kByte).to(kGpu, at::kBool);
  world->all_reduce(flags, ReduceOp::Sum);
  at::Tensor bytes = flags.view(at::kByte).cpu();
  EXPECT_EQ(bytes[0].item<int>(), 1);
  EXPECT_EQ(bytes[1].item<int>(), 0);
  at::Tensor average = at::ones({2}, at::kBool).to(kGpu);
  EXPECT_THROW(world->all_reduce(average, ReduceOp::Avg), titan::UserError);
}

TEST(GpuDevices, FortyCommunicatorsEachWorkOnTheirOwnStream) {
  TITAN_REQUIRE_CUDA();
  LaunchInfo launch;
  auto world = make_nccl_world(launch, make_local_communicator(), 0, std::chrono::seconds(60));
  std::vector<std::shared_ptr<Communicator>> groups;
  for (int i = 0; i < 40; ++i) groups.push_back(world->split(0, 0, "group " + std::to_string(i)));
  std::vector<at::Tensor> values;
  for (int i = 0; i < 40; ++i) {
    values.push_back(at::full({16}, static_cast<double>(i), at::TensorOptions().device(kGpu)));
    groups[static_cast<size_t>(i)]->all_reduce(values.back(), ReduceOp::Sum, /*async=*/true)->wait();
  }
  for (int i = 0; i < 40; ++i) EXPECT_EQ(values[static_cast<size_t>(i)][15].item<double>(), i);
  groups.clear();  // destroyed with nothing pending: finalized, not aborted
  world.reset();
}
