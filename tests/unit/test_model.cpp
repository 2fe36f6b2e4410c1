// Llama 3 flavors (exact parameter counts from shapes alone), FLOPs, and activation checkpointing: identical
// gradients, less memory.
#include <gtest/gtest.h>

#include "titan/common/error.h"
#include "titan/distributed/ddp.h"
#include "titan/nn/loss.h"
#include "titan/components/metrics/allocation_tracker.h"
#include "titan/config/job_config.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/deepseek_v3/args.h"
#include "titan/models/llama3/args.h"
#include "titan/models/common/decoder.h"
#include "titan/models/common/decoder_hf.h"
#include "titan/models/common/kv_cache.h"

using namespace titan::llama3;
using namespace titan::models;
using Transformer = titan::models::Decoder;

namespace {
int64_t count_parameters(const DecoderArgs& args) { return args.stored_parameters(); }
double flops_per_token(const DecoderArgs& args, int64_t seq_len) { return args.flops_per_token(seq_len); }
std::vector<titan::protocols::ParameterShape> parameter_shapes(const DecoderArgs& args) { return args.parameter_shapes(); }
}  // namespace

TEST(ModelArgs, ParameterCountsMatchTorchtitanAndMeta) {
  EXPECT_EQ(count_parameters(flavor("debugmodel")), 6'163'712);
  EXPECT_EQ(count_parameters(flavor("8B")), 8'030'261'248);
  EXPECT_EQ(count_parameters(flavor("70B")), 70'553'706'496);
  EXPECT_EQ(count_parameters(flavor("405B")), 405'853'388'800);
  EXPECT_EQ(count_parameters(flavor("1B")), 1'235'814'400);  // Llama 3.2, tied embeddings
  EXPECT_EQ(count_parameters(flavor("3B")), 3'212'749'824);
  EXPECT_EQ(flavor("8B").ffn_hidden_dim(), 14336);
  EXPECT_EQ(flavor("70B").ffn_hidden_dim(), 28672);
  EXPECT_EQ(flavor("405B").ffn_hidden_dim(), 53248);
  EXPECT_EQ(flavor("debugmodel").ffn_hidden_dim(), 768);
  EXPECT_EQ(flavor("1B").ffn_hidden_dim(), 8192);
}

TEST(ModelArgs, FlopsPerTokenIsTorchtitansFormula) {
  // 6 x (6,163,712 - 524,288) + 12 x 6 x 16 x 16 x 2048 = 71,585,280
  EXPECT_DOUBLE_EQ(flops_per_token(flavor("debugmodel"), 2048), 71'585'280.0);
  auto a8 = flavor("8B");
  EXPECT_DOUBLE_EQ(flops_per_token(a8, 8192), 6.0 * (8'030'261'248 - 128256LL * 4096) + 12.0 * 32 * 32 * 128 * 8192);
}

TEST(ModelArgs, UnknownFlavorListsKnownOnes) {
  try {
    flavor("8b");
    FAIL();
  } catch (const titan::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("8B"), std::string::npos) << m;
    EXPECT_NE(m.find("debugmodel"), std::string::npos) << m;
  }
}

TEST(Model, BuiltParametersMatchShapeOnlyCount) {
  // Llama 3 with and without GQA; DeepSeek-V3 (latent attention, a dense block before the MoE ones) with plain and
  // low-rank queries.
  auto deepseek_lora = titan::deepseek_v3::flavor("debugmodel");
  deepseek_lora.mla->q_lora_rank = 64;
  for (auto args : {flavor("debugmodel"), flavor("debugmodel_gqa"), titan::deepseek_v3::flavor("debugmodel"), deepseek_lora}) {
    args.max_seq_len = 64;
    Transformer model(args);
    auto shapes = parameter_shapes(args);
    auto named = model.named_parameters();
    ASSERT_EQ(named.size(), shapes.size());
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(named[i].key(), shapes[i].name);
      EXPECT_EQ(named[i].value().sizes().vec(), shapes[i].shape) << shapes[i].name;
      if (shapes[i].name.find("moe.experts.") != std::string::npos) continue;  // one HF tensor per expert
      EXPECT_TRUE(to_hf_name(named[i].key(), args).has_value()) << named[i].key();
      EXPECT_EQ(from_hf_name(*to_hf_name(named[i].key(), args), args), named[i].key());
    }
    // The buffers the shapes name (MoE balancing biases) are the model's, and map to HF names where the family's
    // files hold them.
    std::map<std::string, std::vector<int64_t>> buffers;
    for (const auto& b : model.named_buffers()) buffers[b.key()] = b.value().sizes().vec();
    for (const auto& b : args.buffer_shapes()) {
      ASSERT_TRUE(buffers.count(b.name)) << b.name;
      EXPECT_EQ(buffers.at(b.name), b.shape) << b.name;
      EXPECT_TRUE(to_hf_name(b.name, args).has_value()) << b.name;
    }
  }
}

TEST(Model, InitialisationFollowsTorchtitan) {
  at::manual_seed(0);
  auto args = flavor("debugmodel");
  args.max_seq_len = 64;
  Transformer model(args);
  model.init_weights();
  EXPECT_NEAR(model.tok_embeddings->weight.std().item<double>(), 1.0, 0.01);
  EXPECT_NEAR(model.layers[0]->attention->wq->weight.std().item<double>(), 0.02, 0.001);
  // Depth-scaled residual-output projections: 0.02 / sqrt(2 (layer + 1)).
  EXPECT_NEAR(model.layers[0]->attention->wo->weight.std().item<double>(), 0.02 / std::sqrt(2.0), 0.001);
  EXPECT_NEAR(model.layers[5]->feed_forward->w2->weight.std().item<double>(), 0.02 / std::sqrt(12.0), 0.0005);
  const double out_std = 1.0 / 16.0;
  EXPECT_NEAR(model.output->weight().std().item<double>(), out_std, 0.003);
  EXPECT_LE(model.output->weight().abs().max().item<double>(), 3 * out_std + 1e-6);
  EXPECT_EQ(model.norm->weight.min().item<double>(), 1.0);
}

TEST(Model, RopeTableAppliesLlama31Scaling) {
  // Frequencies with wavelength above 8192 / 1 are divided by 8; those below 8192 / 4 are untouched.
  auto table = precompute_rope(64, 4, 500000.0, RopeScaling{});
  auto angle = at::angle(table.select(0, 1));  // position 1: the frequencies themselves
  const double f0 = 1.0;                       // exponent 0
  EXPECT_NEAR(angle[0].item<double>(), f0, 1e-6);
  const double f_last = 1.0 / std::pow(500000.0, 62.0 / 64.0) / 8.0;
  EXPECT_NEAR(angle[31].item<double>(), f_last, 1e-9);
}

TEST(Model, ExtendingPositionsKeepsTheTrainedOnesAndYarnsChoice) {
  // A DeepSeek-V3 shape trained on 16 positions, YaRN's original context 32: YaRN is off. Sampling past 16 positions
  // lengthens the table; the first 16 positions give the same logits, and the positions past them follow the
  // unscaled frequencies (YaRN stays off, as does its attention scale) rather than what a 64-position model would use.
  auto args = titan::deepseek_v3::flavor("debugmodel");
  args.max_seq_len = 16;
  args.yarn->original_seq_len = 32;
  args.n_layers = 1;
  args.n_dense_layers = 1;
  at::manual_seed(3);
  Decoder model(args);
  model.init_weights();
  model.eval();
  at::NoGradGuard no_grad;
  const at::Tensor tokens = at::randint(args.vocab_size, {1, 40}, at::kLong);
  const int64_t end = model.module_count();
  const at::Tensor before = model.forward_modules(tokens.narrow(1, 0, 16), 0, end, 16);
  EXPECT_THROW(model.forward_modules(tokens, 0, end, 40), c10::Error);
  model.extend_positions(64);
  EXPECT_EQ(model.max_seq_len(), 16);
  const at::Tensor after = model.forward_modules(tokens, 0, end, 40);
  EXPECT_TRUE(at::equal(after.narrow(1, 0, 16), before));
  // A model made for 64 positions turns YaRN on: different logits past (and before) position 16.
  auto longer = args;
  longer.max_seq_len = 64;
  ASSERT_TRUE(longer.yarn_active() && !args.yarn_active());
  Decoder other(longer);
  auto theirs = other.named_parameters();
  for (const auto& item : model.named_parameters()) theirs[item.key()].copy_(item.value());
  other.eval();
  EXPECT_FALSE(at::allclose(other.forward_modules(tokens, 0, end, 40).narrow(1, 16, 24), after.narrow(1, 16, 24), 1e-4, 1e-5));
  // The extended table is the unscaled one for every row.
  const at::Tensor unscaled = precompute_yarn_rope(args.rope_dim(), 64, args.rope_theta, *args.yarn, /*active=*/false);
  EXPECT_TRUE(at::allclose(precompute_rope(args, 64), unscaled));
  EXPECT_TRUE(at::equal(precompute_rope(args, 64).narrow(0, 0, 16), precompute_rope(args)));
}

namespace {

struct GradRun {
  std::vector<at::Tensor> grads;
  double loss;
  int64_t peak_bytes;
};

GradRun run_with_ac(const std::string& mode, const std::string& option, int64_t seq = 256, int64_t batch = 4) {
  titan::metrics::install_cpu_allocation_tracker();
  at::manual_seed(1234);
  auto args = flavor("debugmodel");
  args.max_seq_len = seq;
  auto model = std::make_shared<Transformer>(args);
  model->init_weights();
  titan::config::ActivationCheckpoint ac;
  ac.mode = mode;
  ac.selective_ac_option = option;
  titan::models::apply_activation_checkpointing(*model, titan::distributed::ModuleRange::whole(*model), ac);
  at::Tensor tokens = at::randint(0, args.vocab_size, {batch, seq + 1}, at::kLong);
  at::Tensor inputs = tokens.narrow(1, 0, seq).contiguous(), labels = tokens.narrow(1, 1, seq).contiguous();
  titan::metrics::reset_cpu_peak_bytes();
  const int64_t before = titan::metrics::cpu_bytes_in_use();
  at::Tensor loss = titan::cross_entropy_sum(model->forward(inputs), labels) / static_cast<double>(labels.numel());
  loss.backward();
  GradRun r;
  r.peak_bytes = titan::metrics::cpu_peak_bytes() - before;
  r.loss = loss.item<double>();
  for (auto& p : model->parameters()) r.grads.push_back(p.grad().clone());
  return r;
}

}  // namespace

TEST(ActivationCheckpointing, GradientsIdenticalAndMemoryLower) {
  GradRun none = run_with_ac("none", "1");
  struct Case {
    const char* mode;
    const char* option;
  } cases[] = {{"full", "1"}, {"selective", "2"}, {"selective", "1"}, {"selective", "op"}};
  std::map<std::string, int64_t> peaks = {{"none", none.peak_bytes}};
  for (const auto& c : cases) {
    GradRun r = run_with_ac(c.mode, c.option);
    std::string label = std::string(c.mode) + ":" + c.option;
    EXPECT_EQ(r.loss, none.loss) << label;
    ASSERT_EQ(r.grads.size(), none.grads.size());
    // Recomputing whole blocks replays the same operations: bitwise equal. Op-level AC's kept products go through
    // titan's linear backward instead of LibTorch's: equal up to float32 rounding.
    const bool bitwise = std::string(c.option) != "op";
    for (size_t i = 0; i < r.grads.size(); ++i) {
      if (bitwise) EXPECT_TRUE(at::equal(r.grads[i], none.grads[i])) << label << " parameter " << i;
      else EXPECT_TRUE(at::allclose(r.grads[i], none.grads[i], /*rtol=*/1e-5, /*atol=*/1e-8)) << label << " parameter " << i;
    }
    peaks[label] = r.peak_bytes;
    EXPECT_LT(r.peak_bytes, none.peak_bytes) << label;
  }
  // torchtitan's op-level policy keeps about a third of a block's activations (here: 2 of 2 blocks, against
  // selective 2's 1 of 2 whole).
  EXPECT_LT(peaks["full:1"], peaks["selective:op"]);
  EXPECT_LT(peaks["selective:op"], peaks["selective:2"]);
  for (const auto& [label, bytes] : peaks)
    std::printf("[ memory ] activation checkpointing %-12s peak %.3f MiB (%.1f%% of none)\n", label.c_str(), bytes / 1048576.0,
                100.0 * bytes / none.peak_bytes);
}

TEST(ActivationCheckpointing, MemoryBudgetModeIsAClearError) {
  auto args = flavor("debugmodel");
  args.max_seq_len = 16;
  Transformer model(args);
  titan::config::ActivationCheckpoint ac;
  ac.mode = "memory_budget";
  EXPECT_THROW(titan::models::apply_activation_checkpointing(model, titan::distributed::ModuleRange::whole(model), ac), titan::UserError);
}

TEST(StateDictAdapter, RopePermutationRoundTrips) {
  auto args = flavor("debugmodel_gqa");
  at::Tensor wq = at::randn({256, 256}), wk = at::randn({64, 256});
  for (auto [name, w] : {std::pair{"layers.3.attention.wq.weight", wq}, std::pair{"layers.3.attention.wk.weight", wk}}) {
    at::Tensor hf = to_hf_tensor(name, w, args);
    EXPECT_FALSE(at::equal(hf, w));
    EXPECT_TRUE(at::equal(from_hf_tensor(name, hf, args), w));
  }
  // HF's half-split layout: row 1 of a head is Meta's row 2 (the first element of the second rotary pair).
  at::Tensor hf = to_hf_tensor("layers.0.attention.wq.weight", wq, args);
  EXPECT_TRUE(at::equal(hf[1], wq[2]));
  EXPECT_TRUE(at::equal(hf[8], wq[1]));  // head_dim 16: the second half starts at row 8
}

TEST(Model, BlockCausalAttentionMakesPackedDocumentsIndependent) {
  // Two documents packed in one window with block-causal attention give each document's logits as if it were
  // alone (RoPE depends on relative positions only); plain causal attention lets the second see the first.
  at::manual_seed(3);
  auto args = flavor("debugmodel_gqa");
  args.vocab_size = 300;
  Transformer model(args);
  model.init_weights();
  at::Tensor a = at::randint(0, 300, {1, 5}, at::kLong), b = at::randint(0, 300, {1, 7}, at::kLong);
  at::Tensor packed = at::cat({a, b}, 1);
  at::Tensor positions = at::cat({at::arange(5, at::kLong), at::arange(7, at::kLong)}).unsqueeze(0);
  at::NoGradGuard no_grad;
  at::Tensor blocked = model.forward(packed, {}, positions), causal = model.forward(packed);
  at::Tensor alone_a = model.forward(a), alone_b = model.forward(b);
  EXPECT_TRUE(at::allclose(blocked.narrow(1, 0, 5), alone_a, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(blocked.narrow(1, 5, 7), alone_b, 1e-4, 1e-5))
      << (blocked.narrow(1, 5, 7) - alone_b).abs().max().item<double>();
  EXPECT_FALSE(at::allclose(causal.narrow(1, 5, 7), alone_b, 1e-3, 1e-3));
  // A window that starts inside a document (its first position is not 0) is one document until the next 0.
  at::Tensor mask = block_causal_mask(at::tensor({3, 4, 0, 1}, at::kLong).unsqueeze(0));
  at::Tensor expected = at::tensor({1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1}, at::kLong).to(at::kBool).view({1, 1, 4, 4});
  EXPECT_TRUE(at::equal(mask, expected));
}

TEST(Model, CachedSamplingStepsGiveTheWholeSequencesLogits) {
  // Sampling's cache (models/common/kv_cache.h): two rows, the second left-padded by 2, run as a prefill of 5
  // positions and then one position at a time, give each position the logits the uncached model gives each row
  // alone. Grouped-query attention caches its keys and values; latent attention (DeepSeek-V3, low-rank queries, YaRN
  // over a longer context) its latent and rotary key, attended to in the absorbed form. The weights are scaled up
  // from their initialisation so that attention is far from uniform.
  auto deepseek = titan::deepseek_v3::flavor("debugmodel");
  deepseek.mla->q_lora_rank = 32;
  deepseek.n_layers = 2;
  deepseek.max_seq_len = 8192;  // above YaRN's original 4,096 positions
  for (auto args : {flavor("debugmodel_gqa"), deepseek}) {
    at::manual_seed(5);
    args.vocab_size = 300;
    if (!args.mla) args.max_seq_len = 64;
    Transformer model(args);
    model.init_weights();
    at::NoGradGuard no_grad;
    for (auto& p : model.parameters()) p.mul_(4);
    const int64_t total = 9, pad = 2, n = static_cast<int64_t>(model.layers.size());
    const at::Tensor tokens = at::randint(0, 300, {2, total}, at::kLong);
    const at::Tensor alone[2] = {model.forward(tokens.narrow(0, 0, 1)), model.forward(tokens.narrow(0, 1, 1).narrow(1, pad, total - pad))};
    // Attention matters here: the last position's logits move when the first token changes.
    at::Tensor other = tokens.narrow(0, 0, 1).clone();
    other[0][0] = (other[0][0].item<int64_t>() + 1) % 300;
    const double scale = alone[0].abs().max().item<double>();
    EXPECT_GT((model.forward(other) - alone[0]).narrow(1, total - 1, 1).abs().max().item<double>(), 1e-2 * scale);
    KvCache cache(model, at::tensor({int64_t{0}, pad}, at::kLong), total);
    std::vector<at::Tensor> steps;
    for (int64_t start = 0; start < total; start += start == 0 ? 5 : 1) {
      const int64_t count = start == 0 ? 5 : 1;
      cache.advance_to(start);
      steps.push_back(model.forward_modules(tokens.narrow(1, start, count), 0, n + 3, start + count, cache.positions(start, count)));
    }
    const at::Tensor cached = at::cat(steps, 1);
    const at::Tensor row1 = cached.narrow(0, 1, 1).narrow(1, pad, total - pad);
    // Float32 rounding of the same sums taken in other orders, relative to the largest logit.
    EXPECT_LT((cached.narrow(0, 0, 1) - alone[0]).abs().max().item<double>(), 1e-5 * scale) << scale;
    EXPECT_LT((row1 - alone[1]).abs().max().item<double>(), 1e-5 * scale) << scale;
  }
}

// DDP's gradient hooks live in the parameters' autograd nodes, which outlive the Ddp object: a backward after it is
// destroyed must neither call into it nor lose the gradient.
TEST(DataParallel, GradientHooksOutlivingTheirDdpDoNothing) {
  at::Tensor w = at::randn({4, 4}).requires_grad_(true);
  at::Tensor loss;
  {
    titan::distributed::Ddp ddp({w}, titan::distributed::make_local_communicator());
    ddp.before_backward(true);
    loss = (w * w).sum();
  }
  loss.backward();
  EXPECT_TRUE(at::allclose(w.grad(), 2 * w.detach()));
}
