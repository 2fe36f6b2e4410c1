#include "titan/components/tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::tokenizer {

namespace fs = std::filesystem;

std::vector<int32_t> Tokenizer::encode_document(std::string_view text) const {
  std::vector<int32_t> body = encode(text);
  std::vector<int32_t> out;
  out.reserve(body.size() + 2);
  if (bos_id_ && !encode_adds_bos_) out.push_back(*bos_id_);
  out.insert(out.end(), body.begin(), body.end());
  if (eos_id_ && !encode_adds_eos_) out.push_back(*eos_id_);
  return out;
}

std::vector<int32_t> Tokenizer::encode_prompt(std::string_view text) const {
  std::vector<int32_t> out = encode_document(text);
  if (eos_id_ && !out.empty() && out.back() == *eos_id_) out.pop_back();
  return out;
}

namespace {

bool looks_like_tiktoken(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::string line;
  if (!std::getline(in, line)) return false;
  auto space = line.find(' ');
  if (space == std::string::npos || space == 0) return false;
  for (size_t i = space + 1; i < line.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(line[i])) && line[i] != '\r') return false;
  return true;
}

std::unique_ptr<Tokenizer> load_file(const fs::path& file) {
  const std::string name = file.filename().string();
  if (ends_with(name, ".json")) return load_hf_json(file.string());
  if (looks_like_tiktoken(file)) return load_tiktoken(file.string());
  // Llama 2's tokenizer.model is a SentencePiece protobuf; Llama 3's is tiktoken text (handled above).
  return load_sentencepiece(file.string());
}

}  // namespace

std::unique_ptr<Tokenizer> load(const std::string& path) {
  fs::path p(path);
  if (!fs::exists(p))
    fail("tokenizer path ", quote(path), " does not exist; expected a directory with tokenizer.json or tokenizer.model, or a "
         "tokenizer file (titan train: model.hf_assets_path, which also takes builtin; other commands: --tokenizer)");
  if (fs::is_regular_file(p)) return load_file(p);
  for (const char* candidate : {"tokenizer.json", "tokenizer.model", "original/tokenizer.model"}) {
    if (fs::is_regular_file(p / candidate)) return load_file(p / candidate);
  }
  std::vector<std::string> names, tiktoken_files;
  for (const auto& entry : fs::directory_iterator(p)) {
    names.push_back(entry.path().filename().string());
    if (entry.is_regular_file() && ends_with(names.back(), ".tiktoken")) tiktoken_files.push_back(names.back());
  }
  std::sort(names.begin(), names.end());
  std::sort(tiktoken_files.begin(), tiktoken_files.end());
  // A folder of one *.tiktoken file (titan's {dump_folder}/builtin_tokenizer/, or a downloaded ranks file).
  if (tiktoken_files.size() == 1) return load_tiktoken((p / tiktoken_files.front()).string());
  if (names.size() > 12) names.resize(12), names.push_back("...");
  fail("no tokenizer in ", quote(path), ": expected tokenizer.json, tokenizer.model or one *.tiktoken file there; found [",
       join(names, ", "), "]", tiktoken_files.size() > 1 ? " (several *.tiktoken files: name the one to use)" : "");
}

}  // namespace titan::tokenizer
