// Tokenizer files that transformers' AutoTokenizer loads, for Hugging Face exports: a tokenizer.json built from
// tiktoken-format ranks (byte-level BPE with merges recovered from the ranks, the split pattern, special tokens
// and a BOS template), and tokenizer_config.json naming BOS and EOS.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace titan::tokenizer {

// `id_to_bytes[id]` is each regular token's bytes (empty for unused ids), `rank_of` the id of a byte string if it
// is a token; `specials` maps ids to names; `bos` is prepended by the template when given.
nlohmann::json tiktoken_to_hf_json(const std::vector<std::string>& id_to_bytes,
                                   const std::function<std::optional<int32_t>(std::string_view)>& rank_of,
                                   const std::string& pattern, const std::map<int32_t, std::string>& specials,
                                   std::optional<int32_t> bos);

// tokenizer_config.json for a fast tokenizer (or `tokenizer_class`), BOS/EOS by name where known.
void write_tokenizer_config(const std::string& directory, std::optional<std::string> bos, std::optional<std::string> eos,
                            const std::string& tokenizer_class = "PreTrainedTokenizerFast");

}  // namespace titan::tokenizer
