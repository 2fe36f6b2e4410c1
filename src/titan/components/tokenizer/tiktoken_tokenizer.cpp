// tiktoken-format BPE (Llama 3's tokenizer.model, cl100k_base.tiktoken): ranks of byte strings, Llama 3 regex.
#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/common/files.h"
#include "titan/components/tokenizer/bpe_merge.h"
#include "titan/components/tokenizer/hf_export.h"
#include "titan/components/tokenizer/regex_splitter.h"
#include "titan/components/tokenizer/string_map.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/components/tokenizer/utf8.h"

namespace titan::tokenizer {
namespace {

using RankMap = StringMap<int32_t>;

std::optional<std::string> base64_decode(std::string_view in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  uint32_t buffer = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < in.size() && in[i] != '='; ++i) {
    int v = value(in[i]);
    if (v < 0) return std::nullopt;
    buffer = (buffer << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((buffer >> bits) & 0xFF));
    }
  }
  for (; i < in.size(); ++i)
    if (in[i] != '=') return std::nullopt;
  return out;
}

class TiktokenTokenizer : public Tokenizer {
 public:
  TiktokenTokenizer(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot open tokenizer file ", quote(path));
    std::string line;
    size_t line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      auto space = line.find(' ');
      if (space == std::string::npos)
        fail(path, ":", line_no, ": expected \"<base64 token> <rank>\" (tiktoken format), got ", quote(line.substr(0, 60)));
      auto bytes = base64_decode(std::string_view(line).substr(0, space));
      char* end = nullptr;
      errno = 0;
      long rank = std::strtol(line.c_str() + space + 1, &end, 10);
      if (!bytes || *end != '\0' || rank < 0 || errno == ERANGE || rank >= (1L << 26))
        fail(path, ":", line_no, ": expected \"<base64 token> <rank>\" (tiktoken format), got ", quote(line.substr(0, 60)));
      if (bytes->empty()) fail(path, ":", line_no, ": a token must have at least one byte");
      if (!ranks_.emplace(*bytes, static_cast<int32_t>(rank)).second)
        fail(path, ":", line_no, ": token listed twice");
      if (static_cast<size_t>(rank) >= id_to_bytes_.size()) id_to_bytes_.resize(static_cast<size_t>(rank) + 1);
      if (!id_to_bytes_[static_cast<size_t>(rank)].empty())
        fail(path, ":", line_no, ": rank ", rank, " is given to a second token (ids must be unique)");
      id_to_bytes_[static_cast<size_t>(rank)] = *bytes;
    }
    if (ranks_.empty()) fail(path, ": no tokens found (expected tiktoken \"<base64 token> <rank>\" lines)");
    for (int b = 0; b < 256; ++b) {
      auto it = ranks_.find(std::string(1, static_cast<char>(b)));
      if (it == ranks_.end()) fail(path, ": byte 0x", std::hex, b, " has no token; a byte-level BPE file needs all 256");
      byte_rank_[b] = it->second;
    }
    num_base_ = static_cast<int32_t>(id_to_bytes_.size());

