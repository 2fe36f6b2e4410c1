#include "titan/components/tokenizer/hf_export.h"

#include <filesystem>

#include "titan/common/files.h"
#include "titan/components/tokenizer/byte_level.h"

namespace titan::tokenizer {

using json = nlohmann::json;

namespace {

// The two tokens a token of rank `rank` is merged from: its bytes merged by the lower ranks alone, as tiktoken's
// BPE would, must end in exactly two parts (a token no merge reaches has none).
std::optional<std::pair<std::string, std::string>> merge_of(const std::string& bytes, int32_t rank,
                                                            const std::function<std::optional<int32_t>(std::string_view)>& rank_of) {
  std::vector<std::string> parts;
  for (char c : bytes) parts.emplace_back(1, c);
  while (parts.size() > 2) {
    size_t best = parts.size();
    int32_t best_rank = rank;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto r = rank_of(parts[i] + parts[i + 1]);
      if (r && *r < best_rank) best = i, best_rank = *r;
    }
    if (best == parts.size()) return std::nullopt;
    parts[best] += parts[best + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  if (parts.size() != 2) return std::nullopt;
  return std::pair{parts[0], parts[1]};
}

}  // namespace

json tiktoken_to_hf_json(const std::vector<std::string>& id_to_bytes,
                         const std::function<std::optional<int32_t>(std::string_view)>& rank_of, const std::string& pattern,
                         const std::map<int32_t, std::string>& specials, std::optional<int32_t> bos) {
  json vocab = json::object();
  std::vector<std::pair<int32_t, json>> merges;
  for (size_t id = 0; id < id_to_bytes.size(); ++id) {
    const std::string& bytes = id_to_bytes[id];
    if (bytes.empty()) continue;
    vocab[bytes_to_chars(bytes)] = id;
    if (bytes.size() < 2) continue;
    if (auto pair = merge_of(bytes, static_cast<int32_t>(id), rank_of))
      merges.emplace_back(static_cast<int32_t>(id), json::array({bytes_to_chars(pair->first), bytes_to_chars(pair->second)}));
  }
  std::sort(merges.begin(), merges.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  json merge_list = json::array();
  for (auto& [rank, pair] : merges) merge_list.push_back(std::move(pair));

  json added = json::array();
  for (const auto& [id, name] : specials)
    added.push_back({{"id", id}, {"content", name}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  json post_processor = nullptr;
  if (bos && specials.count(*bos)) {
    const std::string& name = specials.at(*bos);
    json special = {{"SpecialToken", {{"id", name}, {"type_id", 0}}}};
    post_processor = {{"type", "TemplateProcessing"},
                      {"single", json::array({special, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                      {"pair", json::array({special, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, special,
                                            {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
                      {"special_tokens", {{name, {{"id", name}, {"ids", {*bos}}, {"tokens", {name}}}}}}};
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             json::array({{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}}},
          {"post_processor", post_processor},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", true},  // a piece that is a token is that token, as in tiktoken
            {"vocab", vocab},
            {"merges", merge_list}}}};
}

void write_tokenizer_config(const std::string& directory, std::optional<std::string> bos, std::optional<std::string> eos,
                            const std::string& tokenizer_class) {
  json config = {{"tokenizer_class", tokenizer_class},
                 {"clean_up_tokenization_spaces", false},
                 {"model_input_names", {"input_ids", "attention_mask"}}};
  config["bos_token"] = bos ? json(*bos) : json(nullptr);
  config["eos_token"] = eos ? json(*eos) : json(nullptr);
  write_file((std::filesystem::path(directory) / "tokenizer_config.json").string(), config.dump(2) + "\n");
}

}  // namespace titan::tokenizer
