#include "titan/components/tokenizer/bpe_trainer.h"

#include <algorithm>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <queue>
#include <unordered_map>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/progress.h"
#include "titan/common/strings.h"
#include "titan/components/tokenizer/regex_splitter.h"

namespace titan::tokenizer {
namespace {

std::string base64_encode(std::string_view bytes) {
  static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    uint32_t v = (static_cast<uint8_t>(bytes[i]) << 16) | (static_cast<uint8_t>(bytes[i + 1]) << 8) | static_cast<uint8_t>(bytes[i + 2]);
    out += {table[v >> 18], table[(v >> 12) & 63], table[(v >> 6) & 63], table[v & 63]};
  }
  if (i + 1 == bytes.size()) {
    uint32_t v = static_cast<uint8_t>(bytes[i]) << 16;
    out += {table[v >> 18], table[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    uint32_t v = (static_cast<uint8_t>(bytes[i]) << 16) | (static_cast<uint8_t>(bytes[i + 1]) << 8);
    out += {table[v >> 18], table[(v >> 12) & 63], table[(v >> 6) & 63], '='};
  }
  return out;
}

uint64_t key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

struct Word {
  std::vector<int32_t> symbols;
  int64_t count;
};

}  // namespace

BpeTrainerStats train_bpe(const std::function<void(const std::function<void(std::string_view)>&)>& for_each_document,
                          const BpeTrainerOptions& options, const std::string& output_path) {
  const int64_t num_special = 256;
  if (options.vocab_size < 256 + num_special)
    fail("tokenizer vocab size ", options.vocab_size, " is too small: 256 byte tokens + ", num_special,
         " special tokens need at least ", 256 + num_special);
  auto start = std::chrono::steady_clock::now();
  BpeTrainerStats stats;
  RegexSplitter splitter(kLlama3Pattern, "Llama 3 pre-tokenizer");
  std::unordered_map<std::string, int64_t> piece_counts;
  for_each_document([&](std::string_view doc) {
    stats.bytes += static_cast<int64_t>(doc.size());
    splitter.split(doc, [&](std::string_view piece, bool) { ++piece_counts[std::string(piece)]; });
  });
  if (piece_counts.empty()) fail("no text to train the tokenizer on");

  // Sorted for a result independent of hash-map order.
  std::vector<std::pair<std::string, int64_t>> sorted(piece_counts.begin(), piece_counts.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<Word> words;
  words.reserve(sorted.size());
  for (auto& [piece, count] : sorted) {
    Word w{{}, count};
    for (unsigned char c : piece) w.symbols.push_back(c);
    words.push_back(std::move(w));
  }
  stats.unique_words = static_cast<int64_t>(words.size());

  std::vector<std::string> token_bytes(256);
  for (int b = 0; b < 256; ++b) token_bytes[b] = std::string(1, static_cast<char>(b));

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;
  for (int32_t wi = 0; wi < static_cast<int32_t>(words.size()); ++wi) {
    const auto& s = words[wi].symbols;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      uint64_t k = key(s[i], s[i + 1]);
      pair_count[k] += words[wi].count;
      auto& list = pair_words[k];
      if (list.empty() || list.back() != wi) list.push_back(wi);
    }
  }
  // Max-heap by count, ties broken by the smaller pair key: deterministic.
  using Entry = std::pair<int64_t, uint64_t>;
  auto worse = [](const Entry& a, const Entry& b) { return a.first != b.first ? a.first < b.first : a.second > b.second; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> heap(worse);
  for (const auto& [k, c] : pair_count) heap.emplace(c, k);

  const int64_t target_merges = options.vocab_size - num_special - 256;
  std::vector<uint64_t> touched;
  Progress progress("learning BPE merges", target_merges, "merges");
  while (stats.merges < target_merges && !heap.empty()) {
    progress.set(stats.merges);
    auto [count, k] = heap.top();
    heap.pop();
    auto it = pair_count.find(k);
    if (it == pair_count.end() || it->second != count) continue;  // stale entry
    if (count < options.min_pair_count) break;
    const int32_t left = static_cast<int32_t>(k >> 32), right = static_cast<int32_t>(k & 0xffffffffu);
    const int32_t merged = static_cast<int32_t>(token_bytes.size());
    token_bytes.push_back(token_bytes[left] + token_bytes[right]);
    ++stats.merges;
    touched.clear();
    auto adjust = [&](uint64_t pk, int64_t delta, int32_t wi) {
      auto& c = pair_count[pk];
      c += delta;
      if (delta > 0) {
        auto& list = pair_words[pk];
        if (list.empty() || list.back() != wi) list.push_back(wi);
      }
      touched.push_back(pk);
    };
    std::vector<int32_t> affected = std::move(pair_words[k]);
    pair_words.erase(k);
    std::vector<std::pair<uint64_t, int64_t>> delta;
    for (int32_t wi : affected) {
      auto& s = words[wi].symbols;
      const int64_t n = words[wi].count;
      bool found = false;
      for (size_t i = 0; i + 1 < s.size() && !found; ++i) found = s[i] == left && s[i + 1] == right;
      if (!found) continue;  // listed when the pair first appeared, merged away since
      delta.clear();
      for (size_t i = 0; i + 1 < s.size(); ++i) delta.emplace_back(key(s[i], s[i + 1]), -n);
      std::vector<int32_t> out;
      out.reserve(s.size());
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == left && s[i + 1] == right) {
          out.push_back(merged);
          i += 2;
        } else {
          out.push_back(s[i++]);
        }
      }
      s = std::move(out);
      for (size_t i = 0; i + 1 < s.size(); ++i) delta.emplace_back(key(s[i], s[i + 1]), n);
      // Only pairs whose count changed are touched, so untouched neighbours cost nothing.
      std::sort(delta.begin(), delta.end());
      for (size_t i = 0; i < delta.size();) {
        size_t j = i;
        int64_t sum = 0;
        for (; j < delta.size() && delta[j].first == delta[i].first; ++j) sum += delta[j].second;
        if (sum != 0) adjust(delta[i].first, sum, wi);
        i = j;
      }
    }
    pair_count.erase(k);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (uint64_t pk : touched) {
      auto pc = pair_count.find(pk);
      if (pc == pair_count.end()) continue;
      if (pc->second <= 0) pair_count.erase(pc);
      else heap.emplace(pc->second, pk);
    }
  }

