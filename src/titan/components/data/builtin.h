// The built-in tokenizer: a byte-level BPE learned from the built-in corpus on first use and cached in the dump
// folder, so the default job needs no download.
#pragma once
#include <string>

namespace titan::data {

// Value of model.hf_assets_path that selects the built-in tokenizer.
extern const char* const kBuiltinTokenizer;

// Path of the built-in tokenizer file for `vocab_size` ids under `dump_folder`, training it when absent.
std::string ensure_builtin_tokenizer(const std::string& dump_folder, int64_t vocab_size);

}  // namespace titan::data
