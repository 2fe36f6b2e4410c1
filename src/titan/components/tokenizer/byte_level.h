// The GPT-2 byte-level alphabet: each byte maps to one printable Unicode character, so BPE vocabularies can be
// written as text (HF tokenizer.json). Printable Latin-1 bytes map to themselves; the rest to U+0100 onwards.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace titan::tokenizer {

// The byte a character stands for, if it is part of the alphabet.
std::optional<uint8_t> char_to_byte(uint32_t code_point);
// Maps every byte of `bytes` to its character.
std::string bytes_to_chars(std::string_view bytes);
// Reverses bytes_to_chars; nullopt when a character is not in the alphabet.
std::optional<std::string> chars_to_bytes(std::string_view chars);

}  // namespace titan::tokenizer
