// The grouped matrix product's two passes for one instruction set (kernels/grouped_mm.h drives them): pack both
// operands of a problem into zero-padded blocks, then compute independent output tiles from the packed copies.
//
// Vector path (float32 in every copy; bf16 in the copies without bf16 dot products, widened to float32 while
// packing): A in panels of kRows rows stored depth-major, B in panels of kCols columns stored depth-major; a tile is
// kRows x kCols outputs held in registers over the whole depth (one broadcast and kCols / 16 multiply-adds per row
// and depth step).
//
// Dot path (bf16 in the avx512bf16 copy on CPUs without AMX): the same tiles on the bf16 pair dot-product
// instruction (vdpbf16ps: each float lane adds the two exact products of a pair of bf16 values), so a step covers
// two depths and the packed copies stay bf16: A and B in panels stored pair-major, each 32-bit word a pair of
// adjacent depths of one row or column (zero past the depth). Half the instructions and half the packed bytes of the
// vector path; products summed in float32 (the instruction flushes denormals to zero) and rounded to bf16 once.
//
// AMX path (bf16, the avx512bf16 copy on CPUs with AMX): A row-major with the depth padded to 32 (read in place
// when its rows are contiguous and the depth a multiple of 32), B in the AMX pair-interleaved layout per 16 columns; a tile is 32 x 32 outputs, four 16 x 16 float32 accumulator tiles fed by
// two A and two B tiles per 32 steps of depth. Products accumulate in float32 and are rounded to the output dtype
// once.
#include <cstring>

#include "titan/kernels/isa/kernels.h"
#include "titan/kernels/isa/scalar_math.h"

#if defined(__AVX512BF16__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TITAN_GROUPED_MM_AMX 1
#define TITAN_GROUPED_MM_DOT 1
#endif

