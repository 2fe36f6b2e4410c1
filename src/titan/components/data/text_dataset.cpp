#include "titan/components/data/text_dataset.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"

namespace titan::data {

namespace fs = std::filesystem;

const char* const kBuiltinCorpusDir = "/usr/share/games/fortunes";

namespace {

DatasetSpec::Format format_of(const fs::path& p) {
  std::string ext = to_lower(p.extension().string());
  return ext == ".jsonl" ? DatasetSpec::Format::Jsonl : DatasetSpec::Format::Text;
}

DatasetSpec builtin_fortunes() {
  DatasetSpec spec;
  spec.name = "fortunes (built-in)";
  spec.format_hint = DatasetSpec::Format::Fortune;
  if (!fs::is_directory(kBuiltinCorpusDir))
    fail("the built-in dataset \"fortunes\" reads ", kBuiltinCorpusDir, ", which is missing; install it with "
         "`apt-get install fortunes` (scripts/setup.sh does) or set --training.dataset_path");
  // Each fortune file has a binary index "<name>.dat" beside it; the text files are the ones with an index.
  for (const auto& e : fs::directory_iterator(kBuiltinCorpusDir)) {
    const fs::path& p = e.path();
    if (!e.is_regular_file() || p.extension() == ".dat" || p.extension() == ".u8") continue;
    if (fs::exists(p.string() + ".dat")) spec.files.push_back(p.string());
  }
  std::sort(spec.files.begin(), spec.files.end());
  if (spec.files.empty()) fail("no fortune files found in ", kBuiltinCorpusDir);
  return spec;
}

}  // namespace

DatasetSpec resolve_dataset(const std::string& name, const std::optional<std::string>& path) {
  if (!path) {
    if (name == "fortunes") return builtin_fortunes();
    if (name == "c4" || name == "c4_test" || name == "c4_validation")
      fail("training.dataset = ", quote(name), " is a Hugging Face dataset that titan.cpp does not download; set "
           "--training.dataset_path to a .txt/.jsonl file or a directory of them, or use the built-in "
           "--training.dataset fortunes");
    fail("unknown dataset ", quote(name), " and no training.dataset_path; datasets are files: set "
         "--training.dataset_path to a .txt/.jsonl file or directory (built-in: fortunes)");
  }
  DatasetSpec spec;
  spec.name = name + " (" + *path + ")";
  fs::path p(*path);
  if (!fs::exists(p)) fail("training.dataset_path ", quote(*path), " does not exist");
  if (fs::is_regular_file(p)) {
    std::string ext = to_lower(p.extension().string());
    if (ext != ".txt" && ext != ".jsonl")
      fail("training.dataset_path ", quote(*path), ": unsupported file type ", quote(ext),
           "; expected a .txt file (one document) or a .jsonl file (a \"text\" field per line)");
    spec.files.push_back(p.string());
  } else {
    for (const auto& e : fs::recursive_directory_iterator(p)) {
      if (!e.is_regular_file()) continue;
      std::string ext = to_lower(e.path().extension().string());
      if (ext == ".txt" || ext == ".jsonl") spec.files.push_back(e.path().string());
    }
    std::sort(spec.files.begin(), spec.files.end());
    if (spec.files.empty()) fail("training.dataset_path ", quote(*path), " holds no .txt or .jsonl files");
  }
  return spec;
}

DocumentReader::DocumentReader(DatasetSpec spec) : spec_(std::move(spec)) {}

void DocumentReader::rewind() {
  file_index_ = 0;
  file_open_ = false;
  current_.close();
}

bool DocumentReader::open_next_file() {
  if (file_index_ >= spec_.files.size()) return false;
  const std::string& file = spec_.files[file_index_++];
  current_.close();
  current_.clear();
  current_.open(file, std::ios::binary);
  if (!current_) fail("cannot open data file ", quote(file));
  current_format_ = spec_.format_hint == DatasetSpec::Format::Fortune ? DatasetSpec::Format::Fortune : format_of(file);
  line_no_ = 0;
  file_open_ = true;
  return true;
}

bool DocumentReader::next(std::string& document) {
  while (true) {
    if (!file_open_ && !open_next_file()) return false;
    const std::string& file = spec_.files[file_index_ - 1];
    switch (current_format_) {
      case DatasetSpec::Format::Text: {
        document.assign(std::istreambuf_iterator<char>(current_), std::istreambuf_iterator<char>());
        file_open_ = false;
        if (!document.empty()) return true;
        break;
      }
      case DatasetSpec::Format::Fortune: {
        document.clear();
        std::string line;
        bool any = false;
        while (std::getline(current_, line)) {
          any = true;
          if (line == "%") break;
          document += line;
          document.push_back('\n');
        }
        if (!any) {
          file_open_ = false;
          break;
        }
        if (!trim(document).empty()) return true;
        break;
      }
      case DatasetSpec::Format::Jsonl: {
        std::string line;
        if (!std::getline(current_, line)) {
          file_open_ = false;
          break;
        }
        ++line_no_;
        if (trim(line).empty()) break;
        nlohmann::json row;
        try {
          row = nlohmann::json::parse(line);
        } catch (const nlohmann::json::parse_error& e) {
          fail(file, ":", line_no_, ": malformed JSON line: ", e.what());
        }
        if (!row.is_object() || !row.contains(spec_.text_field) || !row[spec_.text_field].is_string())
          fail(file, ":", line_no_, ": expected an object with a string field ", quote(spec_.text_field));
        document = row[spec_.text_field].get<std::string>();
        return true;
      }
    }
  }
}

TextDataLoader::TextDataLoader(DatasetSpec spec, const tokenizer::Tokenizer& tokenizer, int64_t seq_len,
                               int64_t batch_size, int64_t dp_rank, int64_t dp_degree)
    : reader_(std::move(spec)), tokenizer_(tokenizer), seq_len_(seq_len), batch_size_(batch_size), dp_rank_(dp_rank),
      dp_degree_(dp_degree) {}

std::vector<int32_t> TextDataLoader::next_window() {
  const size_t window = static_cast<size_t>(seq_len_ + 1);
  std::string document;
  while (buffer_.size() < window) {
    if (!reader_.next(document)) {
      if (tokens_this_epoch_ == 0) fail("dataset ", reader_.spec().name, " yields no tokens");
      ++epoch_;
      log::info("dataset ", reader_.spec().name, " exhausted after ", with_thousands(documents_this_epoch_),
                " documents; starting epoch ", epoch_ + 1);
      reader_.rewind();
      documents_this_epoch_ = tokens_this_epoch_ = 0;
      continue;
    }
    auto ids = tokenizer_.encode_document(document);
    ++documents_this_epoch_;
    tokens_this_epoch_ += static_cast<int64_t>(ids.size());
    buffer_.insert(buffer_.end(), ids.begin(), ids.end());
  }
  std::vector<int32_t> out(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(window));
  buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(window));
  return out;
}

Batch TextDataLoader::next() {
  at::Tensor windows = at::empty({batch_size_, seq_len_ + 1}, at::kLong);
  auto* data = windows.data_ptr<int64_t>();
  for (int64_t i = 0; i < dp_degree_ * batch_size_; ++i) {
    auto w = next_window();
    const int64_t b = i - dp_rank_ * batch_size_;
    if (b >= 0 && b < batch_size_) std::copy(w.begin(), w.end(), data + b * (seq_len_ + 1));
  }
  return Batch{windows.narrow(1, 0, seq_len_).contiguous(), windows.narrow(1, 1, seq_len_).contiguous()};
}

}  // namespace titan::data
