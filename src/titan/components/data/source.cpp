#include "titan/components/data/source.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/data/file_reader.h"
#include "titan/components/data/parquet_reader.h"
#include "titan/components/data/token_shard.h"
#include "titan/components/tokenizer/utf8.h"

namespace titan::data {

namespace fs = std::filesystem;

const char* const kBuiltinCorpusDir = "/usr/share/games/fortunes";

const char* format_name(Format f) {
  switch (f) {
    case Format::Text: return "text";
    case Format::Jsonl: return "jsonl";
    case Format::Fortune: return "fortune";
    case Format::Tokens: return "tokens";
    case Format::Parquet: return "parquet";
    case Format::Arrow: return "arrow";
    case Format::Lines: return "lines";
    case Format::Paragraphs: return "paragraphs";
  }
  return "?";
}

namespace {

// The format a file name implies, or nullopt for files a directory scan skips.
std::optional<Format> format_from_name(const std::string& path) {
  std::string base = to_lower(strip_compression_extension(path));
  auto ends = [&](const char* ext) { return base.size() >= std::strlen(ext) && base.ends_with(ext); };
  if (ends(".jsonl") || ends(".ndjson") || ends(".json")) return Format::Jsonl;
  if (ends(".txt") || ends(".text") || ends(".md")) return Format::Text;
  if (ends(".tokens")) return Format::Tokens;
  if (ends(".parquet")) return Format::Parquet;
  if (ends(".arrow")) return Format::Arrow;
  return std::nullopt;
}

Format parse_format(const std::string& name) {
  if (name == "text") return Format::Text;
  if (name == "jsonl") return Format::Jsonl;
  if (name == "fortune") return Format::Fortune;
  if (name == "tokens") return Format::Tokens;
  if (name == "arrow") return Format::Arrow;
  if (name == "lines") return Format::Lines;
  if (name == "paragraphs") return Format::Paragraphs;
  return Format::Parquet;
}

// Hugging Face `datasets` writes these JSON files beside its .arrow data (save_to_disk folders, its cache); they
// describe the dataset and are not data.
bool is_datasets_metadata(const fs::path& file) {
  const std::string name = file.filename().string();
  if (name != "dataset_info.json" && name != "state.json") return false;
  for (const auto& e : fs::directory_iterator(file.parent_path()))
    if (e.path().extension() == ".arrow") return true;
  return false;
}

bool is_glob(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

SourceSpec builtin_fortunes() {
  SourceSpec spec;
  spec.name = "fortunes";
  if (!fs::is_directory(kBuiltinCorpusDir))
    fail("the built-in dataset \"fortunes\" reads ", kBuiltinCorpusDir, ", which is missing; install it with "
         "`apt-get install fortunes` (scripts/setup.sh does) or set training.dataset_path");
  // Each fortune file has a binary index "<name>.dat" beside it; the text files are the ones with an index.
  for (const auto& e : fs::directory_iterator(kBuiltinCorpusDir)) {
    const fs::path& p = e.path();
    if (!e.is_regular_file() || p.extension() == ".dat" || p.extension() == ".u8") continue;
    if (fs::exists(p.string() + ".dat")) spec.shards.push_back({p.string(), Format::Fortune});
  }
  std::sort(spec.shards.begin(), spec.shards.end(), [](const Shard& a, const Shard& b) { return a.path < b.path; });
  if (spec.shards.empty()) fail("no fortune files found in ", kBuiltinCorpusDir);
  return spec;
}

}  // namespace

SourceSpec resolve_source(const config::DatasetSource& source, const std::string& where) {
  if (source.path.empty()) {
    if (source.name == "fortunes") {
      SourceSpec spec = builtin_fortunes();
      spec.weight = source.weight;
      spec.loop = source.loop;
      return spec;
    }
    fail(where, ": no path; a source is a file, a directory or a glob (built-in: name = \"fortunes\")");
  }
  SourceSpec spec;
  spec.name = source.name.empty() ? source.path : source.name;
  spec.weight = source.weight;
  spec.text_field = source.text_field;
  spec.loop = source.loop;
  const bool forced = source.format != "auto";
  auto add_file = [&](const std::string& file, bool from_scan) {
    if (forced) {
      spec.shards.push_back({file, parse_format(source.format)});
      return;
    }
    auto f = format_from_name(file);
    if (f) spec.shards.push_back({file, *f});
    else if (!from_scan)
      fail(where, ": cannot tell the format of ", quote(file), " from its name; expected .txt, .jsonl, .json, "
           ".tokens, .parquet or .arrow (optionally .gz/.zst), or set format = \"text\" | \"lines\" | \"paragraphs\" | \"jsonl\" | \"fortune\" | "
           "\"tokens\" | \"parquet\" | \"arrow\"");
  };
  std::vector<std::string> candidates;
  if (is_glob(source.path)) {
    glob_t g{};
    int rc = glob(source.path.c_str(), 0, nullptr, &g);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) candidates.emplace_back(g.gl_pathv[i]);
    globfree(&g);
    if (candidates.empty()) fail(where, ": the glob ", quote(source.path), " matches no files");
    for (const auto& c : candidates)
      if (fs::is_regular_file(c)) add_file(c, true);
  } else if (!fs::exists(source.path)) {
    fail(where, ": path ", quote(source.path), " does not exist");
  } else if (fs::is_regular_file(source.path)) {
    add_file(source.path, false);
  } else {
    // A DatasetDict saved by `datasets` holds one folder per split: training reads one of them.
    if (fs::exists(fs::path(source.path) / "dataset_dict.json")) {
      std::vector<std::string> splits;
      for (const auto& e : fs::directory_iterator(source.path))
        if (e.is_directory()) splits.push_back(e.path().filename().string());
      std::sort(splits.begin(), splits.end());
      fail(where, ": ", quote(source.path), " is a Hugging Face DatasetDict with the splits [", join(splits, ", "),
           "]; set the path to one split's folder, e.g. ", quote((fs::path(source.path) / (splits.empty() ? "train" : splits[0])).string()));
    }
    // A folder `datasets`' save_to_disk wrote: exactly the data files its state.json lists. Its .map() and filter()
    // calls leave cache-*.arrow files beside them, which are not the dataset (read, they repeated its rows).
    const fs::path state_path = fs::path(source.path) / "state.json";
    std::vector<std::string> listed;
    if (fs::is_regular_file(state_path)) {
      try {
        std::ifstream in(state_path);
        const auto state = nlohmann::json::parse(in);
        if (state.contains("_data_files") && state["_data_files"].is_array())
          for (const auto& f : state["_data_files"])
            if (f.is_object() && f.contains("filename") && f["filename"].is_string()) listed.push_back(f["filename"].get<std::string>());
      } catch (const nlohmann::json::exception& e) {
        fail(where, ": ", quote(state_path.string()), " (datasets' save_to_disk state) is not valid JSON: ", e.what());
      }
    }
    if (!listed.empty()) {
      for (const auto& name : listed) {
        const fs::path file = fs::path(source.path) / name;
        if (!fs::is_regular_file(file))
          fail(where, ": ", quote(state_path.string()), " lists ", quote(name), ", which is not in ", quote(source.path));
        add_file(file.string(), false);
      }
    } else {
      // Hidden files and folders (.git, .ipynb_checkpoints, editors' copies) are not data, as for `datasets`.
      for (auto it = fs::recursive_directory_iterator(source.path); it != fs::recursive_directory_iterator(); ++it) {
        if (it->path().filename().string().starts_with(".")) {
          if (it->is_directory()) it.disable_recursion_pending();
          continue;
        }
        if (it->is_regular_file() && !it->path().string().ends_with(".partial") && !is_datasets_metadata(it->path()))
          add_file(it->path().string(), true);
      }
    }
  }
  std::sort(spec.shards.begin(), spec.shards.end(), [](const Shard& a, const Shard& b) { return a.path < b.path; });
  if (spec.shards.empty())
    fail(where, ": ", quote(source.path), " holds no data files (.txt, .jsonl, .json, .tokens, .parquet, .arrow, "
         "optionally compressed .gz/.zst)");
  for (const auto& s : spec.shards)
    if ((s.format == Format::Parquet || s.format == Format::Arrow) && !parquet_supported())
      fail(where, ": ", quote(s.path), " is ", s.format == Format::Arrow ? "Arrow IPC" : "Parquet", ", but this build has "
           "no Arrow support (pyarrow's Arrow C++ was not found when it was configured; scripts/setup.sh installs it); "
           "convert it to JSONL or token shards");
  return spec;
}

std::vector<SourceSpec> resolve_sources(const std::string& dataset, const std::optional<std::string>& dataset_path,
                                        const std::string& format, const std::string& text_field,
                                        const std::string& where) {
  if (!dataset_path) {
    if (dataset == "fortunes") return {builtin_fortunes()};
    if (dataset == "c4" || dataset == "c4_test" || dataset == "c4_validation")  // torchtitan's Hugging Face names
      fail(where, ".dataset = ", quote(dataset), " is a Hugging Face dataset that titan.cpp does not download; set --",
           where, ".dataset_path to a file or directory (.txt/.jsonl/.tokens, optionally .gz/.zst)",
           where == "training" ? ", use [[training.datasets]] tables," : ";", " or use the built-in dataset \"fortunes\"");
    fail(where, ".dataset = ", quote(dataset), " is not built in and there is no --", where,
         ".dataset_path; datasets are files (built-in: fortunes)");
  }
  config::DatasetSource source;
  // torchtitan's default names (c4_test, ...) and the built-in corpus's label nothing here once a path is given: the
  // path names the source.
  const bool default_name = dataset == "c4" || dataset == "c4_test" || dataset == "c4_validation" || dataset == "fortunes";
  source.name = default_name ? *dataset_path : dataset;
  source.path = *dataset_path;
  source.format = format;
  source.text_field = text_field;
  return {resolve_source(source, where + ".dataset_path")};
}

std::vector<SourceSpec> resolve_text_inputs(const std::vector<std::string>& inputs, const std::string& format,
                                            const std::string& text_field) {
  std::vector<SourceSpec> sources;
  for (const auto& input : inputs) {
    config::DatasetSource s;
    s.name = input;
    s.path = input;
    s.format = format;
    s.text_field = text_field;
    sources.push_back(resolve_source(s, "--input " + input));
    for (const auto& shard : sources.back().shards)
      if (shard.format == Format::Tokens) fail("--input ", quote(shard.path), " is a token shard, not text");
  }
  return sources;
}

std::vector<SourceSpec> resolve_sources(const config::Training& training) {
  if (training.datasets.empty())
    return resolve_sources(training.dataset, training.dataset_path, training.dataset_format, training.text_field,
                           "training");
  if (training.dataset_path)
    fail("training.dataset_path = ", quote(*training.dataset_path), " and [[training.datasets]] tables are both set; a job reads "
         "one or the other: add the path as a table of the mixture, or leave the tables out");
  std::vector<SourceSpec> out;
  for (size_t i = 0; i < training.datasets.size(); ++i)
    out.push_back(resolve_source(training.datasets[i], cat("training.datasets[", i, "] (", training.datasets[i].name, ")")));
  return out;
}

struct ShardRowReader::Impl {
  std::unique_ptr<FileReader> file;
  std::unique_ptr<TokenShardReader> tokens;
  std::unique_ptr<ParquetTextReader> parquet;
  std::unique_ptr<ArrowTextReader> arrow;
  bool text_done = false;
};

ShardRowReader::ShardRowReader(const Shard& shard, uint32_t shard_index, const std::string& text_field)
    : impl_(std::make_unique<Impl>()), shard_(shard), shard_index_(shard_index) {
  if (shard.format == Format::Tokens) impl_->tokens = std::make_unique<TokenShardReader>(shard.path);
  else if (shard.format == Format::Parquet) impl_->parquet = std::make_unique<ParquetTextReader>(shard.path, text_field);
  else if (shard.format == Format::Arrow) impl_->arrow = std::make_unique<ArrowTextReader>(shard.path, text_field);
  else impl_->file = std::make_unique<FileReader>(shard.path);
}

ShardRowReader::~ShardRowReader() = default;

void ShardRowReader::seek(const ShardPosition& position) {
  position_ = position;
  if (impl_->file) {
    impl_->file->seek(position.offset, position.line);
    impl_->text_done = shard_.format == Format::Text && position.row > 0;
  }
}

bool ShardRowReader::next(RawRow& row) {
  row.tokens.clear();
  row.bytes.clear();
  row.shard = shard_index_;
  row.row = position_.row;
  switch (shard_.format) {
    case Format::Tokens: {
      if (position_.row >= impl_->tokens->num_docs()) return false;
      row.tokens = impl_->tokens->document(position_.row);
      row.offset = position_.row;
      break;
    }
    case Format::Text: {
      // A text file is one document; an empty one has no rows.
      if (impl_->text_done) return false;
      impl_->text_done = true;
      row.line = 1;
      row.offset = 0;
      row.bytes = impl_->file->read_rest();
      if (trim(row.bytes).empty()) return false;
      break;
    }
    case Format::Jsonl:
    case Format::Lines: {
      // The next non-blank line (a text line without its CRLF's \r; JSON takes it as whitespace).
      std::string line;
      do {
        if (!impl_->file->next_line(line)) return false;
      } while (trim(line).empty());
      row.line = impl_->file->line_number();
      row.offset = impl_->file->line_offset();
      if (shard_.format == Format::Lines && !line.empty() && line.back() == '\r') line.pop_back();
      row.bytes = std::move(line);
      break;
    }
    case Format::Paragraphs: {
      std::string line;
      bool started = false;
      while (impl_->file->next_line(line)) {
        if (trim(line).empty()) {
          if (started) break;
          continue;
        }
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (!started) {
          started = true;
          row.line = impl_->file->line_number();
          row.offset = impl_->file->line_offset();
        } else {
          row.bytes.push_back('\n');
        }
        row.bytes += line;
      }
      if (!started) return false;
      break;
    }
    case Format::Fortune: {
      std::string line;
      bool started = false;
      while (true) {
        if (!impl_->file->next_line(line)) {
          if (!started || trim(row.bytes).empty()) return false;
          break;
        }
        if (line == "%") {
          if (started && !trim(row.bytes).empty()) break;
          row.bytes.clear();
          started = false;
          continue;
        }
        if (!started) {
          started = true;
          row.line = impl_->file->line_number();
          row.offset = impl_->file->line_offset();
        }
        row.bytes += line;
        row.bytes.push_back('\n');
      }
      break;
    }
    case Format::Parquet: {
      if (!impl_->parquet->read(position_.row, row.bytes, row.null_text)) return false;
      row.offset = position_.row;
      break;
    }
    case Format::Arrow: {
      if (!impl_->arrow->read(position_.row, row.bytes, row.null_text)) return false;
      row.offset = position_.row;
      break;
    }
  }
  ++position_.row;
  if (impl_->file) {
    position_.offset = impl_->file->offset();
    position_.line = impl_->file->line_number();
  }
  return true;
}

std::string row_text(const RawRow& row, const SourceSpec& source) {
  const Shard& shard = source.shards.at(row.shard);
  if (row.null_text) fail(shard.path, ": row ", row.row, ": column ", quote(source.text_field), " is null");
  if (shard.format != Format::Jsonl) {
    // Text is UTF-8 in every format, as Python's strict decoding and Hugging Face's tokenizers take it (JSON's
    // parser checks its own). A byte-order mark that starts a text file marks its encoding and is not text.
    const bool file_start = row.offset == 0 && shard.format != Format::Parquet && shard.format != Format::Arrow;
    const size_t skip = file_start && starts_with(row.bytes, "\xEF\xBB\xBF") ? 3 : 0;
    const std::string_view text = std::string_view(row.bytes).substr(skip);
    if (const size_t bad = tokenizer::first_invalid_utf8(text); bad != std::string_view::npos) {
      const auto byte = strprintf("0x%02X", static_cast<unsigned>(static_cast<unsigned char>(text[bad])));
      if (shard.format == Format::Parquet || shard.format == Format::Arrow)
        fail(shard.path, ": row ", row.row, ": column ", quote(source.text_field), " is not valid UTF-8 (byte ", byte,
             " at offset ", bad, " of its text)");
      const uint64_t line = row.line + static_cast<uint64_t>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(bad), '\n'));
      // (A paragraph's lines lost their \r: its byte offsets are the file's only up to its first line break.)
      const std::string at = shard.format == Format::Paragraphs ? cat("in the paragraph at byte offset ", row.offset)
                                                                : cat("at byte offset ", row.offset + skip + bad);
      fail(shard.path, ":", line, ": not valid UTF-8 (byte ", byte, " ", at, "); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)");
    }
    return skip ? std::string(text) : row.bytes;
  }
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(row.bytes);
  } catch (const nlohmann::json::exception& e) {  // parse errors and numbers out of range
    fail(shard.path, ":", row.line, ": malformed JSON line (byte offset ", row.offset, "): ", tokenizer::utf8_lossy(e.what()));
  }
  if (!value.is_object())
    fail(shard.path, ":", row.line, ": expected a JSON object per line (byte offset ", row.offset, ")");
  auto it = value.find(source.text_field);
  if (it == value.end())
    fail(shard.path, ":", row.line, ": no field ", quote(source.text_field), " (byte offset ", row.offset,
         "); name the field holding the text (training.text_field, text_field in a [[training.datasets]] table, or "
         "--text-field of titan data tokenize and titan tokenizer train)");
  if (!it->is_string())
    fail(shard.path, ":", row.line, ": field ", quote(source.text_field), " is not a string (byte offset ",
         row.offset, ")");
  return it->get<std::string>();
}

}  // namespace titan::data