namespace titan::kernels::isa::TITAN_ISA {
namespace {

#ifdef TITAN_ISA_WIDE_REGISTERS
constexpr int64_t kRows = 6, kVecs = 2;  // 12 accumulators of 16 floats, 2 B vectors, 1 broadcast: 15 of 32 registers
#else
constexpr int64_t kRows = 4, kVecs = 1;
#endif
constexpr int64_t kCols = 16 * kVecs;
constexpr int64_t kChunk = 16;     // row panels per chunk of tiles (vector path)
constexpr int64_t kAmxBlock = 32;  // rows and columns of an AMX tile of outputs; also the depth step
#ifdef TITAN_GROUPED_MM_DOT
constexpr int64_t kDotRows = 6, kDotVecs = 2, kDotCols = 16 * kDotVecs;  // (8 x 32, 12 x 32, 4 x 64: no faster here)
#endif

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }  // (no std:: templates: nothing inline shared)
int64_t align64(int64_t bytes) { return round_up(bytes, 64); }

// ---- vector path ----

// Copies an operand into panels of `lanes` rows (A) or columns (B), each panel depth-major: panel p holds, for each
// depth step t, the lanes' values at t (zeros past the edge). `lane_stride` steps between lanes, `depth_stride`
// between depth steps. The innermost loop runs over the lanes: contiguous reads where the lanes are adjacent in
// memory, one read per lane stream otherwise.
template <typename T, int64_t kLanes>
void pack_panels(const void* base, int64_t lanes_total, int64_t depth, int64_t lane_stride, int64_t depth_stride,
                 float* out) {
  const T* src = static_cast<const T*>(base);
  for (int64_t first = 0; first < lanes_total; first += kLanes) {
    const int64_t n = smaller(kLanes, lanes_total - first);
    const T* panel = src + first * lane_stride;
    for (int64_t t = 0; t < depth; ++t, out += kLanes) {
      const T* column = panel + t * depth_stride;
      if (n == kLanes && lane_stride == 1) {
        for (int64_t l = 0; l < kLanes; ++l) out[l] = to_float(column[l]);
      } else {
        for (int64_t l = 0; l < n; ++l) out[l] = to_float(column[l * lane_stride]);
        for (int64_t l = n; l < kLanes; ++l) out[l] = 0.0f;
      }
    }
  }
}

// Part `part` of `parts` of a problem's packing: A's panels and B's panels as one list cut into even slices.
struct PanelSlice {
  int64_t a_begin = 0, a_end = 0, b_begin = 0, b_end = 0;
};
PanelSlice panel_slice(int64_t a_panels, int64_t b_panels, int64_t part, int64_t parts) {
  const int64_t total = a_panels + b_panels, begin = total * part / parts, end = total * (part + 1) / parts;
  PanelSlice slice;
  slice.a_begin = smaller(begin, a_panels), slice.a_end = smaller(end, a_panels);
  slice.b_begin = begin > a_panels ? begin - a_panels : 0, slice.b_end = end > a_panels ? end - a_panels : 0;
  return slice;
}

template <typename T>
void pack_vector(const MatmulProblem& p, float* a_packed, float* b_packed, int64_t part, int64_t parts) {
  const PanelSlice slice = panel_slice(round_up(p.rows, kRows) / kRows, round_up(p.cols, kCols) / kCols, part, parts);
  const int64_t bytes = sizeof(T);
  const auto* a = static_cast<const uint8_t*>(p.a) + slice.a_begin * kRows * p.a_stride[0] * bytes;
  const auto* b = static_cast<const uint8_t*>(p.b) + slice.b_begin * kCols * p.b_stride[1] * bytes;
  if (slice.a_end > slice.a_begin)
    pack_panels<T, kRows>(a, smaller(p.rows, slice.a_end * kRows) - slice.a_begin * kRows, p.depth, p.a_stride[0],
                          p.a_stride[1], a_packed + slice.a_begin * kRows * p.depth);
  if (slice.b_end > slice.b_begin)
    pack_panels<T, kCols>(b, smaller(p.cols, slice.b_end * kCols) - slice.b_begin * kCols, p.depth, p.b_stride[1],
                          p.b_stride[0], b_packed + slice.b_begin * kCols * p.depth);
}

template <typename T>
void store_tile(const MatmulProblem& p, int64_t row0, int64_t col0, int64_t rows, int64_t cols, const float* values,
                int64_t ld) {
  T* c = static_cast<T*>(p.c);
  for (int64_t i = 0; i < rows; ++i) {
    T* out = c + (row0 + i) * p.c_stride[0] + col0 * p.c_stride[1];
    const float* v = values + i * ld;
    if (p.c_stride[1] == 1) {
      int64_t j = 0;
      for (; j + kVec <= cols; j += kVec) store16(out + j, load16(v + j));
      for (; j < cols; ++j) store(out + j, v[j]);
    } else {
      for (int64_t j = 0; j < cols; ++j) store(out + j * p.c_stride[1], v[j]);
    }
  }
}

// Tile `tile`'s (row panel, column panel): tiles go by chunks of kChunk row panels (their A in L2), column panel by
// column panel (its B in L1), row panel fastest. Both the vector and the dot path use this order.
struct TilePanels {
  int64_t row, col;
};
TilePanels tile_panels(int64_t tile, int64_t row_panels, int64_t col_panels) {
  const int64_t chunk = tile / (kChunk * col_panels), chunk_rows = smaller(kChunk, row_panels - chunk * kChunk);
  const int64_t within = tile - chunk * kChunk * col_panels;
  return {chunk * kChunk + within % chunk_rows, within / chunk_rows};
}

template <typename T>
void tiles_vector(const MatmulProblem& p, const float* a_packed, const float* b_packed, int64_t begin, int64_t end) {
  const int64_t row_panels = round_up(p.rows, kRows) / kRows, col_panels = round_up(p.cols, kCols) / kCols;
  const int64_t depth = p.depth;
  for (int64_t tile = begin; tile < end; ++tile) {
    const auto [rp, cp] = tile_panels(tile, row_panels, col_panels);
    const float* a = a_packed + rp * depth * kRows;
    const float* b = b_packed + cp * depth * kCols;
    Vec16 acc[kRows][kVecs];
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] = splat(0.0f);
    for (int64_t t = 0; t < depth; ++t) {
      Vec16 bv[kVecs];
      for (int64_t v = 0; v < kVecs; ++v) bv[v] = load16(b + t * kCols + v * kVec);
      for (int64_t i = 0; i < kRows; ++i) {
        const Vec16 ai = splat(a[t * kRows + i]);
        for (int64_t v = 0; v < kVecs; ++v) acc[i][v] += ai * bv[v];
      }
    }
    float values[kRows * kCols];
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t v = 0; v < kVecs; ++v) store16(values + i * kCols + v * kVec, acc[i][v]);
    const int64_t row0 = rp * kRows, col0 = cp * kCols;
    store_tile<T>(p, row0, col0, smaller(kRows, p.rows - row0), smaller(kCols, p.cols - col0), values, kCols);
  }
}

