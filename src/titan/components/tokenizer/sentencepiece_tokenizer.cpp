// SentencePiece models (Llama 2's tokenizer.model) through the SentencePiece library itself, so normalisation,
// the dummy prefix, byte fallback and unigram/BPE models behave exactly as in Python's `sentencepiece`.
#include <sentencepiece_processor.h>

#include <filesystem>

#include "titan/common/files.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/tokenizer/hf_export.h"
#include "titan/components/tokenizer/tokenizer.h"

namespace titan::tokenizer {
namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    auto status = processor_.Load(path);
    if (!status.ok())
      fail(path, ": not a SentencePiece model (", status.ToString(), "); expected a Llama 2-style tokenizer.model, a "
           "tiktoken ranks file or a tokenizer.json");
    if (processor_.bos_id() >= 0) bos_id_ = processor_.bos_id();
    if (processor_.eos_id() >= 0) eos_id_ = processor_.eos_id();
  }

  // Like sentencepiece's `encode(text)`: control symbols such as "<s>" in the text are plain text.
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto status = processor_.Encode(text, &ids);
    if (!status.ok()) fail(path_, ": encoding failed: ", status.ToString());
    return {ids.begin(), ids.end()};
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    std::vector<int> kept;
    for (int32_t id : ids) {
      if (id < 0 || id >= processor_.GetPieceSize())
        fail("token id ", id, " is outside the vocabulary of ", path_, " (", processor_.GetPieceSize(), " ids)");
      if (skip_special_tokens && (processor_.IsControl(id) || processor_.IsUnknown(id))) continue;
      kept.push_back(id);
    }
    std::string text;
    auto status = processor_.Decode(kept, &text);
    if (!status.ok()) fail(path_, ": decoding failed: ", status.ToString());
    return text;
  }

  int64_t vocab_size() const override { return processor_.GetPieceSize(); }

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    const int id = processor_.PieceToId(token);
    if (id == processor_.unk_id() && token != processor_.IdToPiece(id)) return std::nullopt;
    return id;
  }

  std::string source_path() const override { return path_; }

  // transformers' LlamaTokenizer (slow; its fast variant converts from it) reads the same model file.
  void save_hf_files(const std::string& directory) const override {
    copy_file_as_own(path_, (std::filesystem::path(directory) / "tokenizer.model").string());
    auto name = [&](std::optional<int32_t> id) -> std::optional<std::string> {
      if (!id) return std::nullopt;
      return processor_.IdToPiece(*id);
    };
    write_tokenizer_config(directory, name(bos_id_), name(eos_id_), "LlamaTokenizer");
  }

  std::string description() const override {
    return cat("SentencePiece model ", path_, " (", processor_.GetPieceSize(), " pieces)");
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor processor_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace titan::tokenizer
