// Context-parallel attention on real MPI ranks (2 and 4): the local queries' causal attention over the whole
// sequence, forward and the gradients of q, k and v, against LibTorch's scaled_dot_product_attention over the
// whole sequence differentiated by autograd in one process; every load balancer, both rotate methods, GQA, float32
// and bfloat16; causal, and block-causal over documents that start anywhere (inside chunks, at their starts, one
// token long, one sequence long); the diagonal chunk pairs through titan's fused kernel and through LibTorch's.
#include <algorithm>

#include <gtest/gtest.h>

#include "titan/common/error.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/context_parallel.h"
#include "titan/kernels/fused_ops.h"

using namespace titan::distributed;

namespace {

std::shared_ptr<Communicator> comm() { return world(detect_launch()); }

at::Tensor global(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble).to(at::kFloat);
}

// Each position's document index (int32 (2, seq)): row 0 starts a document at about one position in 6 (and at the
// second chunk's first position, and a one-token document at the end), row 1 holds one document but for the last
// position, so most of row 1's queries see every earlier key while row 0's see few.
at::Tensor documents_for(int64_t seq, int64_t chunk) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor starts = at::rand({2, seq}, gen).lt(1.0 / 6).to(at::kInt);
  starts[1].zero_();
  starts.select(1, 0).fill_(1);
  starts[0][chunk] = 1;
  starts.select(1, seq - 1).fill_(1);
  return at::cumsum(starts, 1, at::kInt);
}

void check(CpLoadBalancer balancer, CpRotateMethod rotate, int64_t heads, int64_t kv_heads, at::ScalarType dtype, double tol,
           bool block_causal = false) {
  ContextParallel cp(comm(), balancer, rotate);
  const int64_t batch = 2, seq = balancer == CpLoadBalancer::Ptrr ? 2 * kPtrrBlock * cp.degree() : 8 * cp.chunks(0), dim = 16;
  at::Tensor q = global({batch, heads, seq, dim}, 1).to(dtype).requires_grad_(), k = global({batch, kv_heads, seq, dim}, 2).to(dtype).requires_grad_(),
             v = global({batch, kv_heads, seq, dim}, 3).to(dtype).requires_grad_();
  const at::Tensor grad = global({batch, heads, seq, dim}, 4).to(dtype);
  at::Tensor documents, mask;
  if (block_causal) {
    documents = documents_for(seq, seq / cp.chunks(seq));
    mask = documents.unsqueeze(2).eq(documents.unsqueeze(1)).logical_and(at::ones({seq, seq}, at::kBool).tril()).unsqueeze(1);
  }
  at::Tensor ref = at::scaled_dot_product_attention(q, k, v, block_causal ? std::optional<at::Tensor>(mask) : std::nullopt, 0.0,
                                                    /*is_causal=*/!block_causal, std::nullopt, heads != kv_heads);
  ref.backward(grad);

  auto local = [&](const at::Tensor& t) { return cp.shard(t.detach(), 2).requires_grad_(); };
  at::Tensor lq = local(q), lk = local(k), lv = local(v);
  at::Tensor out = cp.attention(lq, lk, lv, documents);
  out.backward(cp.shard(grad, 2));
  const std::string what = std::string(balancer == CpLoadBalancer::HeadTail ? "headtail" : balancer == CpLoadBalancer::Ptrr ? "ptrr" : "none") + " " +
                           (rotate == CpRotateMethod::AllGather ? "allgather" : "alltoall") + " " + c10::toString(dtype) +
                           (block_causal ? " block-causal" : " causal");
  auto close = [&](const at::Tensor& mine, const at::Tensor& full, const char* name) {
    // Relative to the tensor's largest magnitude (at least 1): the reference is LibTorch's own SDPA kernel, whose
    // summation order differs between CPUs (AVX2 vs AVX-512 copies), so float32 results agree to a few ulps of
    // the largest gradient, not to an absolute figure.
    const at::Tensor expected = cp.shard(full, 2).to(at::kFloat);
    const double scale = std::max(1.0, expected.abs().max().item<double>());
    const double err = (mine.to(at::kFloat) - expected).abs().max().item<double>() / scale;
    EXPECT_LE(err, tol) << what << ": " << name << " differs by " << err << " relative to its largest magnitude " << scale;
  };
  close(out.detach(), ref.detach(), "output");
  close(lq.grad(), q.grad(), "grad q");
  close(lk.grad(), k.grad(), "grad k");
  close(lv.grad(), v.grad(), "grad v");
}

}  // namespace

