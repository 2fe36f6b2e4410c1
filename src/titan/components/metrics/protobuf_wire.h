// Protobuf's wire format, for the few hand-encoded messages titan writes (TensorBoard events, W&B records): keys are
// (field << 3) | type, where type 0 is a varint, 1 fixed64, 2 length-delimited and 5 fixed32.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace titan::metrics::wire {

inline void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void key(std::string& out, int field, int type) { varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(type)); }
// `bytes` little-endian bytes of `bits`.
inline void fixed(std::string& out, uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>(bits >> (8 * i)));
}
inline void length_delimited(std::string& out, int field, std::string_view bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out.append(bytes);
}
// A varint field (int32/int64/bool); negative numbers take ten bytes, as protobuf's int64 encoding.
inline void varint_field(std::string& out, int field, int64_t v) {
  key(out, field, 0);
  varint(out, static_cast<uint64_t>(v));
}
inline void double_field(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  key(out, field, 1);
  fixed(out, bits, 8);
}

}  // namespace titan::metrics::wire
