// Unicode normalization forms and lowercasing of UTF-8 text, for Hugging Face tokenizer.json normalizers (NFC in
// Qwen's tokenizers, NFKC, NFD, NFKD, Lowercase), through ICU when the build found it.
#pragma once
#include <string>
#include <string_view>

namespace titan::tokenizer {

enum class UnicodeForm { NFC, NFD, NFKC, NFKD };

// False in a build without ICU (Debian: libicu-dev): the normalizers are then refused by name.
bool unicode_normalization_available();
// `text` in the form; bytes that are not UTF-8 stay as they are, and the valid runs between them are normalized.
std::string unicode_normalize(std::string_view text, UnicodeForm form);
// Each code point's full Unicode lowercase mapping, without context (HF tokenizers' Lowercase normalizer, Rust's
// char::to_lowercase: "İ" becomes "i̇", a final capital sigma "σ").
std::string unicode_lowercase(std::string_view text);

}  // namespace titan::tokenizer
