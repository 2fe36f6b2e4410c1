// The memory estimate's rule for when its terms are held (protocols::Phase): sums worked out by hand, and the
// decoder estimate on a GPU's allocator against the same job on titan's host cache.
#include <gtest/gtest.h>

#include <algorithm>

#include "titan/config/job_config.h"
#include "titan/models/common/decoder_memory.h"
#include "titan/models/llama3/args.h"

using titan::protocols::Allocator;
using titan::protocols::Execution;
using titan::protocols::FusedKernels;
using titan::protocols::MemoryEstimate;
using titan::protocols::Phase;

namespace {

double bytes_named(const MemoryEstimate& e, const std::string& name) {
  for (const auto& t : e.terms)
    if (t.name == name) return t.bytes;
  return 0;
}

// One sequence of `seq_len` tokens per step, no activation checkpointing.
titan::config::JobConfig one_sequence(int64_t seq_len) {
  titan::config::JobConfig config;
  config.training.local_batch_size = 1;
  config.training.seq_len = seq_len;
  config.activation_checkpoint.mode = "none";
  return config;
}

// The decoder estimate of one device under bf16 autocast over float32 weights, with the CUDA kernels, on `allocator`.
MemoryEstimate one_device(const titan::models::DecoderArgs& a, const titan::config::JobConfig& config, Allocator allocator) {
  return titan::models::estimate_training_memory(a, config, titan::distributed::ParallelDims{}, /*autocast=*/true, 0,
                                                 Execution::titan, -1, FusedKernels::cuda, allocator);
}

}  // namespace

TEST(MemoryEstimate, TheLossAndTheBackwardAreHeldApart) {
  MemoryEstimate e;
  e.terms = {{"parameters", 10}, {"activations", 40}, {"logits", 7, Phase::loss}, {"backward buffers", 5, Phase::blocks_backward}};
  EXPECT_DOUBLE_EQ(e.total(), 10 + 40 + 7);
  EXPECT_NE(e.describe().find("and the larger of the loss's (logits"), std::string::npos) << e.describe();
}

TEST(MemoryEstimate, GradientsMadeInBackwardTakeTheLargestOfThreeMoments) {
  // step 10; activations 40 (with the loss's input gradient 2); loss 6; backward 5; block gradients 30; the output's 3;
  // the embedding's 3 and its backward's table 3.
  MemoryEstimate e;
  e.terms = {{"parameters", 10},
             {"activations", 38, Phase::activations},
             {"the loss's input gradient", 2, Phase::activations},
             {"logits (fused loss, chunked)", 6, Phase::loss},
             {"backward buffers", 5, Phase::blocks_backward},
             {"gradients", 30, Phase::gradients},
             {"the output's gradients", 3, Phase::head_gradients},
             {"the embedding's gradients", 3, Phase::last_gradients},
             {"the embedding's backward", 3, Phase::embedding_backward}};
  // The forward's end 40 + 6 = 46; the blocks' backward max(40, 30) + 5 + 3 = 48; the embedding's 30 + 3 + 6 = 39.
  EXPECT_DOUBLE_EQ(e.total(), 10 + 48);
  const std::string text = e.describe();
  EXPECT_NE(text.find("the largest of the forward's end (activations"), std::string::npos) << text;
  EXPECT_NE(text.find("the larger of activations"), std::string::npos) << text;
  // Each moment in turn: a larger loss, then larger gradients.
  e.terms[3].bytes = 20;  // 40 + 20 = 60
  EXPECT_DOUBLE_EQ(e.total(), 10 + 60);
  e.terms[3].bytes = 6;
  e.terms[5].bytes = 70;  // the backward: 70 + 5 + 3 = 78; the embedding's: 70 + 3 + 6 = 79
  EXPECT_DOUBLE_EQ(e.total(), 10 + 79);
  // The foreach optimizer's temporaries come after the embedding's backward: every gradient (70 + 3 + 3), not its
  // table (3), and the temporaries.
  e.terms.push_back({"foreach optimizer temporaries", 2, Phase::optimizer_step});
  EXPECT_DOUBLE_EQ(e.total(), 10 + 79);  // 76 + 2 = 78 < 79
  e.terms.back().bytes = 10;             // 76 + 10 = 86
  EXPECT_DOUBLE_EQ(e.total(), 10 + 86);
  EXPECT_NE(e.describe().find("and the optimizer step's (gradients 0.0 MiB, the output's gradients 0.0 MiB, "
                              "the embedding's gradients 0.0 MiB, foreach"),
            std::string::npos)
      << e.describe();
}