// ---- AMX path ----

// Whether the AMX path reads A in place: row-major with the depth contiguous and a whole number of depth steps. Only
// a last partial block of 32 rows is then copied (zero-padded), so that no tile reads past the operand.
bool amx_a_in_place(const MatmulProblem& p) { return p.a_stride[1] == 1 && p.depth % kAmxBlock == 0; }

#ifdef TITAN_GROUPED_MM_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// (GCC 12 warns inside its own unpack intrinsics, whose pass-through operand is deliberately undefined.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// dst row i (64 bytes at dst + i * dst_row_bytes) = the i-th 32-bit value of each of 16 source rows (src + r *
// src_row_bytes, 64 bytes each): a 16 x 16 transpose of 32-bit values (bf16 pairs).
inline void transpose_16x16_pairs(const void* src, int64_t src_row_bytes, void* dst, int64_t dst_row_bytes = 64) {
  const char* base = static_cast<const char*>(src);
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(base + i * src_row_bytes);
  // Within each 128-bit lane: 32-bit interleaves of row pairs, then 64-bit interleaves of those.
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4g + k] now holds, in 128-bit lane L, the values of column 4L + k of source rows 4g..4g+3. Gather the lanes:
  // output row 4L + k takes lane L of r[k], r[4 + k], r[8 + k], r[12 + k].
  for (int k = 0; k < 4; ++k) {
    const __m512i a = r[k], b = r[4 + k], c = r[8 + k], d = r[12 + k];
    const __m512i ab_lo = _mm512_shuffle_i32x4(a, b, 0x44), ab_hi = _mm512_shuffle_i32x4(a, b, 0xee);  // a0 a1 b0 b1 | a2 a3 b2 b3
    const __m512i cd_lo = _mm512_shuffle_i32x4(c, d, 0x44), cd_hi = _mm512_shuffle_i32x4(c, d, 0xee);
    t[k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);       // a0 b0 c0 d0: lane 0
    t[4 + k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xdd);   // a1 b1 c1 d1: lane 1
    t[8 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);   // lane 2
    t[12 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xdd);  // lane 3
  }
  char* out = reinterpret_cast<char*>(dst);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * dst_row_bytes, t[i]);
}
#pragma GCC diagnostic pop