// The diagonal chunk pairs run through titan's fused CPU attention kernel, or LibTorch's when fused kernels are off
// (training.fused_kernels = false): both are checked.
class ContextParallelAttentionKernels : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { titan::kernels::set_fused_kernels_enabled(GetParam()); }
  void TearDown() override { titan::kernels::set_fused_kernels_enabled(true); }
};

TEST_P(ContextParallelAttentionKernels, MatchesFullAttentionForwardAndBackward) {
  for (auto balancer : {CpLoadBalancer::HeadTail, CpLoadBalancer::None, CpLoadBalancer::Ptrr})
    for (auto rotate : {CpRotateMethod::AllGather, CpRotateMethod::AllToAll}) {
      check(balancer, rotate, 4, 4, at::kFloat, 2e-6);
      check(balancer, rotate, 4, 2, at::kFloat, 2e-6);  // GQA
    }
  check(CpLoadBalancer::HeadTail, CpRotateMethod::AllToAll, 4, 2, at::kBFloat16, 5e-2);
}

TEST_P(ContextParallelAttentionKernels, BlockCausalMatchesFullAttentionForwardAndBackward) {
  for (auto balancer : {CpLoadBalancer::HeadTail, CpLoadBalancer::None, CpLoadBalancer::Ptrr})
    for (auto rotate : {CpRotateMethod::AllGather, CpRotateMethod::AllToAll}) {
      check(balancer, rotate, 4, 4, at::kFloat, 2e-6, /*block_causal=*/true);
      check(balancer, rotate, 4, 2, at::kFloat, 2e-6, /*block_causal=*/true);  // GQA
    }
  check(CpLoadBalancer::HeadTail, CpRotateMethod::AllToAll, 4, 2, at::kBFloat16, 5e-2, /*block_causal=*/true);
}

INSTANTIATE_TEST_SUITE_P(Diagonal, ContextParallelAttentionKernels, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "FusedKernel" : "LibTorchKernel"; });

TEST(ContextParallelAttention, ShardsHoldTheBalancedChunksAndTheirPositions) {
  ContextParallel cp(comm(), CpLoadBalancer::HeadTail, CpRotateMethod::AllGather);
  const int n = cp.degree(), r = cp.rank();
  at::Tensor positions = cp.positions(4 * n, at::kCPU);  // chunks of 2: rank r holds r and 2n - 1 - r
  ASSERT_EQ(positions.size(1), 4);
  EXPECT_EQ(positions[0][0].item<int64_t>(), 2 * r);
  EXPECT_EQ(positions[0][2].item<int64_t>(), 2 * (2 * n - 1 - r));
  // ptrr: 4 blocks per rank, heaviest first in rows of n, every other row reversed; every rank gets the same work.
  ContextParallel ptrr(comm(), CpLoadBalancer::Ptrr, CpRotateMethod::AllGather);
  const int64_t blocks = 4 * n;
  int64_t work = 0;
  for (int64_t b : ptrr.chunks_of(r, blocks * kPtrrBlock)) work += b + 1;
  EXPECT_EQ(work, (blocks * (blocks + 1) / 2) / n);
  EXPECT_EQ(ptrr.chunks_of(r, blocks * kPtrrBlock).back(), blocks - 1 - r);  // the first row: the heaviest blocks
  try {
    cp.check_seq_len(4 * n + 2, "training.seq_len");
    FAIL() << "a sequence that does not cut into 2 x cp chunks was accepted";
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("training.seq_len = " + std::to_string(4 * n + 2) + " does not cut into"), std::string::npos) << e.what();
  }
}