TEST(MemoryEstimate, TheForeachOptimizersTemporariesAreCountedWhereTheyAreMade) {
  titan::models::DecoderArgs a = titan::llama3::flavor("8B");
  a.n_layers = 2;
  titan::config::JobConfig config = one_sequence(64);
  const auto estimate = [&](Allocator allocator) { return one_device(a, config, allocator); };
  const MemoryEstimate fused = estimate(Allocator::host_cache);
  EXPECT_DOUBLE_EQ(bytes_named(fused, "foreach optimizer temporaries"), 0);
  config.optimizer.implementation = "foreach";
  // One float32 tensor per parameter (the denominator): the parameters' size, after backward, on either allocator.
  for (Allocator allocator : {Allocator::host_cache, Allocator::device_caching}) {
    const MemoryEstimate foreach = estimate(allocator);
    EXPECT_DOUBLE_EQ(bytes_named(foreach, "foreach optimizer temporaries"), bytes_named(foreach, "parameters"));
    for (const auto& t : foreach.terms) {
      if (t.name == "foreach optimizer temporaries") { EXPECT_EQ(t.phase, Phase::optimizer_step); }
    }
  }
  // Few tokens: the step's temporaries are the peak's last moment, one parameter-sized tensor more than fused.
  ASSERT_GT(bytes_named(fused, "parameters"), std::max(fused.bytes(Phase::loss), fused.bytes(Phase::blocks_backward)));
  EXPECT_DOUBLE_EQ(estimate(Allocator::host_cache).total() - fused.total(),
                   bytes_named(fused, "parameters") - std::max(fused.bytes(Phase::loss), fused.bytes(Phase::blocks_backward)));
  // Adam with L2 weight decay adds the decayed gradients beside them.
  config.optimizer.name = "Adam";
  config.optimizer.weight_decay = 0.1;
  EXPECT_DOUBLE_EQ(bytes_named(estimate(Allocator::host_cache), "foreach optimizer temporaries"), 2 * bytes_named(fused, "parameters"));
  // Steps in backward: each unit's temporaries while the blocks run backward.
  config.optimizer.name = "AdamW";
  config.optimizer.early_step_in_backward = true;
  const MemoryEstimate early = estimate(Allocator::host_cache);
  EXPECT_GT(bytes_named(early, "foreach optimizer temporaries"), 0);
  for (const auto& t : early.terms) {
    if (t.name == "foreach optimizer temporaries") { EXPECT_EQ(t.phase, Phase::blocks_backward); }
  }
}

TEST(MemoryEstimate, OnAGpuTheGradientsReuseTheActivationsMemory) {
  // Llama 3 8B's shapes on 4 blocks, 1 x 8192 tokens, bf16 autocast over float32 weights, one device: the terms are
  // the same on both allocators (the gradients split three ways), the total is not.
  titan::models::DecoderArgs a = titan::llama3::flavor("8B");
  a.n_layers = 4;
  titan::config::JobConfig config = one_sequence(8192);
  const auto estimate = [&](Allocator allocator) { return one_device(a, config, allocator); };
  const MemoryEstimate host = estimate(Allocator::host_cache), device = estimate(Allocator::device_caching);
  const double gradients = bytes_named(host, "gradients");
  EXPECT_NEAR(bytes_named(device, "gradients") + bytes_named(device, "the output's gradients") +
                  bytes_named(device, "the embedding's gradients"),
              gradients, 1e-6 * gradients);
  // Untied: the embedding's gradient lands after the blocks', one 128,256 x 4,096 float32 table.
  EXPECT_DOUBLE_EQ(bytes_named(device, "the embedding's gradients"), 128256.0 * 4096 * 4);
  EXPECT_DOUBLE_EQ(bytes_named(device, "the embedding's backward"), 0);
  // The host cache holds gradients and activations at once: its total is the old sum, and larger.
  double step = 0, loss = 0, backward = 0;
  for (const auto& t : host.terms) (t.phase == Phase::loss ? loss : t.phase == Phase::blocks_backward ? backward : step) += t.bytes;
  EXPECT_DOUBLE_EQ(host.total(), step + std::max(loss, backward));
  EXPECT_LT(device.total(), host.total() - 0.5 * gradients);
  // Two micro-batches per step: the first one's gradients wait through the second one's forward, on any allocator.
  config.training.global_batch_size = 2;
  const MemoryEstimate accumulating = estimate(Allocator::device_caching);
  EXPECT_DOUBLE_EQ(accumulating.total(), estimate(Allocator::host_cache).total());
  // Tied embeddings (the 1B flavor): no separate embedding gradient, but the table-sized gradient the embedding's
  // backward makes before it is added to the output's.
  config.training.global_batch_size = -1;
  a = titan::llama3::flavor("1B");
  const MemoryEstimate tied = estimate(Allocator::device_caching);
  EXPECT_DOUBLE_EQ(bytes_named(tied, "the embedding's gradients"), 0);
  EXPECT_DOUBLE_EQ(bytes_named(tied, "the embedding's backward"), 128256.0 * 2048 * 4);
  EXPECT_DOUBLE_EQ(bytes_named(tied, "the output's gradients"), (128256.0 * 2048 + 2048) * 4);
}