void pack_amx(const MatmulProblem& p, uint16_t* a_packed, uint16_t* b_packed) {
  const int64_t rows_padded = round_up(p.rows, kAmxBlock), cols_padded = round_up(p.cols, kAmxBlock);
  const int64_t depth = p.depth, depth_padded = round_up(depth, kAmxBlock);
  const auto* a = static_cast<const uint16_t*>(p.a);
  const auto* b = static_cast<const uint16_t*>(p.b);
  // A row-major, depth contiguous, zero-padded to depth_padded columns and rows_padded rows.
  if (amx_a_in_place(p)) {
    const int64_t full = p.rows / kAmxBlock * kAmxBlock;
    if (full < p.rows) {
      std::memset(a_packed, 0, 2 * kAmxBlock * depth_padded);
      for (int64_t i = full; i < p.rows; ++i)
        std::memcpy(a_packed + (i - full) * depth_padded, a + i * p.a_stride[0], 2 * depth);
    }
  } else if (p.a_stride[1] == 1) {
    for (int64_t i = 0; i < p.rows; ++i) {
      std::memcpy(a_packed + i * depth_padded, a + i * p.a_stride[0], 2 * depth);
      std::memset(a_packed + i * depth_padded + depth, 0, 2 * (depth_padded - depth));
    }
  } else {  // a transposed operand: 32 x 32 blocks through a buffer in L1, whole cache lines read and written
    std::memset(a_packed, 0, 2 * p.rows * depth_padded);
    uint16_t block[32][32];
    for (int64_t i0 = 0; i0 < p.rows; i0 += 32) {
      const int64_t ni = smaller(32, p.rows - i0);
      for (int64_t t0 = 0; t0 < depth; t0 += 32) {
        const int64_t nt = smaller(32, depth - t0);
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t i = 0; i < ni; ++i) block[i][t] = a[(i0 + i) * p.a_stride[0] + (t0 + t) * p.a_stride[1]];
        for (int64_t i = 0; i < ni; ++i) std::memcpy(a_packed + (i0 + i) * depth_padded + t0, block[i], 2 * nt);
      }
    }
  }
  if (!amx_a_in_place(p)) std::memset(a_packed + p.rows * depth_padded, 0, 2 * (rows_padded - p.rows) * depth_padded);
  // B per 16 columns as depth pairs: [depth_padded / 2][16][2], zeros past either edge.
  for (int64_t first = 0; first < cols_padded; first += 16) {
    uint16_t* out = b_packed + (first / 16) * (depth_padded / 2) * 32;
    const int64_t n = first < p.cols ? smaller(16, p.cols - first) : 0;
    int64_t t = 0;
    // 16 columns whose pairs are adjacent in memory (rows of a transposed operand): 16 pairs of each at once, as a
    // transpose of 16 x 16 32-bit values in registers.
    if (n == 16 && p.b_stride[0] == 1)
      for (; t + 32 <= depth; t += 32, out += 16 * 32)
        transpose_16x16_pairs(b + first * p.b_stride[1] + t, 2 * p.b_stride[1], out);
    for (; t < depth_padded; t += 2, out += 32) {
      const bool second = t + 1 < depth;
      if (n == 16 && second && p.b_stride[1] == 1) {  // two rows of 16 adjacent values, interleaved
        const uint16_t* r0 = b + t * p.b_stride[0] + first;
        const uint16_t* r1 = r0 + p.b_stride[0];
        for (int64_t j = 0; j < 16; ++j) {
          out[2 * j] = r0[j];
          out[2 * j + 1] = r1[j];
        }
      } else if (n == 16 && second && p.b_stride[0] == 1) {  // 16 columns, each a pair of adjacent values
        for (int64_t j = 0; j < 16; ++j) {
          uint32_t pair;
          std::memcpy(&pair, b + (first + j) * p.b_stride[1] + t, 4);
          std::memcpy(out + 2 * j, &pair, 4);
        }
      } else {
        for (int64_t j = 0; j < 16; ++j) {
          const bool inside = j < n && t < depth;
          out[2 * j] = inside ? b[t * p.b_stride[0] + (first + j) * p.b_stride[1]] : 0;
          out[2 * j + 1] = inside && second ? b[(t + 1) * p.b_stride[0] + (first + j) * p.b_stride[1]] : 0;
        }
      }
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void tiles_amx(const MatmulProblem& p, const uint16_t* a_packed,
                                                             const uint16_t* b_packed, int64_t begin, int64_t end) {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = 16;
    config.bytes_per_row[tile] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t col_blocks = round_up(p.cols, kAmxBlock) / kAmxBlock, depth_padded = round_up(p.depth, kAmxBlock);
  const bool in_place = amx_a_in_place(p);
  alignas(64) float values[4][16][16];
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t rb = tile / col_blocks, cb = tile % col_blocks;  // a row block's A stays in L1 across its columns
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a = a_packed + rb * kAmxBlock * depth_padded;
    int64_t a_row = depth_padded;  // elements between A's rows
    if (in_place) {
      const bool full = (rb + 1) * kAmxBlock <= p.rows;
      a = full ? static_cast<const uint16_t*>(p.a) + rb * kAmxBlock * p.a_stride[0] : a_packed;
      a_row = full ? p.a_stride[0] : depth_padded;
    }
    const int64_t a_row_bytes = 2 * a_row;
    const uint16_t* b = b_packed + (cb * 2) * (depth_padded / 2) * 32;
    const int64_t b_next = (depth_padded / 2) * 32;  // the next 16 columns
    for (int64_t t = 0; t < depth_padded; t += kAmxBlock) {
      _tile_loadd(4, a + t, a_row_bytes);
      _tile_loadd(5, a + 16 * a_row + t, a_row_bytes);
      _tile_loadd(6, b + (t / 2) * 32, 64);
      _tile_loadd(7, b + b_next + (t / 2) * 32, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, values[0], 64);
    _tile_stored(1, values[1], 64);
    _tile_stored(2, values[2], 64);
    _tile_stored(3, values[3], 64);
    for (int quarter = 0; quarter < 4; ++quarter) {
      const int64_t row0 = rb * kAmxBlock + (quarter / 2) * 16, col0 = cb * kAmxBlock + (quarter % 2) * 16;
      if (row0 >= p.rows || col0 >= p.cols) continue;
      store_tile<uint16_t>(p, row0, col0, smaller(16, p.rows - row0), smaller(16, p.cols - col0),
                           &values[quarter][0][0], 16);
    }
  }
  _tile_release();
}
#endif

// ---- dot path ----

#ifdef TITAN_GROUPED_MM_DOT
// (GCC 12 warns inside its own intrinsics, as above.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
int64_t pair_steps(int64_t depth) { return (depth + 1) / 2; }
uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16; }

// Lanes adjacent in memory (lane_stride 1): for each depth pair, up to 16 lanes of both depths at a time, widened and
// interleaved; panels in blocks of kPanelBlock, so that each source row is read once, in order, for a whole block.
template <int64_t kLanes>
void pack_adjacent_lanes(const uint16_t* src, int64_t lanes_total, int64_t depth, int64_t depth_stride, uint32_t* out) {
  constexpr int64_t kPanelBlock = 16;
  const int64_t steps = pair_steps(depth), panels = round_up(lanes_total, kLanes) / kLanes;
  for (int64_t block = 0; block < panels; block += kPanelBlock) {
    const int64_t block_end = smaller(panels, block + kPanelBlock);
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* r0 = src + 2 * s * depth_stride;
      const uint16_t* r1 = r0 + depth_stride;
      const bool second = 2 * s + 1 < depth;
      for (int64_t panel = block; panel < block_end; ++panel) {
        const int64_t first = panel * kLanes, n = smaller(kLanes, lanes_total - first);
        uint32_t* words_out = out + panel * steps * kLanes + s * kLanes;
        for (int64_t g = 0; g < kLanes; g += 16) {
          const int64_t m = g < n ? smaller(16, n - g) : 0;  // lanes to read; the group's other words are zero
          const auto mask = static_cast<__mmask16>((1u << m) - 1u);
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, r0 + first + g));
          const __m512i hi = second ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, r1 + first + g))
                                    : _mm512_setzero_si512();
          const __m512i words = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
          if (g + 16 <= kLanes) _mm512_storeu_si512(words_out + g, words);
          else _mm512_mask_storeu_epi32(words_out + g, static_cast<__mmask16>((1u << (kLanes - g)) - 1u), words);
        }
      }
    }
  }
}

