// The placement layer (chunks, boxes, layouts composed from TP and FSDP levels) and layout-independent
// initialisation: any box of any parameter filled on its own equals the same box of the whole tensor, bitwise.
#include <gtest/gtest.h>

#include <cmath>

#include "titan/common/error.h"
#include "titan/distributed/placement.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/models/llama3/args.h"
#include "titan/models/common/decoder.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/nn/init.h"
#include "titan/nn/storage.h"

using namespace titan::distributed;

TEST(Placement, ChunksFollowTorchChunk) {
  // torch.arange(10).chunk(4): sizes 3, 3, 3, 1; torch.arange(5).chunk(4): 2, 2, 1 and an empty fourth piece.
  std::vector<int64_t> lengths, begins;
  for (int i = 0; i < 4; ++i) lengths.push_back(chunk(10, 4, i).length), begins.push_back(chunk(10, 4, i).begin);
  EXPECT_EQ(lengths, (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(begins, (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(chunk(5, 4, 2).length, 1);
  EXPECT_EQ(chunk(5, 4, 3).length, 0);
  EXPECT_EQ(chunk(5, 4, 3).begin, 5);
  EXPECT_EQ(chunk_capacity(10, 4), 3);
}

TEST(Placement, BoxesIntersect) {
  Box a{{0, 4}, {8, 4}}, b{{6, 0}, {4, 6}};
  auto c = a.intersect(b);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, (Box{{6, 4}, {2, 2}}));
  EXPECT_FALSE(a.intersect(Box{{8, 0}, {2, 8}}).has_value());
  EXPECT_EQ(a.str(), "[0:8, 4:8]");
  EXPECT_EQ(Box::whole({3, 5}).numel(), 15);
}

TEST(Placement, TensorParallelThenFsdpGivesOneBoxPerRank) {
  // A 768 x 256 column-parallel weight over tp 2, then FSDP over 3 ranks: rank (tp 1, dp 2) holds rows 384 + 256..384.
  TensorLayout w1 = TensorLayout({768, 256}).then("tp", 2, 1, Placement::shard(0)).then("dp_shard", 3, 2, Placement::shard(0));
  EXPECT_EQ(w1.local_box(), (Box{{640, 0}, {128, 256}}));
  EXPECT_EQ(w1.padded_local_shape(), (std::vector<int64_t>{128, 256}));
  // Row-parallel w2 (256 x 768): tp shards columns, FSDP rows: a block of rows of a column block.
  TensorLayout w2 = TensorLayout({256, 768}).then("tp", 2, 1, Placement::shard(1)).then("dp_shard", 3, 1, Placement::shard(0));
  EXPECT_EQ(w2.local_box(), (Box{{86, 384}, {86, 384}}));
  // Uneven FSDP: 256 rows over 3 ranks are 86, 86, 84 rows, each padded to 86.
  TensorLayout last = TensorLayout({256, 768}).then("tp", 2, 0, Placement::shard(1)).then("dp_shard", 3, 2, Placement::shard(0));
  EXPECT_EQ(last.local_box(), (Box{{172, 0}, {84, 384}}));
  EXPECT_EQ(last.padded_local_shape(), (std::vector<int64_t>{86, 384}));
  EXPECT_EQ(last.str(), "Shard(1)@tp(2) Shard(0)@dp_shard(3)");
  // Shard(-1) is the last dimension.
  EXPECT_EQ(TensorLayout({4, 6}).then("tp", 2, 1, Placement::shard(-1)).local_box(), (Box{{0, 3}, {4, 3}}));
  EXPECT_THROW(TensorLayout({4}).then("tp", 2, 0, Placement::shard(1)), titan::UserError);
}

TEST(Placement, OwnersCountReplicatedCopiesOnce) {
  // An RMSNorm weight under TP 2 x HSDP (2 replicas x 2 shards): the copy at tp 0 and replica 0 is the one that counts.
  auto layout = [](int64_t tp, int64_t shard, int64_t replica) {
    return TensorLayout({256})
        .then("tp", 2, tp, Placement::replicate())
        .then("dp_shard", 2, shard, Placement::shard(0))
        .then("dp_replicate", 2, replica, Placement::replicate());
  };
  int owners = 0;
  int64_t owned_elements = 0;
  for (int tp = 0; tp < 2; ++tp)
    for (int shard = 0; shard < 2; ++shard)
      for (int replica = 0; replica < 2; ++replica)
        if (layout(tp, shard, replica).owner()) ++owners, owned_elements += layout(tp, shard, replica).local_box().numel();
  EXPECT_EQ(owners, 2);
  EXPECT_EQ(owned_elements, 256);  // each element exactly once
  EXPECT_FALSE(layout(0, 0, 0).has_partial());
  EXPECT_TRUE(TensorLayout({4}).then("tp", 2, 0, Placement::partial()).has_partial());
}

TEST(Init, AnyBoxEqualsTheSameBoxOfTheWholeTensorBitwise) {
  const auto spec = titan::nn::InitSpec::truncated_normal(0.0, 0.02, -2.0, 2.0);
  at::Tensor whole = at::empty({96, 40});
  titan::nn::fill(whole, spec, 7, "layers.0.attention.wq.weight");
  for (auto [r0, c0, rows, cols] : {std::tuple{0, 0, 96, 40}, std::tuple{13, 5, 31, 17}, std::tuple{95, 39, 1, 1},
                                    std::tuple{48, 0, 48, 40}}) {
    at::Tensor box = at::empty({rows, cols});
    titan::nn::fill_box(box, spec, 7, "layers.0.attention.wq.weight", {96, 40}, {r0, c0});
    EXPECT_TRUE(at::equal(box, whole.narrow(0, r0, rows).narrow(1, c0, cols))) << r0 << "," << c0;
  }
  // Another name or seed gives unrelated values; bfloat16 targets are the float32 values rounded.
  at::Tensor other = at::empty({96, 40});
  titan::nn::fill(other, spec, 7, "layers.0.attention.wk.weight");
  EXPECT_LT(std::abs(at::corrcoef(at::stack({whole.flatten(), other.flatten()}))[0][1].item<double>()), 0.05);
  at::Tensor half = at::empty({96, 40}, at::kBFloat16);
  titan::nn::fill(half, spec, 7, "layers.0.attention.wq.weight");
  EXPECT_TRUE(at::equal(half, whole.to(at::kBFloat16)));
}

TEST(Init, DistributionsMatchTheirSpecs) {
  at::Tensor normal = at::empty({200000});
  titan::nn::fill(normal, titan::nn::InitSpec::normal(0.0, 1.0), 1, "n");
  EXPECT_NEAR(normal.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(normal.std().item<double>(), 1.0, 0.01);
  // Fraction beyond 2 sigma: 4.55% for a normal distribution.
  EXPECT_NEAR(normal.abs().gt(2.0).to(at::kDouble).mean().item<double>(), 0.0455, 0.002);
  at::Tensor truncated = at::empty({200000});
  titan::nn::fill(truncated, titan::nn::InitSpec::truncated_normal(0.0, 1.0, -1.0, 1.0), 1, "t");
  EXPECT_LE(truncated.abs().max().item<double>(), 1.0);
  // A standard normal truncated to [-1, 1] has variance 1 - 2 phi(1) / (2 Phi(1) - 1) = 0.29100.
  EXPECT_NEAR(truncated.var().item<double>(), 0.29100, 0.004);
  // The quantile function inverts the normal CDF to double precision.
  for (double p : {1e-12, 0.001, 0.02425, 0.3, 0.5, 0.9, 0.999999})
    EXPECT_NEAR(0.5 * std::erfc(-titan::nn::normal_quantile(p) / std::sqrt(2.0)), p, 1e-15 + 1e-12 * p) << p;
}

TEST(Init, ShardedParametersInitialiseLikeTheWholeModel) {
  // Two column-parallel "ranks" of a model built without storage fill exactly the rows of the whole model.
  auto args = titan::llama3::flavor("debugmodel_gqa");
  args.max_seq_len = 16;
  titan::models::Decoder whole(args);
  whole.init_weights(11);
  for (int rank = 0; rank < 2; ++rank) {
    titan::models::Decoder shell(args, titan::nn::ParameterOptions{at::TensorOptions(), /*allocate=*/false});
    auto params = describe_parameters(shell);
    EXPECT_FALSE(titan::nn::has_storage(params[0].local));
    for (auto& p : params) {
      p.layout = p.layout.then("tp", 2, rank, Placement::shard(0));
      p.local.set_data(titan::nn::without_storage(p.layout.padded_local_shape(), p.local.options()));
    }
    materialize(params);
    initialize(params, whole.init_specs(), 11);
    auto full = whole.named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const Box box = params[i].layout.local_box();
      EXPECT_TRUE(at::equal(params[i].local, full[params[i].name].narrow(0, box.offsets[0], box.lengths[0]))) << params[i].name;
    }
  }
}

namespace {
std::string tp_error(const titan::models::DecoderArgs& args, int64_t tp, int64_t seq_len) {
  try {
    titan::models::check_tensor_parallel(args, tp, {{"training.seq_len", seq_len}});
  } catch (const titan::UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(TensorParallelChecks, EveryIndivisibleSizeIsNamedWithItsNumbers) {
  auto args = titan::llama3::flavor("debugmodel");  // 16 heads, feed-forward 768, vocabulary 2048
  EXPECT_EQ(tp_error(args, 4, 64), "");
  EXPECT_NE(tp_error(args, 3, 64).find("model n_heads (query heads) = 16 does not divide by 3"), std::string::npos);
  args.n_kv_heads = 2;
  EXPECT_NE(tp_error(args, 4, 64).find("model n_kv_heads (key/value heads) = 2 does not divide by 4"), std::string::npos);
  args.n_kv_heads.reset();
  args.multiple_of = 100;  // hidden 700
  EXPECT_NE(tp_error(args, 8, 64).find("the feed-forward hidden dimension = 700 does not divide by 8"), std::string::npos);
  args.multiple_of = 256;
  args.vocab_size = 2050;
  EXPECT_NE(tp_error(args, 4, 64).find("the vocabulary size = 2050 does not divide by 4"), std::string::npos);
  args.vocab_size = 2048;
  EXPECT_NE(tp_error(args, 4, 66).find("training.seq_len = 66 does not divide by 4"), std::string::npos);
}