  std::string tmp = output_path + ".tmp." + std::to_string(::getpid());
  {
    auto parent = std::filesystem::path(output_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write tokenizer file ", quote(tmp));
    for (size_t id = 0; id < token_bytes.size(); ++id) out << base64_encode(token_bytes[id]) << ' ' << id << '\n';
    out.close();
    if (!out) {
      const int error = errno;
      std::filesystem::remove(tmp);
      fail("cannot write tokenizer file ", quote(output_path), describe_write_error(error));
    }
  }
  std::filesystem::rename(tmp, output_path);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

BpeTrainerStats train_bpe_files(const std::vector<std::string>& inputs, const BpeTrainerOptions& options,
                                const std::string& output_path) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const auto& input : inputs) {
    fs::path p(input);
    if (fs::is_regular_file(p)) {
      files.push_back(p);
    } else if (fs::is_directory(p)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file()) found.push_back(e.path());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      fail("tokenizer training input ", quote(input), " does not exist");
    }
  }
  return train_bpe(
      [&](const std::function<void(std::string_view)>& emit) {
        for (const auto& f : files) {
          std::ifstream in(f, std::ios::binary);
          std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
          if (text.find('\0') != std::string::npos) continue;  // binary file
          emit(text);
        }
      },
      options, output_path);
}

}  // namespace titan::tokenizer