// Copies a bf16 operand into panels of kLanes rows (A) or columns (B), each panel pair-major: word (s, l) holds lane
// l's values at depths 2s (low half) and 2s + 1 (high half), zeros past either edge. `lane_stride` steps between
// lanes, `depth_stride` between depths.
template <int64_t kLanes>
void pack_pair_panels(const uint16_t* src, int64_t lanes_total, int64_t depth, int64_t lane_stride, int64_t depth_stride,
                      uint32_t* out) {
  if (lane_stride == 1) return pack_adjacent_lanes<kLanes>(src, lanes_total, depth, depth_stride, out);
  const int64_t steps = pair_steps(depth), full = depth / 2;
  for (int64_t first = 0; first < lanes_total; first += kLanes, out += steps * kLanes) {
    const int64_t n = smaller(kLanes, lanes_total - first);
    const uint16_t* panel = src + first * lane_stride;
    int64_t s = 0;
    if (n == kLanes && depth_stride == 1) {  // each lane's pairs adjacent
      if constexpr (kLanes % 16 == 0) {      // 16 lanes x 16 pairs at a time, transposed in registers
        for (; s + 16 <= full; s += 16)
          for (int64_t g = 0; g < kLanes; g += 16)
            transpose_16x16_pairs(panel + g * lane_stride + 2 * s, 2 * lane_stride, out + s * kLanes + g, 4 * kLanes);
      }
      for (; s < full; ++s)  // one word per lane
        for (int64_t l = 0; l < kLanes; ++l) std::memcpy(out + s * kLanes + l, panel + l * lane_stride + 2 * s, 4);
    }
    for (; s < steps; ++s) {
      const bool second = 2 * s + 1 < depth;
      for (int64_t l = 0; l < kLanes; ++l) {
        const uint16_t* v = panel + l * lane_stride + 2 * s * depth_stride;
        out[s * kLanes + l] = l < n ? bf16_pair(v[0], second ? v[depth_stride] : 0) : 0u;
      }
    }
  }
}

