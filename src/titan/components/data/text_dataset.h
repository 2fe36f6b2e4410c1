// The minimal text pipeline: documents from .txt / .jsonl files (or the built-in corpus), each encoded as
// BOS + tokens + EOS, concatenated and cut into seq_len + 1 windows (inputs and labels shifted by one), looping
// over the data when it runs out.
#pragma once
#include <ATen/ATen.h>

#include <deque>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "titan/components/tokenizer/tokenizer.h"

namespace titan::data {

// Where the documents come from, resolved from training.dataset and training.dataset_path.
struct DatasetSpec {
  std::string name;                // for logs
  std::vector<std::string> files;  // sorted
  enum class Format { Text, Jsonl, Fortune } format_hint = Format::Text;  // Fortune: "%"-separated documents
  std::string text_field = "text";
};

// The built-in corpus: Debian's `fortunes` package, already on the machine after scripts/setup.sh.
extern const char* const kBuiltinCorpusDir;

// Resolves a dataset name and optional path. Throws UserError when the path is missing, holds no .txt/.jsonl
// files, or the name is one titan.cpp does not ship (c4, c4_test) and no path is given.
DatasetSpec resolve_dataset(const std::string& name, const std::optional<std::string>& path);

// Streams documents from the spec's files in order, one file open at a time.
class DocumentReader {
 public:
  explicit DocumentReader(DatasetSpec spec);
  // Next document; false at the end of the data (call rewind() to start over).
  bool next(std::string& document);
  void rewind();
  const DatasetSpec& spec() const { return spec_; }

 private:
  bool open_next_file();
  DatasetSpec spec_;
  size_t file_index_ = 0;
  std::ifstream current_;
  DatasetSpec::Format current_format_ = DatasetSpec::Format::Text;
  size_t line_no_ = 0;
  bool file_open_ = false;
};

struct Batch {
  at::Tensor inputs;  // int64 (batch, seq_len)
  at::Tensor labels;  // int64 (batch, seq_len)
};

class TextDataLoader {
 public:
  // dp_rank / dp_degree: all ranks pack the same global stream of windows; of each group of dp_degree x batch_size
  // consecutive windows, rank r takes windows [r x batch_size, (r + 1) x batch_size). The union over ranks is the
  // single-process stream, whatever the number of ranks.
  TextDataLoader(DatasetSpec spec, const tokenizer::Tokenizer& tokenizer, int64_t seq_len, int64_t batch_size,
                 int64_t dp_rank = 0, int64_t dp_degree = 1);
  Batch next();
  int64_t epoch() const { return epoch_; }

 private:
  std::vector<int32_t> next_window();
  DocumentReader reader_;
  const tokenizer::Tokenizer& tokenizer_;
  int64_t seq_len_, batch_size_, dp_rank_, dp_degree_;
  int64_t epoch_ = 0;
  int64_t documents_this_epoch_ = 0, tokens_this_epoch_ = 0;
  std::deque<int32_t> buffer_;
};

}  // namespace titan::data
