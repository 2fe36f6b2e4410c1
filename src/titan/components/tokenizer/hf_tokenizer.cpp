// HF tokenizers' tokenizer.json with a BPE model (Llama 3's, torchtitan's test tokenizer), plus the special
// tokens torchtitan adds from a sibling tokenizer_config.json.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/strings.h"
#include "titan/components/tokenizer/bpe_merge.h"
#include "titan/components/tokenizer/byte_level.h"
#include "titan/components/tokenizer/regex_splitter.h"
#include "titan/components/tokenizer/string_map.h"
#include "titan/components/tokenizer/hf_export.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/components/tokenizer/unicode_normalize.h"
#include "titan/components/tokenizer/utf8.h"

namespace titan::tokenizer {
namespace {

using json = nlohmann::json;

using VocabMap = StringMap<int32_t>;

struct AddedToken {
  std::string content;
  int32_t id;
  bool special = true, lstrip = false, rstrip = false, single_word = false;
};

struct PreStep {
  enum class Kind { ByteLevel, Split, Metaspace } kind = Kind::Split;
  bool add_prefix_space = false;
  std::unique_ptr<RegexSplitter> regex;  // null: no splitting
  bool remove_matches = false;           // Split behavior "Removed"
  std::string replacement;               // Metaspace: the character spaces become (U+2581)
  std::string prepend_scheme = "always"; // Metaspace: always | first | never
  bool split = true;                     // Metaspace: split before each replacement character
};

// Normalizers and decoders of SentencePiece-style tokenizer.json files (Llama 2, Mistral, ...).
struct NormStep {
  enum class Kind { Prepend, Replace, Unicode, Lowercase } kind;
  std::string a, b;  // Prepend: a; Replace: a -> b
  UnicodeForm form = UnicodeForm::NFC;  // Unicode
};
struct DecodeStep {
  enum class Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind;
  std::string a, b;
  int64_t start = 0, stop = 0;
  bool strip_first = true;  // Metaspace: drop the space the prepend scheme added
};

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size())) s.replace(pos, from.size(), to);
  return s;
}

bool is_space_char(std::string_view s, size_t pos, size_t& len) {
  unsigned char c = static_cast<unsigned char>(s[pos]);
  if (c == ' ' || (c >= '\t' && c <= '\r')) return len = 1, true;
  return false;
}

