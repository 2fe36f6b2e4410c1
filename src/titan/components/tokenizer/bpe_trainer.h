// Learning a byte-level BPE vocabulary from text (Llama 3 pre-tokenizer), written as a tiktoken-format file that
// load() reads back with Llama 3's 256 special tokens after the learned ranks.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace titan::tokenizer {

struct BpeTrainerOptions {
  int64_t vocab_size = 2048;  // total ids, including the 256 special tokens
  int64_t min_pair_count = 2;  // stop when the best pair occurs less often
};

struct BpeTrainerStats {
  int64_t merges = 0;
  int64_t bytes = 0;
  int64_t unique_words = 0;
  double seconds = 0;
};

// Learns merges from the documents `for_each_document` yields and writes the ranks file to `output_path`
// (written to a temporary file, then renamed, so a crash never leaves a partial tokenizer).
BpeTrainerStats train_bpe(const std::function<void(const std::function<void(std::string_view)>&)>& for_each_document,
                          const BpeTrainerOptions& options, const std::string& output_path);

// Files or directories (recursively, sorted); each file is one document.
BpeTrainerStats train_bpe_files(const std::vector<std::string>& inputs, const BpeTrainerOptions& options,
                                const std::string& output_path);

}  // namespace titan::tokenizer
