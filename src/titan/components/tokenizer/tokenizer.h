// Tokenizer: the interface the data pipeline and CLI use, and load() that opens HF tokenizer.json or
// tiktoken-format (Llama 3 tokenizer.model) or SentencePiece (Llama 2 tokenizer.model) files from a path or an HF
// assets directory.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace titan::tokenizer {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Encodes like the reference library's default call: HF `Tokenizer.encode(text).ids` (added tokens recognised,
  // post-processor template applied) or tiktoken's `encode_ordinary(text)` (special-token text is plain text).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Concatenates the tokens' bytes; invalid UTF-8 becomes U+FFFD. Special tokens are dropped when asked.
  virtual std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const = 0;
  // Number of ids (largest id + 1), the minimum model vocab_size.
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::string description() const = 0;
  // The file it was loaded from.
  virtual std::string source_path() const = 0;
  // Writes what transformers' AutoTokenizer.from_pretrained(directory) needs to give the same ids: the tokenizer
  // file (tokenizer.json as loaded, one converted from tiktoken ranks, or the SentencePiece model) and
  // tokenizer_config.json (BOS/EOS).
  virtual void save_hf_files(const std::string& directory) const = 0;

  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }

  // A training document: BOS + encode(text) + EOS, without doubling a BOS/EOS that encode() already adds.
  std::vector<int32_t> encode_document(std::string_view text) const;
  // A prompt to continue: BOS + encode(text), without the document's EOS (torchtitan's generation script's form).
  std::vector<int32_t> encode_prompt(std::string_view text) const;

 protected:
  std::optional<int32_t> bos_id_, eos_id_;
  bool encode_adds_bos_ = false, encode_adds_eos_ = false;
};

// `path` is a tokenizer file (tokenizer.json, *.tiktoken, tokenizer.model) or a directory holding one (as
// torchtitan's model.hf_assets_path). Throws UserError naming the path and what was expected.
std::unique_ptr<Tokenizer> load(const std::string& path);

std::unique_ptr<Tokenizer> load_hf_json(const std::string& json_path);
// A tiktoken ranks file ("<base64> <rank>" lines). Special tokens and the pattern come from a sibling
// "<stem>.meta.json" when present, else Llama 3's pattern and its 256 special tokens after the base vocabulary.
std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path);

// A SentencePiece model file (Llama 2's tokenizer.model).
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path);

// Llama 3.1's special-token names, in id order after the base vocabulary (256 in all).
std::vector<std::string> llama3_special_tokens();

}  // namespace titan::tokenizer
