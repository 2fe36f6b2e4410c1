#include "titan/components/tokenizer/utf8.h"

#include <cstring>

namespace titan::tokenizer {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {
// Number of bytes of the longest prefix at `pos` that could still start a valid sequence (maximal subpart),
// and whether it is complete.
size_t valid_prefix(std::string_view s, size_t pos, bool& complete) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  unsigned char b0 = byte(pos);
  complete = false;
  if (b0 < 0x80) return complete = true, 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
  else if (b0 == 0xE0) need = 2, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEC) need = 2;
  else if (b0 == 0xED) need = 2, hi = 0x9F;
  else if (b0 >= 0xEE && b0 <= 0xEF) need = 2;
  else if (b0 == 0xF0) need = 3, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) need = 3;
  else if (b0 == 0xF4) need = 3, hi = 0x8F;
  else return 0;
  size_t i = 1;
  for (; i <= need; ++i) {
    if (pos + i >= s.size()) return i;
    unsigned char b = byte(pos + i);
    unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return i;
  }
  complete = true;
  return need + 1;
}
}  // namespace

size_t utf8_sequence_length(std::string_view text, size_t pos) {
  bool complete;
  size_t n = valid_prefix(text, pos, complete);
  return complete ? n : 0;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    bool complete;
    size_t n = valid_prefix(bytes, pos, complete);
    if (complete) {
      out.append(bytes.substr(pos, n));
      pos += n;
    } else {
      out += "\xEF\xBF\xBD";
      pos += n == 0 ? 1 : n;
    }
  }
  return out;
}

bool is_valid_utf8(std::string_view bytes) { return first_invalid_utf8(bytes) == std::string_view::npos; }

size_t first_invalid_utf8(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    // Runs of ASCII, eight bytes at a time.
    while (pos + 8 <= bytes.size()) {
      uint64_t word;
      std::memcpy(&word, bytes.data() + pos, 8);
      if (word & 0x8080808080808080ull) break;
      pos += 8;
    }
    if (pos >= bytes.size()) break;
    size_t n = utf8_sequence_length(bytes, pos);
    if (n == 0) return pos;
    pos += n;
  }
  return std::string_view::npos;
}

}  // namespace titan::tokenizer