    std::string pattern = kLlama3Pattern;
    std::filesystem::path p(path);
    std::filesystem::path meta = p.parent_path() / (p.stem().string() + ".meta.json");
    if (std::filesystem::exists(meta)) {
      nlohmann::json j;
      meta_ = meta.string();
      try {
        std::ifstream m(meta);
        j = nlohmann::json::parse(m);
        pattern = j.at("pat_str").get<std::string>();
        for (auto& [name, id] : j.at("special_tokens").items()) add_special(name, id.get<int32_t>());
      } catch (const nlohmann::json::exception& e) {
        fail(meta.string(), ": expected {\"pat_str\": ..., \"special_tokens\": {name: id}}: ", e.what());
      }
    } else {
      auto names = llama3_special_tokens();
      for (size_t i = 0; i < names.size(); ++i) add_special(names[i], num_base_ + static_cast<int32_t>(i));
    }
    pattern_ = pattern;
    splitter_ = std::make_unique<RegexSplitter>(pattern, meta_.empty() ? path : meta_);
    for (const char* name : {"<|begin_of_text|>"})
      if (auto it = special_.find(name); it != special_.end()) bos_id_ = it->second;
    for (const char* name : {"<|end_of_text|>", "<|endoftext|>"})
      if (auto it = special_.find(name); it != special_.end() && !eos_id_) eos_id_ = it->second;
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 1);
    splitter_->split(text, [&](std::string_view piece, bool) { encode_piece(piece, ids); });
    return ids;
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special) const override {
    std::string bytes;
    for (int32_t id : ids) {
      if (id >= 0 && id < num_base_ && !id_to_bytes_[static_cast<size_t>(id)].empty()) {
        bytes += id_to_bytes_[static_cast<size_t>(id)];
      } else if (auto it = special_names_.find(id); it != special_names_.end()) {
        if (!skip_special) bytes += it->second;
      } else {
        fail("token id ", id, " is outside the vocabulary of ", path_, " (", vocab_size(), " ids)");
      }
    }
    return utf8_lossy(bytes);
  }

  int64_t vocab_size() const override {
    int64_t n = num_base_;
    for (const auto& [id, name] : special_names_) n = std::max<int64_t>(n, id + 1);
    return n;
  }

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    if (auto it = special_.find(std::string(token)); it != special_.end()) return it->second;
    if (auto it = ranks_.find(token); it != ranks_.end()) return it->second;
    return std::nullopt;
  }

  std::string source_path() const override { return path_; }

  void save_hf_files(const std::string& directory) const override {
    auto rank_of = [&](std::string_view bytes) -> std::optional<int32_t> {
      auto it = ranks_.find(bytes);
      if (it == ranks_.end()) return std::nullopt;
      return it->second;
    };
    const auto j = tiktoken_to_hf_json(id_to_bytes_, rank_of, pattern_, special_names_, bos_id_);
    write_file((std::filesystem::path(directory) / "tokenizer.json").string(), j.dump() + "\n");
    auto name = [&](std::optional<int32_t> id) -> std::optional<std::string> {
      if (!id || !special_names_.count(*id)) return std::nullopt;
      return special_names_.at(*id);
    };
    write_tokenizer_config(directory, name(bos_id_), name(eos_id_));
  }

  std::string description() const override {
    return cat("tiktoken BPE ", path_, " (", num_base_, " ranks + ", special_.size(), " special tokens",
               meta_.empty() ? ", Llama 3 layout" : ", specials from " + meta_, ")");
  }

 private:
  void add_special(const std::string& name, int32_t id) {
    if (id < 0 || (id < num_base_ && !id_to_bytes_[static_cast<size_t>(id)].empty()))
      fail(meta_.empty() ? path_ : meta_, ": special token ", quote(name), " has id ", id,
           id < 0 ? ", which is negative" : ", which a regular token already has (ids must be unique)");
    if (special_names_.count(id)) fail(meta_.empty() ? path_ : meta_, ": special tokens ", quote(special_names_[id]),
                                       " and ", quote(name), " have the same id ", id);
    special_[name] = id;
    special_names_[id] = name;
  }

  void encode_piece(std::string_view piece, std::vector<int32_t>& ids) const {
    if (auto it = ranks_.find(piece); it != ranks_.end()) {
      ids.push_back(it->second);
      return;
    }
    std::vector<std::pair<uint32_t, int32_t>> starts;
    starts.reserve(piece.size());
    for (uint32_t i = 0; i < piece.size(); ++i) starts.emplace_back(i, byte_rank_[static_cast<unsigned char>(piece[i])]);
    auto symbols = make_symbols(starts, static_cast<uint32_t>(piece.size()));
    bpe_merge(symbols, [&](const Symbol& l, const Symbol& r) -> std::pair<int32_t, int32_t> {
      auto it = ranks_.find(piece.substr(l.start, l.len + r.len));
      if (it == ranks_.end()) return {-1, -1};
      return {it->second, it->second};
    });
    for_each_symbol(symbols, [&](const Symbol& s) { ids.push_back(s.id); });
  }

  std::string path_, meta_, pattern_;
  RankMap ranks_;
  std::vector<std::string> id_to_bytes_;
  std::array<int32_t, 256> byte_rank_{};
  int32_t num_base_ = 0;
  std::map<std::string, int32_t> special_;
  std::map<int32_t, std::string> special_names_;
  std::unique_ptr<RegexSplitter> splitter_;
};

}  // namespace

std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> names = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                                    "<|python_tag|>"};
  for (int i = 2; names.size() < 256; ++i) names.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  return names;
}

std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path) { return std::make_unique<TiktokenTokenizer>(path); }

}  // namespace titan::tokenizer
