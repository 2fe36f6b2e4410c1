// Tokenizer building blocks: UTF-8 repair, the byte-level alphabet, the merge loop, and loading errors.
#include <gtest/gtest.h>

#include "test_util.h"
#include "titan/common/error.h"
#include "titan/components/tokenizer/bpe_merge.h"
#include "titan/components/tokenizer/bpe_trainer.h"
#include "titan/components/tokenizer/byte_level.h"
#include "titan/components/tokenizer/regex_splitter.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/components/tokenizer/utf8.h"

using namespace titan::tokenizer;

TEST(Utf8, LossyRepairReplacesMaximalInvalidSubparts) {
  EXPECT_EQ(utf8_lossy("plain é"), "plain é");
  EXPECT_EQ(utf8_lossy("a\xff" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(utf8_lossy("\xE2\x82"), "\xEF\xBF\xBD");           // truncated 3-byte sequence: one replacement
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: three
  EXPECT_TRUE(is_valid_utf8("日本"));
  EXPECT_FALSE(is_valid_utf8("\xC0\xAF"));
}

TEST(ByteLevel, AlphabetRoundTripsAllBytes) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(chars_to_bytes(bytes_to_chars(all)), all);
  EXPECT_EQ(bytes_to_chars(" "), "\xC4\xA0");  // U+0120 'Ġ'
  EXPECT_EQ(bytes_to_chars("A"), "A");
  EXPECT_FALSE(chars_to_bytes(" ").has_value());  // a raw space is not part of the alphabet
}

TEST(BpeMerge, LowestRankFirstLeftmostOnTies) {
  // Units "aaaa" with rank(aa) = 0 and rank(aaaa) = 1: (a a)(a a) then (aa aa).
  std::vector<std::pair<uint32_t, int32_t>> starts = {{0, 1}, {1, 1}, {2, 1}, {3, 1}};
  auto s = make_symbols(starts, 4);
  std::vector<std::pair<uint32_t, uint32_t>> merged_at;
  bpe_merge(s, [&](const Symbol& l, const Symbol& r) -> std::pair<int32_t, int32_t> {
    if (l.len == 1 && r.len == 1) return {0, 2};
    if (l.len == 2 && r.len == 2) return {1, 4};
    return {-1, -1};
  });
  std::vector<int32_t> ids;
  for_each_symbol(s, [&](const Symbol& sym) { ids.push_back(sym.id); });
  EXPECT_EQ(ids, std::vector<int32_t>{4});
  // "aaa" with only rank(aa): the leftmost pair merges.
  auto t = make_symbols({{0, 1}, {1, 1}, {2, 1}}, 3);
  bpe_merge(t, [](const Symbol& l, const Symbol& r) -> std::pair<int32_t, int32_t> {
    return l.len == 1 && r.len == 1 ? std::pair{0, 2} : std::pair{-1, -1};
  });
  EXPECT_EQ(t[0].len, 2u);
  EXPECT_EQ(t[2].len, 1u);
}

TEST(RegexSplitter, PiecesCoverTheTextAndNelIsWhitespace) {
  RegexSplitter split(kLlama3Pattern, "test");
  std::string text = "Hello  world\u0085x 123456 ,,!\n\n";
  std::string joined;
  std::vector<std::string> pieces;
  split.split(text, [&](std::string_view p, bool) {
    pieces.emplace_back(p);
    joined += p;
  });
  EXPECT_EQ(joined, text);
  EXPECT_EQ(pieces[0], "Hello");
  EXPECT_EQ(pieces[1], " ");
  EXPECT_EQ(pieces[2], " world");
  std::string invalid = "ab\xff\xfe cd";
  joined.clear();
  split.split(invalid, [&](std::string_view p, bool) { joined += p; });
  EXPECT_EQ(joined, invalid);
}

TEST(TokenizerLoading, ErrorsNameThePath) {
  titan_test::TempDir tmp;
  auto expect_error = [](const std::string& path, const std::string& needle) {
    try {
      load(path);
      FAIL() << path;
    } catch (const titan::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(tmp.path() + "/missing", "does not exist");
  tmp.write("empty_dir/notes.txt", "x");
  expect_error(tmp.path() + "/empty_dir", "expected tokenizer.json, tokenizer.model or one *.tiktoken file");
  expect_error(tmp.write("bad.tiktoken", "QQ== 0\nnot base64!! 1\n"), "bad.tiktoken:2");
  expect_error(tmp.write("partial.tiktoken", "QQ== 0\n"), "has no token");
  expect_error(tmp.write("huge.tiktoken", "QQ== 3000000000\n"), "huge.tiktoken:1");
  expect_error(tmp.write("neg/tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}, \"merges\": []}}"),
               "has id -1");
  // Two tokens with one id would decode that id to either: refused.
  expect_error(tmp.write("dup_rank.tiktoken", "QQ== 0\nQg== 0\n"), "dup_rank.tiktoken:2: rank 0 is given to a second token");
  expect_error(tmp.write("dup/tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}}"),
               "have the same id 0");
  expect_error(tmp.write("dup_added/tokenizer.json",
                         "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}, \"added_tokens\": "
                         "[{\"id\": 2, \"content\": \"<x>\"}, {\"id\": 2, \"content\": \"<y>\"}]}"),
               "added tokens \"<x>\" and \"<y>\" have the same id 2");
  expect_error(tmp.write("tokenizer.json", "{\"model\": "), "not valid JSON");
  // Found by fuzz_tokenizer_files: a number too large for a double escaped as nlohmann's out_of_range.
  expect_error(tmp.write("huge_number/tokenizer.json", "{\"model\": 6e666666}"), "not valid JSON");
  expect_error(tmp.write("u/tokenizer.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}"), "not supported yet");
}

TEST(BpeTrainer, LearnsFrequentPairsDeterministically) {
  titan_test::TempDir tmp;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the theme of the thesis is there. ";
  auto run = [&](const std::string& out) {
    BpeTrainerOptions o;
    o.vocab_size = 256 + 256 + 20;
    return train_bpe([&](const std::function<void(std::string_view)>& emit) { emit(text); }, o, out);
  };
  auto stats = run(tmp.path() + "/a.tiktoken");
  run(tmp.path() + "/b.tiktoken");
  EXPECT_GT(stats.merges, 5);  // stops early once no pair occurs twice
  EXPECT_LE(stats.merges, 20);
  std::ifstream a(tmp.path() + "/a.tiktoken"), b(tmp.path() + "/b.tiktoken");
  std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_EQ(sa, sb);
  auto tok = load(tmp.path() + "/a.tiktoken");
  EXPECT_EQ(tok->vocab_size(), 256 + stats.merges + 256);
  auto ids = tok->encode(" the");
  EXPECT_EQ(ids.size(), 1u);  // " the" is the most frequent piece: fully merged
  EXPECT_EQ(tok->decode(tok->encode_document("the thesis"), true), "the thesis");
  EXPECT_EQ(tok->encode_document("x").front(), *tok->bos_id());
  EXPECT_EQ(tok->encode_document("x").back(), *tok->eos_id());
}