// Whether the dot path reads A in place: each row's depths contiguous, whole pairs, every row starting on a pair's
// 4-byte boundary. Only a last partial panel of rows is then copied (zero-padded), so that no tile reads past A.
bool dot_a_in_place(const MatmulProblem& p) {
  return p.a_stride[1] == 1 && p.depth % 2 == 0 && p.a_stride[0] % 2 == 0 && reinterpret_cast<uintptr_t>(p.a) % 4 == 0;
}

// The A rows the dot path copies: all of them, or the last partial panel when A is read in place.
int64_t dot_a_rows_packed(const MatmulProblem& p) {
  return !dot_a_in_place(p) ? round_up(p.rows, kDotRows) : (p.rows % kDotRows ? kDotRows : 0);
}

void pack_dot(const MatmulProblem& p, uint32_t* a_packed, uint32_t* b_packed, int64_t part, int64_t parts) {
  const int64_t a_first = dot_a_in_place(p) ? p.rows / kDotRows * kDotRows : 0;  // the rows A's copy starts at
  const int64_t steps = pair_steps(p.depth);
  const PanelSlice slice =
      panel_slice(round_up(p.rows - a_first, kDotRows) / kDotRows, round_up(p.cols, kDotCols) / kDotCols, part, parts);
  const auto* a = static_cast<const uint16_t*>(p.a) + (a_first + slice.a_begin * kDotRows) * p.a_stride[0];
  const auto* b = static_cast<const uint16_t*>(p.b) + slice.b_begin * kDotCols * p.b_stride[1];
  if (slice.a_end > slice.a_begin)
    pack_pair_panels<kDotRows>(a, smaller(p.rows - a_first, slice.a_end * kDotRows) - slice.a_begin * kDotRows, p.depth,
                               p.a_stride[0], p.a_stride[1], a_packed + slice.a_begin * kDotRows * steps);
  if (slice.b_end > slice.b_begin)
    pack_pair_panels<kDotCols>(b, smaller(p.cols, slice.b_end * kDotCols) - slice.b_begin * kDotCols, p.depth,
                               p.b_stride[1], p.b_stride[0], b_packed + slice.b_begin * kDotCols * steps);
}

// Tiles in the vector path's order (tile_panels).
void tiles_dot(const MatmulProblem& p, const uint32_t* a_packed, const uint32_t* b_packed, int64_t begin, int64_t end) {
  const int64_t row_panels = round_up(p.rows, kDotRows) / kDotRows, col_panels = round_up(p.cols, kDotCols) / kDotCols;
  const int64_t steps = pair_steps(p.depth);
  const bool in_place = dot_a_in_place(p);
  for (int64_t tile = begin; tile < end; ++tile) {
    const auto [rp, cp] = tile_panels(tile, row_panels, col_panels);
    // A's words: (row i, step s) at a[i * a_row + s * a_step], packed or in place.
    const uint32_t* a = a_packed + rp * steps * kDotRows;
    int64_t a_row = 1, a_step = kDotRows;
    if (in_place && (rp + 1) * kDotRows <= p.rows) {
      a = static_cast<const uint32_t*>(p.a) + rp * kDotRows * (p.a_stride[0] / 2);
      a_row = p.a_stride[0] / 2, a_step = 1;
    } else if (in_place) {
      a = a_packed;
    }
    const uint32_t* b = b_packed + cp * steps * kDotCols;
    __m512 acc[kDotRows][kDotVecs];
    for (int64_t i = 0; i < kDotRows; ++i)
      for (int64_t v = 0; v < kDotVecs; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t s = 0; s < steps; ++s) {
      __m512bh bv[kDotVecs];
      for (int64_t v = 0; v < kDotVecs; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + s * kDotCols + v * kVec);
      for (int64_t i = 0; i < kDotRows; ++i) {
        uint32_t word;  // (through memcpy: A read in place is bf16 data)
        std::memcpy(&word, a + i * a_row + s * a_step, 4);
        const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
        for (int64_t v = 0; v < kDotVecs; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
      }
    }
    alignas(64) float values[kDotRows * kDotCols];
    for (int64_t i = 0; i < kDotRows; ++i)
      for (int64_t v = 0; v < kDotVecs; ++v) _mm512_store_ps(values + i * kDotCols + v * kVec, acc[i][v]);
    const int64_t row0 = rp * kDotRows, col0 = cp * kDotCols;
    store_tile<uint16_t>(p, row0, col0, smaller(kDotRows, p.rows - row0), smaller(kDotCols, p.cols - col0), values,
                         kDotCols);
  }
}
#pragma GCC diagnostic pop
#endif

#ifndef TITAN_GROUPED_MM_AMX
[[noreturn]] void no_amx() { __builtin_trap(); }  // the dispatcher never asks a copy without AMX code for it
#endif

}  // namespace

