// Scalar helpers the per-instruction-set kernels are written with: bf16 conversion and exp/log/silu in forms the
// compiler vectorises. Everything here has internal linkage, so each compiled copy keeps its own.
#pragma once
#include <cstdint>
#include <cstring>

#ifndef TITAN_ISA
#error "kernels/isa sources are compiled once per instruction set with TITAN_ISA set (see CMakeLists.txt)"
#endif

namespace titan::kernels::isa::TITAN_ISA {
namespace {

constexpr float kNegInf = -__builtin_inff();

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as PyTorch converts float to bf16; NaN stays a (quiet) NaN.
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  *p = static_cast<uint16_t>(nan ? ((bits >> 16) | 0x40u) : rounded);
}

// e^x within ~2 ulp for x in [-87, 88], exactly 0 below -87 (masked scores are -inf), NaN for NaN.
inline float exp_approx(float x) {
  // (NaN is clamped to 0 here so that the conversion to int below is defined; the result is NaN again at the end.)
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : (x != x ? 0.0f : x));
  // n = round(x / ln 2) through the 1.5 * 2^23 rounding constant; r = x - n ln 2 in two parts.
  const float n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &exponent_bits, sizeof two_n);
  const float e = p * two_n;
  return x < -87.0f ? 0.0f : (x != x ? x : e);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

// A vector of 16 floats (GCC vector extensions): one AVX-512 register, two AVX2 or four SSE registers, as the
// copy being compiled has.
typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));
constexpr int64_t kVec = 16;

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof v); }
// 16 bf16 values (bit patterns) widened to float, and float rounded to bf16 as store() does.
typedef uint16_t Half16 __attribute__((vector_size(32)));
typedef uint32_t Uint16x __attribute__((vector_size(64)));
inline Vec16 load16(const uint16_t* p) {
  Half16 h;
  std::memcpy(&h, p, sizeof h);
  const Uint16x bits = __builtin_convertvector(h, Uint16x) << 16;
  Vec16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline void store16(uint16_t* p, Vec16 v) {
  Uint16x bits;
  std::memcpy(&bits, &v, sizeof bits);
  const Uint16x rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const Uint16x quiet = (bits >> 16) | 0x40u;
  const Uint16x out = (bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
  const Half16 h = __builtin_convertvector(out, Half16);
  std::memcpy(p, &h, sizeof h);
}
// Pair shuffles for RoPE's interleaved (even, odd) pairs: (v0, v0, v2, v2, ...), (v1, v1, v3, v3, ...) and
// (v1, v0, v3, v2, ...), in GCC's and Clang's spellings.
#if defined(__clang__)
inline Vec16 even_lanes_twice(Vec16 v) { return __builtin_shufflevector(v, v, 0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14); }
inline Vec16 odd_lanes_twice(Vec16 v) { return __builtin_shufflevector(v, v, 1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15); }
inline Vec16 swap_pairs(Vec16 v) { return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); }
#else
inline Vec16 even_lanes_twice(Vec16 v) { return __builtin_shuffle(v, Int16{0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14}); }
inline Vec16 odd_lanes_twice(Vec16 v) { return __builtin_shuffle(v, Int16{1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15}); }
inline Vec16 swap_pairs(Vec16 v) { return __builtin_shuffle(v, Int16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}); }
#endif

inline Vec16 splat(float x) { return Vec16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return a > b ? a : b; }
inline float hmax(Vec16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline float hsum(Vec16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
// exp_approx on 16 values at once.
inline Vec16 exp16(Vec16 x) {
  const Vec16 lo = splat(-87.0f), hi = splat(88.0f);
  Vec16 clamped = x < lo ? lo : x;
  clamped = clamped > hi ? hi : clamped;
  clamped = x != x ? splat(0.0f) : clamped;  // NaN: a defined conversion to int below; the result is NaN again
  const Vec16 n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;
  const Vec16 r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
  Vec16 p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Int16 exponent_bits = (__builtin_convertvector(n, Int16) + 127) << 23;
  Vec16 two_n;
  std::memcpy(&two_n, &exponent_bits, sizeof two_n);
  const Vec16 e = p * two_n;
  const Vec16 result = x != x ? x : e;
  return x < lo ? splat(0.0f) : result;
}

// Reductions written as kLanes independent partial results, which the compiler keeps in one vector register
// without reassociating a single sum (it may not, without -ffast-math); the lanes are combined at the end.
constexpr int64_t kLanes = 16;

inline float sum_lanes(const float* part) {
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += part[l];
  return total;
}

// sum of a[i] * b[i] over n values.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[i + l] * b[i + l];
  float total = sum_lanes(part);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

}  // namespace
}  // namespace titan::kernels::isa::TITAN_ISA
