// Data sources: resolving [[training.datasets]] / training.dataset_path into shard files with a format, and
// reading one shard's rows (documents) sequentially with a resumable position.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "titan/config/job_config.h"

namespace titan::data {

// Text: a whole file is one document; Lines: each non-blank line (how Hugging Face datasets' text loader, and so
// torchtitan, reads a .txt path); Paragraphs: each run of non-blank lines.
enum class Format { Text, Jsonl, Fortune, Tokens, Parquet, Arrow, Lines, Paragraphs };
const char* format_name(Format f);

struct Shard {
  std::string path;
  Format format = Format::Text;
};

struct SourceSpec {
  std::string name;
  std::vector<Shard> shards;  // sorted by path: the unshuffled order
  double weight = 1.0;
  std::string text_field = "text";
  bool loop = true;
};

// The built-in corpus: Debian's `fortunes` package, already on the machine after scripts/setup.sh.
extern const char* const kBuiltinCorpusDir;

// One source from a [[training.datasets]] table. `path` may be a file, a directory (searched recursively for files
// of known formats) or a glob. `where` names the config entry in errors.
SourceSpec resolve_source(const config::DatasetSource& source, const std::string& where);
// The command-line inputs of `titan data tokenize` and `titan tokenizer train` (files, directories, globs) read as
// training reads them, each one source; token shards are refused, as they hold no text.
std::vector<SourceSpec> resolve_text_inputs(const std::vector<std::string>& inputs, const std::string& format,
                                            const std::string& text_field);
// The mixture a training (or validation) config asks for: training.datasets when set, else one source from
// dataset / dataset_path with dataset_format and text_field.
std::vector<SourceSpec> resolve_sources(const config::Training& training);
std::vector<SourceSpec> resolve_sources(const std::string& dataset, const std::optional<std::string>& dataset_path,
                                        const std::string& format, const std::string& text_field,
                                        const std::string& where);

// A row as stored: the text, a JSON line still to parse, or tokens; with where it came from.
struct RawRow {
  std::string bytes;
  std::vector<int32_t> tokens;
  uint32_t shard = 0;      // index into SourceSpec::shards
  uint64_t row = 0;        // row index within the shard
  uint64_t line = 0;       // 1-based line of the row's start (text formats)
  uint64_t offset = 0;     // uncompressed byte offset of the row's start
  bool null_text = false;  // Parquet: the text column is null in this row
};

// Where the next row of a shard starts; recorded in dataloader state so resuming needs no re-scan of plain files.
struct ShardPosition {
  uint64_t row = 0, offset = 0, line = 0;
};

class ShardRowReader {
 public:
  // text_field: the column read from Parquet files.
  ShardRowReader(const Shard& shard, uint32_t shard_index, const std::string& text_field = "text");
  ~ShardRowReader();
  bool next(RawRow& row);
  ShardPosition position() const { return position_; }
  void seek(const ShardPosition& position);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Shard shard_;
  uint32_t shard_index_;
  ShardPosition position_;
};

// The text of a row: the JSON field for JSONL rows, the bytes otherwise. Throws UserError naming the file, line
// and byte offset for a malformed line or a missing / non-string field.
std::string row_text(const RawRow& row, const SourceSpec& source);

}  // namespace titan::data