void matmul_packing(const MatmulProblem& p, bool bf16, bool amx, MatmulPacking* packing) {
  MatmulPacking& out = *packing;
  if (amx) {
    const int64_t depth_padded = round_up(p.depth, kAmxBlock);
    const int64_t a_rows = !amx_a_in_place(p) ? round_up(p.rows, kAmxBlock) : (p.rows % kAmxBlock ? kAmxBlock : 0);
    out.a_bytes = align64(2 * a_rows * depth_padded);
    out.b_bytes = align64(2 * round_up(p.cols, kAmxBlock) * depth_padded);
    out.tiles = round_up(p.rows, kAmxBlock) / kAmxBlock * (round_up(p.cols, kAmxBlock) / kAmxBlock);
    return;
  }
#ifdef TITAN_GROUPED_MM_DOT
  if (bf16) {
    const int64_t steps = pair_steps(p.depth);
    out.a_bytes = align64(4 * dot_a_rows_packed(p) * steps);
    out.b_bytes = align64(4 * round_up(p.cols, kDotCols) * steps);
    out.tiles = round_up(p.rows, kDotRows) / kDotRows * (round_up(p.cols, kDotCols) / kDotCols);
    return;
  }
#endif
  out.a_bytes = align64(4 * round_up(p.rows, kRows) * p.depth);
  out.b_bytes = align64(4 * round_up(p.cols, kCols) * p.depth);
  out.tiles = round_up(p.rows, kRows) / kRows * (round_up(p.cols, kCols) / kCols);
}

void matmul_pack(const MatmulProblem& p, bool bf16, bool amx, void* a_packed, void* b_packed, int64_t part,
                 int64_t parts) {
  if (amx) {
#ifdef TITAN_GROUPED_MM_AMX
    if (part == 0) pack_amx(p, static_cast<uint16_t*>(a_packed), static_cast<uint16_t*>(b_packed));  // not sliced
    return;
#else
    no_amx();
#endif
  }
#ifdef TITAN_GROUPED_MM_DOT
  if (bf16) return pack_dot(p, static_cast<uint32_t*>(a_packed), static_cast<uint32_t*>(b_packed), part, parts);
#endif
  if (bf16) pack_vector<uint16_t>(p, static_cast<float*>(a_packed), static_cast<float*>(b_packed), part, parts);
  else pack_vector<float>(p, static_cast<float*>(a_packed), static_cast<float*>(b_packed), part, parts);
}

void matmul_tiles(const MatmulProblem& p, bool bf16, bool amx, const void* a_packed, const void* b_packed, int64_t begin,
                  int64_t end) {
  if (amx) {
#ifdef TITAN_GROUPED_MM_AMX
    tiles_amx(p, static_cast<const uint16_t*>(a_packed), static_cast<const uint16_t*>(b_packed), begin, end);
    return;
#else
    no_amx();
#endif
  }
#ifdef TITAN_GROUPED_MM_DOT
  if (bf16)
    return tiles_dot(p, static_cast<const uint32_t*>(a_packed), static_cast<const uint32_t*>(b_packed), begin, end);
#endif
  const float *a = static_cast<const float*>(a_packed), *b = static_cast<const float*>(b_packed);
  if (bf16) tiles_vector<uint16_t>(p, a, b, begin, end);
  else tiles_vector<float>(p, a, b, begin, end);
}

}  // namespace titan::kernels::isa::TITAN_ISA
