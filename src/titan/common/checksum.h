// CRC-32 as zlib, gzip and ZIP define it (reflected polynomial 0xEDB88320): checkpoint files and pieces, torch.save
// archives. The fastest implementation the build found is used: Intel's ISA-L (carry-less multiplication, 3-4x zlib's
// rate on x86-64) when its headers and library were there at build time, else zlib's. Both give the same values.
#pragma once
#include <cstddef>
#include <cstdint>

namespace titan {

// The CRC-32 of the bytes that gave `crc`, followed by `data[0, n)`; crc32_update(0, data, n) starts a new one.
uint32_t crc32_update(uint32_t crc, const void* data, size_t n);

// The CRC-32 of A followed by B, from crc(A), crc(B) and B's length (zlib's crc32_combine, under another name because
// zlib.h may define that one as a macro).
uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// "isa-l" or "zlib": which implementation crc32_update runs.
const char* crc32_implementation();

}  // namespace titan
