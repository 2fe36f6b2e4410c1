// UTF-8 helpers for tokenizers: code point iteration, encoding, and lossy repair of invalid byte sequences.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace titan::tokenizer {

void append_utf8(std::string& out, uint32_t code_point);
// Length of the valid UTF-8 sequence starting at text[pos], or 0 when the bytes there are not valid UTF-8.
size_t utf8_sequence_length(std::string_view text, size_t pos);
// Replaces each maximal invalid subpart with U+FFFD, as Python's errors="replace" and Rust's from_utf8_lossy do.
std::string utf8_lossy(std::string_view bytes);
bool is_valid_utf8(std::string_view bytes);
// The offset of the first byte that does not start a valid UTF-8 sequence, or npos when all of `bytes` is UTF-8.
size_t first_invalid_utf8(std::string_view bytes);

}  // namespace titan::tokenizer
