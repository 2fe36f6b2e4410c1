#include "titan/common/checksum.h"

#include <zlib.h>

#include <algorithm>
#include <limits>

#ifdef TITAN_HAVE_ISAL
#include <isa-l/crc.h>
#endif

namespace titan {

uint32_t crc32_update(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#ifdef TITAN_HAVE_ISAL
  // ISA-L's gzip CRC takes and returns the same (finalised) values as zlib's crc32, so the two chain freely.
  return crc32_gzip_refl(crc, p, n);
#else
  uLong value = crc;
  while (n > 0) {  // zlib takes 32-bit lengths
    const size_t chunk = std::min<size_t>(n, std::numeric_limits<uInt>::max() & ~static_cast<size_t>(0xfff));
    value = ::crc32(value, p, static_cast<uInt>(chunk));
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(value);
#endif
}

uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return static_cast<uint32_t>(::crc32_combine64(crc_a, crc_b, static_cast<int64_t>(length_b)));
}

const char* crc32_implementation() {
#ifdef TITAN_HAVE_ISAL
  return "isa-l";
#else
  return "zlib";
#endif
}

}  // namespace titan