class HfTokenizer : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& path) : path_(path) {
    json root;
    {
      std::ifstream in(path);
      if (!in) fail("cannot open tokenizer file ", quote(path));
      try {
        root = json::parse(in);
      } catch (const json::exception& e) {  // parse errors and numbers out of range
        fail(path, ": not valid JSON (", e.what(), "); expected a Hugging Face tokenizer.json");
      }
    }
    try {
      load_model(root.at("model"));
      load_normalizer(root.value("normalizer", json()));
      load_pre_tokenizer(root.value("pre_tokenizer", json()));
      load_decoder(root.value("decoder", json()));
      for (const auto& t : root.value("added_tokens", json::array())) {
        if (!t.at("id").is_number_integer() || t["id"].get<int64_t>() < 0 || t["id"].get<int64_t>() > (int64_t{1} << 30))
          fail(path_, ": added token ", t.value("content", "?"), " has an invalid id ", t["id"].dump());
        AddedToken a{t.at("content").get<std::string>(), t.at("id").get<int32_t>(), t.value("special", false),
                     t.value("lstrip", false), t.value("rstrip", false), t.value("single_word", false)};
        if (auto other = added_by_id_.find(a.id); other != added_by_id_.end() && other->second.content != a.content)
          fail(path_, ": added tokens ", quote(other->second.content), " and ", quote(a.content), " have the same id ",
               a.id, " (ids must be unique)");
        register_added(a);
      }
      load_post_processor(root.value("post_processor", json()));
    } catch (const json::exception& e) {
      fail(path, ": unexpected tokenizer.json structure: ", e.what());
    }
    auto config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
    if (std::filesystem::exists(config_path)) apply_tokenizer_config(config_path.string());
    else infer_bos_eos_by_name();
    if (bos_id_) encode_adds_bos_ = std::find(prefix_.begin(), prefix_.end(), *bos_id_) != prefix_.end();
    if (eos_id_) encode_adds_eos_ = std::find(suffix_.begin(), suffix_.end(), *eos_id_) != suffix_.end();
    for (const auto& a : added_)
      if (!a.content.empty()) added_by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(&a);
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(prefix_.begin(), prefix_.end());
    size_t pos = 0, plain_start = 0;
    while (pos < text.size()) {
      size_t match_begin, match_end;
      const AddedToken* added = match_added(text, pos, plain_start, match_begin, match_end);
      if (!added) {
        ++pos;
        continue;
      }
      encode_plain(text.substr(plain_start, match_begin - plain_start), plain_start == 0, ids);
      ids.push_back(added->id);
      pos = plain_start = match_end;
    }
    encode_plain(text.substr(plain_start), plain_start == 0, ids);
    ids.insert(ids.end(), suffix_.begin(), suffix_.end());
    return ids;
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special) const override {
    std::vector<std::string> tokens;
    for (int32_t id : ids) {
      auto added = added_by_id_.find(id);
      if (added != added_by_id_.end() && added->second.special && skip_special) continue;
      const std::string* token = nullptr;
      if (added != added_by_id_.end()) token = &added->second.content;
      else if (id >= 0 && static_cast<size_t>(id) < id_to_token_.size() && !id_to_token_[id].empty()) token = &id_to_token_[id];
      if (!token) fail("token id ", id, " is outside the vocabulary of ", path_, " (", vocab_size(), " ids)");
      tokens.push_back(*token);
    }
    if (decoders_.empty()) {
      // No decoder: tokens are joined as they are, byte-fallback tokens becoming their byte.
      std::string bytes;
      for (const auto& t : tokens) bytes += byte_fallback_ && fallback_byte(t) ? std::string(1, static_cast<char>(*fallback_byte(t))) : t;
      return utf8_lossy(bytes);
    }
    for (const auto& step : decoders_) tokens = apply_decoder(step, std::move(tokens));
    std::string out;
    for (const auto& t : tokens) out += t;
    return utf8_lossy(out);
  }

  int64_t vocab_size() const override {
    int64_t n = static_cast<int64_t>(id_to_token_.size());
    for (const auto& [id, a] : added_by_id_) n = std::max<int64_t>(n, id + 1);
    return n;
  }

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    for (const auto& a : added_)
      if (a.content == token) return a.id;
    if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }

  std::string source_path() const override { return path_; }

  // The tokenizer.json as loaded, with its tokenizer_config.json (and special_tokens_map.json) when it has one.
  void save_hf_files(const std::string& directory) const override {
    namespace fs = std::filesystem;
    const fs::path source = fs::path(path_).parent_path();
    copy_file_as_own(path_, (fs::path(directory) / "tokenizer.json").string());
    if (fs::exists(source / "tokenizer_config.json")) {
      for (const char* name : {"tokenizer_config.json", "special_tokens_map.json"})
        if (fs::exists(source / name)) copy_file_as_own((source / name).string(), (fs::path(directory) / name).string());
      return;
    }
    auto name = [&](std::optional<int32_t> id) -> std::optional<std::string> {
      if (!id) return std::nullopt;
      if (auto it = added_by_id_.find(*id); it != added_by_id_.end()) return it->second.content;
      return std::nullopt;
    };
    write_tokenizer_config(directory, name(bos_id_), name(eos_id_));
  }

  std::string description() const override {
    return cat("HF BPE tokenizer ", path_, " (", vocab_.size(), " tokens, ", merges_.size(), " merges, ", added_.size(),
               " added tokens", byte_level_ ? ", byte-level" : "", ")");
  }

 private:
  static std::optional<unsigned char> fallback_byte(const std::string& t) {
    if (t.size() == 6 && starts_with(t, "<0x") && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
        std::isxdigit(static_cast<unsigned char>(t[4])))
      return static_cast<unsigned char>(std::stoi(t.substr(3, 2), nullptr, 16));
    return std::nullopt;
  }

  static std::vector<std::string> apply_decoder(const DecodeStep& step, std::vector<std::string> tokens) {
    std::vector<std::string> out;
    switch (step.kind) {
      case DecodeStep::Kind::ByteLevel:
        for (auto& t : tokens) {
          auto raw = chars_to_bytes(t);
          out.push_back(raw ? *raw : t);
        }
        return out;
      case DecodeStep::Kind::Replace:
        for (auto& t : tokens) out.push_back(replace_all(t, step.a, step.b));
        return out;
      case DecodeStep::Kind::ByteFallback: {
        // Runs of <0xXX> tokens become their bytes when those are valid UTF-8, else one U+FFFD per byte.
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (!run_tokens) return;
          if (utf8_lossy(run) == run) out.push_back(run);
          else
            for (size_t i = 0; i < run_tokens; ++i) out.push_back("\xEF\xBF\xBD");
          run.clear();
          run_tokens = 0;
        };
        for (auto& t : tokens) {
          if (auto b = fallback_byte(t)) {
            run.push_back(static_cast<char>(*b));
            ++run_tokens;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        return out;
      }
      case DecodeStep::Kind::Fuse: {
        std::string all;
        for (auto& t : tokens) all += t;
        return {all};
      }
      case DecodeStep::Kind::Strip:
        for (auto& t : tokens) {
          size_t begin = 0, end = t.size();
          for (int64_t i = 0; i < step.start && begin < end && t.compare(begin, step.a.size(), step.a) == 0; ++i) begin += step.a.size();
          for (int64_t i = 0; i < step.stop && end >= begin + step.a.size() && t.compare(end - step.a.size(), step.a.size(), step.a) == 0; ++i)
            end -= step.a.size();
          out.push_back(t.substr(begin, end - begin));
        }
        return out;
      case DecodeStep::Kind::Metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string t = replace_all(tokens[i], step.a, " ");
          if (i == 0 && step.strip_first && starts_with(t, " ")) t.erase(0, 1);
          out.push_back(std::move(t));
        }
        return out;
    }
    return tokens;
  }

  std::string pattern_string(const json& pattern, const char* what) const {
    if (pattern.contains("String")) return pattern["String"].get<std::string>();
    fail(path_, ": ", what, " with a regex pattern is not supported yet (string patterns are)");
  }

  void load_normalizer(const json& norm) {
    if (norm.is_null()) return;
    std::string type = norm.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& n : norm.at("normalizers")) load_normalizer(n);
    } else if (type == "Prepend") {
      normalizers_.push_back({NormStep::Kind::Prepend, norm.at("prepend").get<std::string>(), ""});
    } else if (type == "Replace") {
      normalizers_.push_back({NormStep::Kind::Replace, pattern_string(norm.at("pattern"), "Replace normalizer"),
                              norm.at("content").get<std::string>()});
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD" || type == "Lowercase") {
      if (!unicode_normalization_available())
        fail(path_, ": normalizer ", quote(type), " needs ICU, which this build of titan.cpp was configured without "
             "(Debian: libicu-dev; then configure again)");
      NormStep step{type == "Lowercase" ? NormStep::Kind::Lowercase : NormStep::Kind::Unicode, "", ""};
      if (type == "NFD") step.form = UnicodeForm::NFD;
      if (type == "NFKC") step.form = UnicodeForm::NFKC;
      if (type == "NFKD") step.form = UnicodeForm::NFKD;
      normalizers_.push_back(step);
    } else {
      fail(path_, ": normalizer ", quote(type), " is not supported yet (Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Sequence)");
    }
  }

  void load_model(const json& model) {
    std::string type = model.value("type", "BPE");
    if (type != "BPE") fail(path_, ": model type ", quote(type), " is not supported yet (only BPE)");
    if (!model.value("continuing_subword_prefix", json()).is_null() || !model.value("end_of_word_suffix", json()).is_null())
      fail(path_, ": BPE continuing_subword_prefix / end_of_word_suffix are not supported yet");
    if (!model.value("dropout", json()).is_null() && model["dropout"].get<double>() > 0)
      fail(path_, ": BPE dropout is a training-time augmentation and is not supported");
    ignore_merges_ = model.value("ignore_merges", false);
    byte_fallback_ = model.value("byte_fallback", false);
    fuse_unk_ = model.value("fuse_unk", false);
    const auto& vocab = model.at("vocab");
    // Ids index a table, so they must be non-negative and not absurdly sparse.
    const int64_t id_limit = std::max<int64_t>(1 << 20, 4 * static_cast<int64_t>(vocab.size()));
    for (const auto& [token, id] : vocab.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= id_limit)
        fail(path_, ": vocabulary entry ", quote(token), " has id ", id.dump(), "; expected an integer in [0, ", id_limit, ")");
      int32_t i = id.get<int32_t>();
      vocab_[token] = i;
      if (static_cast<size_t>(i) >= id_to_token_.size()) id_to_token_.resize(static_cast<size_t>(i) + 1);
      if (!id_to_token_[i].empty())
        fail(path_, ": vocabulary entries ", quote(id_to_token_[i]), " and ", quote(token), " have the same id ", i,
             " (ids must be unique)");
      id_to_token_[i] = token;
    }
    if (auto unk = model.value("unk_token", json()); !unk.is_null()) {
      auto it = vocab_.find(unk.get<std::string>());
      if (it == vocab_.end()) fail(path_, ": unk_token ", quote(unk.get<std::string>()), " is not in the vocabulary");
      unk_id_ = it->second;
    }
    int32_t rank = 0;
    for (const auto& m : model.at("merges")) {
      std::string left, right;
      if (m.is_string()) {
        auto s = m.get<std::string>();
        auto space = s.find(' ');
        if (space == std::string::npos) fail(path_, ": merge ", quote(s), " is not \"left right\"");
        left = s.substr(0, space), right = s.substr(space + 1);
      } else {
        left = m.at(0).get<std::string>(), right = m.at(1).get<std::string>();
      }
      auto l = vocab_.find(left), r = vocab_.find(right), merged = vocab_.find(left + right);
      if (l == vocab_.end() || r == vocab_.end() || merged == vocab_.end())
        fail(path_, ": merge ", quote(left + " " + right), " (rank ", rank, ") uses a token missing from the vocabulary");
      merges_.emplace(pair_key(l->second, r->second), std::make_pair(rank, merged->second));
      ++rank;
    }
  }

  void load_pre_tokenizer(const json& pre) {
    if (pre.is_null()) return;
    std::string type = pre.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& p : pre.at("pretokenizers")) load_pre_tokenizer(p);
    } else if (type == "ByteLevel") {
      PreStep step;
      step.kind = PreStep::Kind::ByteLevel;
      step.add_prefix_space = pre.value("add_prefix_space", false);
      if (pre.value("use_regex", true)) step.regex = std::make_unique<RegexSplitter>(kGpt2Pattern, path_);
      byte_level_ = true;
      pre_.push_back(std::move(step));
    } else if (type == "Split") {
      PreStep step;
      step.kind = PreStep::Kind::Split;
      const auto& pattern = pre.at("pattern");
      std::string regex;
      if (pattern.contains("Regex")) {
        regex = pattern["Regex"].get<std::string>();
      } else {
        for (char c : pattern.at("String").get<std::string>()) {
          if (std::strchr("\\^$.|?*+()[]{}", c)) regex.push_back('\\');
          regex.push_back(c);
        }
      }
      if (pre.value("invert", false)) fail(path_, ": Split pre-tokenizer with invert = true is not supported yet");
      std::string behavior = pre.value("behavior", "Isolated");
      if (behavior != "Isolated" && behavior != "Removed")
        fail(path_, ": Split behavior ", quote(behavior), " is not supported yet (Isolated, Removed)");
      step.remove_matches = behavior == "Removed";
      step.regex = std::make_unique<RegexSplitter>(regex, path_);
      pre_.push_back(std::move(step));
    } else if (type == "Metaspace") {
      PreStep step;
      step.kind = PreStep::Kind::Metaspace;
      step.replacement = pre.value("replacement", std::string("\xE2\x96\x81"));
      if (pre.contains("prepend_scheme")) step.prepend_scheme = pre["prepend_scheme"].get<std::string>();
      else if (pre.contains("add_prefix_space")) step.prepend_scheme = pre["add_prefix_space"].get<bool>() ? "always" : "never";
      if (step.prepend_scheme != "always" && step.prepend_scheme != "first" && step.prepend_scheme != "never")
        fail(path_, ": Metaspace prepend_scheme ", quote(step.prepend_scheme), " is not one of always, first, never");
      step.split = pre.value("split", true);
      pre_.push_back(std::move(step));
    } else {
      fail(path_, ": pre_tokenizer ", quote(type), " is not supported yet (ByteLevel, Split, Metaspace, Sequence)");
    }
  }

  void load_decoder(const json& dec) {
    if (dec.is_null()) return;
    std::string type = dec.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& d : dec.at("decoders")) load_decoder(d);
    } else if (type == "ByteLevel") {
      decoders_.push_back({DecodeStep::Kind::ByteLevel, "", ""});
    } else if (type == "ByteFallback") {
      decoders_.push_back({DecodeStep::Kind::ByteFallback, "", ""});
    } else if (type == "Fuse") {
      decoders_.push_back({DecodeStep::Kind::Fuse, "", ""});
    } else if (type == "Replace") {
      decoders_.push_back({DecodeStep::Kind::Replace, pattern_string(dec.at("pattern"), "Replace decoder"),
                           dec.at("content").get<std::string>()});
    } else if (type == "Strip") {
      DecodeStep step{DecodeStep::Kind::Strip, dec.at("content").get<std::string>(), ""};
      step.start = dec.value("start", 0);
      step.stop = dec.value("stop", 0);
      decoders_.push_back(step);
    } else if (type == "Metaspace") {
      DecodeStep step{DecodeStep::Kind::Metaspace, dec.value("replacement", std::string("\xE2\x96\x81")), ""};
      std::string scheme = dec.contains("prepend_scheme") ? dec["prepend_scheme"].get<std::string>()
                                                          : (dec.value("add_prefix_space", true) ? "always" : "never");
      step.strip_first = scheme != "never";
      decoders_.push_back(step);
    } else {
      fail(path_, ": decoder ", quote(type), " is not supported yet (ByteLevel, ByteFallback, Fuse, Replace, Strip, "
           "Metaspace, Sequence)");
    }
  }

  void load_post_processor(const json& post) {
    if (post.is_null()) return;
    std::string type = post.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& p : post.at("processors")) load_post_processor(p);
    } else if (type == "TemplateProcessing") {
      bool after = false;
      for (const auto& item : post.at("single")) {
        if (item.contains("Sequence")) {
          after = true;
          continue;
        }
        std::string name = item.at("SpecialToken").at("id").get<std::string>();
        for (const auto& id : post.at("special_tokens").at(name).at("ids")) (after ? suffix_ : prefix_).push_back(id.get<int32_t>());
      }
    } else if (type != "ByteLevel") {
      fail(path_, ": post_processor ", quote(type), " is not supported yet (TemplateProcessing, ByteLevel)");
    }
  }

  static uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

  void register_added(const AddedToken& a) {
    for (auto& existing : added_)
      if (existing.content == a.content) return;
    added_.push_back(a);
    added_by_id_[a.id] = a;
    std::sort(added_.begin(), added_.end(), [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  }

  // HF's rule for a new special token: reuse an existing id, else the next id after the model and added vocab.
  int32_t add_special_token(const std::string& content) {
    if (auto id = token_to_id(content)) {
      register_added(AddedToken{content, *id});
      return *id;
    }
    int32_t model_size = static_cast<int32_t>(id_to_token_.size());
    int32_t max_added = -1;
    for (const auto& a : added_) max_added = std::max(max_added, a.id);
    int32_t id = max_added >= model_size ? max_added + 1 : model_size;
    register_added(AddedToken{content, id});
    return id;
  }

  void apply_tokenizer_config(const std::string& config_path) {
    json config;
    try {
      std::ifstream in(config_path);
      config = json::parse(in);
    } catch (const json::exception& e) {
      fail(config_path, ": not valid JSON: ", e.what());
    }
    auto token_name = [&](const char* key) -> std::optional<std::string> {
      if (!config.contains(key) || config[key].is_null()) return std::nullopt;
      const auto& v = config[key];
      if (v.is_string()) return v.get<std::string>();
      if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
      fail(config_path, ": ", key, " must be a string or {\"content\": ...}");
    };
    try {
      auto bos = token_name("bos_token"), eos = token_name("eos_token");
      // The same order torchtitan uses: the standard keys, then added_tokens_decoder, all added as special tokens.
      for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"})
        if (auto name = token_name(key)) add_special_token(*name);
      if (config.contains("added_tokens_decoder"))
        for (const auto& [id, entry] : config["added_tokens_decoder"].items())
          if (entry.is_object() && entry.contains("content")) add_special_token(entry["content"].get<std::string>());
      if (bos) bos_id_ = token_to_id(*bos);
      if (eos) eos_id_ = token_to_id(*eos);
    } catch (const json::exception& e) {
      fail(config_path, ": unexpected tokenizer_config.json structure: ", e.what());
    }
  }

  void infer_bos_eos_by_name() {
    for (const char* n : {"<|begin_of_text|>", "<s>", "<|startoftext|>"})
      if (!bos_id_) bos_id_ = token_to_id(n);
    for (const char* n : {"<|end_of_text|>", "</s>", "<|endoftext|>"})
      if (!eos_id_) eos_id_ = token_to_id(n);
  }

  const AddedToken* match_added(std::string_view text, size_t pos, size_t plain_start, size_t& begin, size_t& end) const {
    for (const AddedToken* candidate : added_by_first_byte_[static_cast<unsigned char>(text[pos])]) {  // longest first
      const AddedToken& a = *candidate;
      if (text.compare(pos, a.content.size(), a.content) != 0) continue;
      begin = pos;
      end = pos + a.content.size();
      if (a.single_word) {
        auto word = [&](size_t i) { return std::isalnum(static_cast<unsigned char>(text[i])) || text[i] == '_'; };
        if ((begin > 0 && word(begin - 1)) || (end < text.size() && word(end))) continue;
      }
      size_t len;
      if (a.lstrip)
        while (begin > plain_start && is_space_char(text, begin - 1, len)) --begin;
      if (a.rstrip)
        while (end < text.size() && is_space_char(text, end, len)) ++end;
      return &a;
    }
    return nullptr;
  }

  void encode_plain(std::string_view text, bool first_segment, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    std::string normalized(text);
    for (const auto& n : normalizers_) {
      switch (n.kind) {
        case NormStep::Kind::Prepend: normalized = n.a + normalized; break;
        case NormStep::Kind::Replace: normalized = replace_all(std::move(normalized), n.a, n.b); break;
        case NormStep::Kind::Unicode: normalized = unicode_normalize(normalized, n.form); break;
        case NormStep::Kind::Lowercase: normalized = unicode_lowercase(normalized); break;
      }
    }
    std::vector<std::string> pieces{std::move(normalized)};
    for (const auto& step : pre_) {
      std::vector<std::string> next;
      for (auto& piece : pieces) {
        std::string source = piece;
        if (step.kind == PreStep::Kind::Metaspace) {
          // Spaces become the replacement character, which then starts each piece (SentencePiece's layout).
          source = replace_all(std::move(source), " ", step.replacement);
          const bool prepend = step.prepend_scheme == "always" || (step.prepend_scheme == "first" && first_segment);
          if (prepend && !starts_with(source, step.replacement)) source = step.replacement + source;
          if (!step.split) {
            next.push_back(std::move(source));
            continue;
          }
          size_t start = 0;
          for (size_t pos = source.find(step.replacement, 1); pos != std::string::npos; pos = source.find(step.replacement, pos + 1)) {
            next.push_back(source.substr(start, pos - start));
            start = pos;
          }
          next.push_back(source.substr(start));
          continue;
        }
        if (step.kind == PreStep::Kind::ByteLevel && step.add_prefix_space && !starts_with(source, " ")) source = " " + source;
        if (!step.regex) {
          next.push_back(source);
          continue;
        }
        step.regex->split(source, [&](std::string_view part, bool matched) {
          if (!(matched && step.remove_matches)) next.emplace_back(part);
        });
      }
      pieces = std::move(next);
    }
    for (const auto& piece : pieces) encode_word(byte_level_ ? bytes_to_chars(piece) : piece, ids);
  }

  void encode_word(const std::string& word, std::vector<int32_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_)
      if (auto it = vocab_.find(word); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    std::vector<std::pair<uint32_t, int32_t>> starts;
    bool last_unk = false;
    size_t pos = 0;
    while (pos < word.size()) {
      size_t n = std::max<size_t>(1, utf8_sequence_length(word, pos));
      std::string_view ch(word.data() + pos, n);
      if (auto it = vocab_.find(ch); it != vocab_.end()) {
        starts.emplace_back(static_cast<uint32_t>(pos), it->second);
        last_unk = false;
      } else if (byte_fallback_) {
        for (size_t b = 0; b < n; ++b) {
          auto fb = vocab_.find(strprintf("<0x%02X>", static_cast<unsigned char>(word[pos + b])));
          if (fb != vocab_.end()) starts.emplace_back(static_cast<uint32_t>(pos + b), fb->second);
          else if (unk_id_) starts.emplace_back(static_cast<uint32_t>(pos + b), *unk_id_);
        }
      } else if (unk_id_) {
        if (!(fuse_unk_ && last_unk)) starts.emplace_back(static_cast<uint32_t>(pos), *unk_id_);
        last_unk = true;
      }
      pos += n;
    }
    auto symbols = make_symbols(starts, static_cast<uint32_t>(word.size()));
    bpe_merge(symbols, [&](const Symbol& l, const Symbol& r) -> std::pair<int32_t, int32_t> {
      auto it = merges_.find(pair_key(l.id, r.id));
      if (it == merges_.end()) return {-1, -1};
      return it->second;
    });
    for_each_symbol(symbols, [&](const Symbol& s) { ids.push_back(s.id); });
  }

  std::string path_;
  VocabMap vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  std::optional<int32_t> unk_id_;
  std::vector<PreStep> pre_;
  std::vector<NormStep> normalizers_;
  std::vector<DecodeStep> decoders_;
  bool byte_level_ = false;
  std::vector<AddedToken> added_;  // longest content first
  std::array<std::vector<const AddedToken*>, 256> added_by_first_byte_;
  std::map<int32_t, AddedToken> added_by_id_;
  std::vector<int32_t> prefix_, suffix_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_json(const std::string& json_path) { return std::make_unique<HfTokenizer>(json_path); }

}  // namespace titan::tokenizer
