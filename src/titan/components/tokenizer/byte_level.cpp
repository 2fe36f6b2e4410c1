#include "titan/components/tokenizer/byte_level.h"

#include "titan/components/tokenizer/utf8.h"

namespace titan::tokenizer {
namespace {

struct Tables {
  std::array<uint32_t, 256> code_point{};
  std::array<std::string, 256> utf8;
  Tables() {
    auto printable = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      code_point[b] = printable(b) ? static_cast<uint32_t>(b) : next++;
      append_utf8(utf8[b], code_point[b]);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

std::optional<uint8_t> char_to_byte(uint32_t cp) {
  if (cp < 256) {
    const auto& t = tables();
    if (t.code_point[cp] == cp) return static_cast<uint8_t>(cp);
    return std::nullopt;
  }
  // Non-printable bytes were assigned U+0100 + k in byte order.
  if (cp >= 256 && cp < 256 + 68) {
    const auto& t = tables();
    for (int b = 0; b < 256; ++b)
      if (t.code_point[b] == cp) return static_cast<uint8_t>(b);
  }
  return std::nullopt;
}

std::string bytes_to_chars(std::string_view bytes) {
  const auto& map = tables().utf8;
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += map[b];
  return out;
}

std::optional<std::string> chars_to_bytes(std::string_view chars) {
  std::string out;
  size_t pos = 0;
  while (pos < chars.size()) {
    size_t n = utf8_sequence_length(chars, pos);
    if (n == 0) return std::nullopt;
    uint32_t cp;
    const auto* p = reinterpret_cast<const unsigned char*>(chars.data() + pos);
    if (n == 1) cp = p[0];
    else if (n == 2) cp = ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    else if (n == 3) cp = ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    else cp = ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
    auto b = char_to_byte(cp);
    if (!b) return std::nullopt;
    out.push_back(static_cast<char>(*b));
    pos += n;
  }
  return out;
}

}  // namespace titan::tokenizer
