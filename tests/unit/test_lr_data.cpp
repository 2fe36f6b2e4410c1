// LR schedule values, loss normalisation, data packing into seq_len + 1 windows, and dataset errors.
#include <gtest/gtest.h>

#include "test_util.h"
#include "titan/common/error.h"
#include "titan/components/data/text_dataset.h"
#include "titan/components/loss.h"
#include "titan/components/lr_scheduler.h"

using titan::LRScheduler;

TEST(LRScheduler, WarmupThenLinearDecay) {
  titan::config::LRScheduler c;
  c.warmup_steps = 2;
  c.decay_ratio = 0.8;
  c.decay_type = "linear";
  LRScheduler s(c, 8e-4, 10);  // torchtitan's debug TOML
  EXPECT_EQ(s.warmup_steps(), 2);
  EXPECT_EQ(s.decay_steps(), 8);
  EXPECT_EQ(s.stable_steps(), 1);
  const double expected[] = {0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125};
  for (int i = 0; i < 10; ++i) EXPECT_DOUBLE_EQ(s.factor(i), expected[i]) << i;
  EXPECT_DOUBLE_EQ(s.current_lr(), 4e-4);
  s.step();
  EXPECT_DOUBLE_EQ(s.current_lr(), 8e-4);
}

TEST(LRScheduler, SqrtCosineAndMinFactor) {
  titan::config::LRScheduler c;
  c.warmup_steps = 0;
  c.decay_type = "cosine";
  c.min_lr_factor = 0.1;
  LRScheduler cosine(c, 1.0, 4);  // decay over all 4 steps, stable 1
  EXPECT_DOUBLE_EQ(cosine.factor(0), 1.0);
  EXPECT_NEAR(cosine.factor(1), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_NEAR(cosine.factor(4), 0.1, 1e-15);
  c.decay_type = "sqrt";
  c.min_lr_factor = 0;
  LRScheduler sqrt_s(c, 1.0, 4);
  EXPECT_NEAR(sqrt_s.factor(2), 1 - std::sqrt(0.5), 1e-15);
}

TEST(LRScheduler, WarmupLongerThanTrainingIsClamped) {
  titan::config::LRScheduler c;
  c.warmup_steps = 200;
  LRScheduler s(c, 1.0, 10);
  EXPECT_EQ(s.warmup_steps(), 10);
  EXPECT_DOUBLE_EQ(s.factor(4), 0.5);
}

TEST(Loss, SumsInFloat32AndIgnoresPadding) {
  at::Tensor logits = at::randn({2, 3, 5}).to(at::kBFloat16);
  at::Tensor labels = at::tensor({1, 2, -100, 4, -100, 0}, at::kLong).view({2, 3});
  at::Tensor loss = titan::cross_entropy_sum(logits, labels);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_EQ(titan::count_valid_tokens(labels), 4);
  at::Tensor logp = at::log_softmax(logits.to(at::kFloat).view({6, 5}), 1);
  double expected = -(logp[0][1] + logp[1][2] + logp[3][4] + logp[5][0]).item<double>();
  EXPECT_NEAR(loss.item<double>(), expected, 1e-5);
}

namespace {

// A tokenizer whose ids are the bytes of the text, with BOS 256 and EOS 257: packing is easy to check by hand.
class ByteTokenizer : public titan::tokenizer::Tokenizer {
 public:
  ByteTokenizer() {
    bos_id_ = 256;
    eos_id_ = 257;
  }
  std::vector<int32_t> encode(std::string_view text) const override { return {text.begin(), text.end()}; }
  std::string decode(std::span<const int32_t> ids, bool) const override { return {ids.begin(), ids.end()}; }
  int64_t vocab_size() const override { return 258; }
  std::optional<int32_t> token_to_id(std::string_view) const override { return std::nullopt; }
  std::string description() const override { return "bytes"; }
};

}  // namespace

TEST(TextData, PacksDocumentsIntoShiftedWindowsAndLoops) {
  titan_test::TempDir tmp;
  tmp.write("data/a.txt", "abc");
  tmp.write("data/b.jsonl", "{\"text\": \"de\"}\n\n{\"text\": \"fgh\", \"id\": 3}\n");
  tmp.write("data/ignored.csv", "not data");
  auto spec = titan::data::resolve_dataset("mine", tmp.path() + "/data");
  ASSERT_EQ(spec.files.size(), 2u);
  ByteTokenizer tok;
  titan::data::TextDataLoader loader(spec, tok, /*seq_len=*/4, /*batch=*/2);
  // Stream: [256 a b c 257] [256 d e 257] [256 f g h 257], then again from the start.
  std::vector<int32_t> stream = {256, 'a', 'b', 'c', 257, 256, 'd', 'e', 257, 256, 'f', 'g', 'h', 257};
  std::vector<int32_t> twice = stream;
  twice.insert(twice.end(), stream.begin(), stream.end());
  size_t offset = 0;
  for (int batch = 0; batch < 2; ++batch) {
    auto b = loader.next();
    ASSERT_EQ(b.inputs.sizes().vec(), (std::vector<int64_t>{2, 4}));
    for (int row = 0; row < 2; ++row) {
      for (int t = 0; t < 4; ++t) {
        EXPECT_EQ(b.inputs[row][t].item<int64_t>(), twice[offset + t]);
        EXPECT_EQ(b.labels[row][t].item<int64_t>(), twice[offset + t + 1]);
      }
      offset += 5;  // windows of seq_len + 1 do not overlap
    }
  }
  EXPECT_EQ(loader.epoch(), 1);
}

TEST(TextData, DataParallelRanksSplitTheSingleProcessStream) {
  titan_test::TempDir tmp;
  for (int i = 0; i < 7; ++i) tmp.write("d/" + std::to_string(i) + ".txt", std::string(3 + i, static_cast<char>('a' + i)));
  auto spec = titan::data::resolve_dataset("d", tmp.path() + "/d");
  ByteTokenizer tok;
  // One process, batch 4 per step, against 2 ranks with batch 2 each: the same windows per step, split in two.
  titan::data::TextDataLoader single(spec, tok, 5, 4);
  std::vector<std::unique_ptr<titan::data::TextDataLoader>> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(std::make_unique<titan::data::TextDataLoader>(spec, tok, 5, 2, r, 2));
  for (int step = 0; step < 5; ++step) {
    auto whole = single.next();
    auto a = ranks[0]->next(), b = ranks[1]->next();
    EXPECT_TRUE(at::equal(at::cat({a.inputs, b.inputs}), whole.inputs)) << "step " << step;
    EXPECT_TRUE(at::equal(at::cat({a.labels, b.labels}), whole.labels)) << "step " << step;
  }
}

TEST(TextData, BadInputNamesFileAndLine) {
  titan_test::TempDir tmp;
  tmp.write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 5}\n");
  ByteTokenizer tok;
  titan::data::TextDataLoader loader(titan::data::resolve_dataset("x", tmp.path() + "/bad.jsonl"), tok, 64, 1);
  try {
    loader.next();
    FAIL();
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
  }
  tmp.write("broken.jsonl", "{\"text\": \"ok\"\n");
  titan::data::TextDataLoader broken(titan::data::resolve_dataset("x", tmp.path() + "/broken.jsonl"), tok, 4, 1);
  EXPECT_THROW(broken.next(), titan::UserError);
  EXPECT_THROW(titan::data::resolve_dataset("c4_test", std::nullopt), titan::UserError);
  EXPECT_THROW(titan::data::resolve_dataset("x", tmp.path() + "/missing"), titan::UserError);
  tmp.write("empty/readme.md", "no data here");
  EXPECT_THROW(titan::data::resolve_dataset("x", tmp.path() + "/empty"), titan::UserError);
  tmp.write("rows.json", "[]");
  EXPECT_THROW(titan::data::resolve_dataset("x", tmp.path() + "/rows.json"), titan::UserError);
  tmp.write("blank.txt", "");
  titan::data::TextDataLoader blank(titan::data::resolve_dataset("x", tmp.path() + "/blank.txt"), tok, 4, 1);
  EXPECT_THROW(blank.next(), titan::UserError);
}

TEST(TextData, BuiltinFortunesCorpusSplitsOnPercentLines) {
  if (!std::filesystem::exists(titan::data::kBuiltinCorpusDir)) GTEST_SKIP() << "fortunes package not installed";
  auto spec = titan::data::resolve_dataset("fortunes", std::nullopt);
  titan::data::DocumentReader reader(spec);
  std::string doc;
  int count = 0;
  while (reader.next(doc) && count < 1000) {
    EXPECT_EQ(doc.find("\n%\n"), std::string::npos);
    ++count;
  }
  EXPECT_EQ(count, 1000);
}
