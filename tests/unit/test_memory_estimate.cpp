// The memory estimate's rule for when its terms are held (protocols::Phase): sums worked out by hand, and the
// decoder estimate on a GPU's allocator against the same job on titan's host cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "titan/config/job_config.h"
#include "titan/distributed/pipeline/schedule.h"
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

TEST(MemoryEstimate, ZeroBubbleSchedulesHoldWhatTheirWeightStepsWaitFor) {
  using titan::distributed::pipeline::Schedule;
  // Schedules without weight steps hold activations only, as many at most as their forwards in flight.
  const Schedule one_f_one_b = Schedule::make("1F1B", 4, 4, 8);
  for (int r = 0; r < 4; ++r) {
    const auto held = one_f_one_b.held(r);
    ASSERT_EQ(held.size(), 1u);
    EXPECT_EQ(held[0].forwards, one_f_one_b.max_in_flight(r));
    EXPECT_EQ(held[0].forwards, 4 - r);
    EXPECT_EQ(held[0].deferred, 0);
  }
  // ZBV on 2 ranks: input steps wait for their weight steps, so some state holds deferred operands; none holds more
  // forwards than the schedule's most in flight, and none is covered by another.
  const Schedule zbv = Schedule::make("ZBVZeroBubble", 2, 4, 8);
  for (int r = 0; r < 2; ++r) {
    const auto held = zbv.held(r);
    int most_forwards = 0, most_deferred = 0;
    for (const auto& s : held) {
      most_forwards = std::max(most_forwards, s.forwards);
      most_deferred = std::max(most_deferred, s.deferred);
      for (const auto& o : held)
        EXPECT_FALSE(&o != &s && o.forwards >= s.forwards && o.deferred >= s.deferred) << r;
    }
    EXPECT_EQ(most_forwards, zbv.max_in_flight(r));
    EXPECT_GT(most_deferred, 0) << r;
  }

  // The estimate: the 100M flavor's 8 blocks in float32 on PP 2, 4 micro-batches of 1 x 512 tokens, full AC. Each
  // deferred (stage, micro-batch) pair keeps, per token of each of its blocks, every block linear's input (the two
  // normalised streams and the attention's and SwiGLU's outputs) and output gradient, far more than a checkpointed
  // forward's block input: the state with the most deferred steps is the rank's peak.
  titan::models::DecoderArgs a = titan::llama3::flavor("100M");
  a.n_layers = 8;
  titan::config::JobConfig config = one_sequence(512);
  config.training.dtype = "float32";
  config.training.local_batch_size = 4;
  config.activation_checkpoint.mode = "full";
  config.parallelism.pipeline_parallel_degree = 2;
  config.parallelism.pipeline_parallel_microbatch_size = 1;
  titan::distributed::ParallelDims dims;
  dims.pp = 2;
  dims.world_size = 2;
  const auto estimate = [&](const std::string& schedule, int64_t rank) {
    config.parallelism.pipeline_parallel_schedule = schedule;
    return titan::models::estimate_training_memory(a, config, dims, /*autocast=*/false, 0, Execution::titan, rank);
  };
  const double d = static_cast<double>(a.dim), q = static_cast<double>(a.n_heads * a.head_dim());
  const double k = static_cast<double>(a.kv_heads() * a.head_dim()), h = static_cast<double>(a.ffn_hidden_dim());
  const double per_token = 4 * ((q + 2 * k + d + 2 * h + d) + 2 * d + (q + h));
  // A pair is one stage's micro-batch, counted as half the rank's blocks: torchtitan's split counts the embedding
  // and the output as layers, so the V gives rank 0 (the first and last stages) 3 blocks and rank 1 the other 5.
  const double blocks_on[] = {3, 5};
  const Schedule zbv4 = Schedule::make("ZBVZeroBubble", 2, 4, 4);
  for (int64_t rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(bytes_named(estimate("Interleaved1F1B", rank), "deferred weight gradients' operands"), 0);
    int most_deferred = 0;
    for (const auto& s : zbv4.held(static_cast<int>(rank))) most_deferred = std::max(most_deferred, s.deferred);
    EXPECT_GE(most_deferred, 1) << rank;
    const double pair = 512 * per_token * blocks_on[rank] / 2;
    EXPECT_NEAR(bytes_named(estimate("ZBVZeroBubble", rank), "deferred weight gradients' operands"), most_deferred * pair, 1e-9 * pair) << rank;
  }

  // A custom order (pipeline_parallel_schedule_csv) is what runs: InterleavedZeroBubble's order under the name
  // Interleaved1F1B is estimated as InterleavedZeroBubble, and Interleaved1F1B's order under the zero-bubble name
  // defers nothing.
  const auto write_csv = [](const std::string& name, const Schedule& order) {
    const std::string path = ::testing::TempDir() + "/" + name + ".csv";
    std::ofstream(path) << order.to_csv();
    return path;
  };
  const std::string zero_bubble_csv = write_csv("izb", Schedule::make("InterleavedZeroBubble", 2, 4, 4));
  const std::string plain_csv = write_csv("i1f1b", Schedule::make("Interleaved1F1B", 2, 4, 4));
  for (int64_t rank = 0; rank < 2; ++rank) {
    const MemoryEstimate named = estimate("InterleavedZeroBubble", rank);
    ASSERT_GT(bytes_named(named, "deferred weight gradients' operands"), 0) << rank;
    config.parallelism.pipeline_parallel_schedule_csv = zero_bubble_csv;
    EXPECT_DOUBLE_EQ(estimate("Interleaved1F1B", rank).total(), named.total()) << rank;
    config.parallelism.pipeline_parallel_schedule_csv = plain_csv;
    EXPECT_EQ(bytes_named(estimate("InterleavedZeroBubble", rank), "deferred weight gradients' operands"), 0) << rank;
    EXPECT_DOUBLE_EQ(estimate("InterleavedZeroBubble", rank).total(), estimate("Interleaved1F1B", rank).total()) << rank;
    config.parallelism.pipeline_parallel_schedule_csv = std::string();
  }

  // torch.distributed.pipelining (`--as torchtitan`): an input step keeps the forward's graph until the weight
  // step, so forwards stay in flight longer, and the deferred pairs add only their linears' output gradients. On
  // ZBV's rank 1 (the middle stages, 5 blocks, no output): a forward keeps each checkpointed block's float32 input.
  // Every state of titan's order is held at least as long there, and some there holds more than any of titan's
  // (on this rank: 4 forwards and 1 deferred pair, 3 and 3, against titan's 4 and 0, 3 and 1, 1 and 2, 0 and 3).
  const auto titan_states = zbv4.held(1), graph_states = zbv4.held(1, true);
  const auto covers = [](const auto& o, const auto& s) { return o.forwards >= s.forwards && o.deferred >= s.deferred; };
  for (const auto& s : titan_states)
    EXPECT_TRUE(std::any_of(graph_states.begin(), graph_states.end(), [&](const auto& o) { return covers(o, s); }));
  EXPECT_TRUE(std::any_of(graph_states.begin(), graph_states.end(), [&](const auto& s) {
    return std::none_of(titan_states.begin(), titan_states.end(), [&](const auto& o) { return covers(o, s); });
  }));
  config.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble";
  const MemoryEstimate torchtitan = titan::models::estimate_training_memory(a, config, dims, false, 0, Execution::torchtitan, 1);
  const double forward_pair = 512.0 * 5 * d * 4 / 2, outputs_pair = 512.0 * 5 * 4 * (q + 2 * k + d + 2 * h + d) / 2;
  double most = 0;
  for (const auto& s : zbv4.held(1, true)) most = std::max(most, s.forwards * forward_pair + s.deferred * outputs_pair);
  EXPECT_NEAR(bytes_named(torchtitan, "activations") + bytes_named(torchtitan, "deferred weight gradients' operands"), most, 1e-9 * most);
}
