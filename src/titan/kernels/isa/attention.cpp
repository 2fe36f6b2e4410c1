// Causal / block-causal attention with an online softmax (the flash-attention algorithm) in float32, forward and
// backward, for one instruction set. Queries are taken in blocks of 64 rows against blocks of 64 keys; scores are
// computed against a transposed key block so that the innermost loops run along contiguous keys (or head_dim) and
// vectorise. Head dims 16, 32, 64, 128 and 192 (DeepSeek-V3's latent attention) get their own instantiations
// (constant loop bounds); others run the general one. The copy built with AVX-512 BF16 runs bf16 inputs on the bf16 dot-product instruction instead (below).
#include "titan/kernels/isa/kernels.h"
#include "titan/kernels/isa/scalar_math.h"

#include <cstring>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace titan::kernels::isa::TITAN_ISA {
namespace {

constexpr int64_t kBlock = kAttentionBlock;  // queries per block and keys per block

struct Range {
  int64_t begin = 0, end = 0;
};

// The keys query rows [i0, i0 + rows) may see: up to the last row (causal), from the first row's document on.
Range visible_keys(const AttentionShape& a, const int32_t* documents, int64_t i0, int64_t rows) {
  Range r{0, i0 + rows};
  if (documents) {
    const int32_t first = documents[i0];
    int64_t lo = 0, hi = i0;  // first position whose document is >= the first row's (documents are non-decreasing)
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (documents[mid] < first) lo = mid + 1;
      else hi = mid;
    }
    r.begin = lo;
  }
  return r;
}

template <typename T>
const T* row(const T* base, const int64_t* stride, int64_t b, int64_t s, int64_t h) {
  return base + b * stride[0] + s * stride[1] + h * stride[2];
}
template <typename T>
T* row(T* base, const int64_t* stride, int64_t b, int64_t s, int64_t h) {
  return base + b * stride[0] + s * stride[1] + h * stride[2];
}

// Scratch blocks of one work range, allocated (zeroed) once per call.
template <typename E = float>
struct Scratch {
  explicit Scratch(int64_t count) : data(new E[static_cast<size_t>(count)]()) {}
  ~Scratch() { delete[] data; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  E* data;
};

// key_t (D x kBlock): keys of block [j0, j0 + cols) transposed, zero past cols; values (kBlock x D) likewise.
template <int64_t kD, typename T>
void load_key_block(const AttentionShape& a, const T* k, const int64_t* stride, int64_t b, int64_t hk, int64_t j0,
                    int64_t cols, float* key_t, float* rows_out) {
  const int64_t D = kD ? kD : a.head_dim;
  for (int64_t c = 0; c < kBlock; ++c) {
    if (c < cols) {
      const T* src = row(k, stride, b, j0 + c, hk);
      for (int64_t d = 0; d < D; ++d) {
        const float v = to_float(src[d]);
        if (key_t) key_t[d * kBlock + c] = v;
        if (rows_out) rows_out[c * D + d] = v;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        if (key_t) key_t[d * kBlock + c] = 0.0f;
        if (rows_out) rows_out[c * D + d] = 0.0f;
      }
    }
  }
}

// scores[c] = sum_d q[d] * key_t[d][c] for the kBlock keys of a block.
inline void row_scores(const float* q, const float* key_t, int64_t D, float* scores) {
  float acc[kBlock];
  for (int64_t c = 0; c < kBlock; ++c) acc[c] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float qd = q[d];
    const float* kt = key_t + d * kBlock;
    for (int64_t c = 0; c < kBlock; ++c) acc[c] += qd * kt[c];
  }
  for (int64_t c = 0; c < kBlock; ++c) scores[c] = acc[c];
}

// Sets scores[c] to -inf where key j0 + c is not visible from query i.
inline void mask_scores(const int32_t* documents, int64_t i, int64_t j0, int64_t cols, float* scores) {
  const int64_t limit = i - j0 + 1 < cols ? i - j0 + 1 : cols;  // keys past the query are hidden (causal)
  for (int64_t c = 0; c < kBlock; ++c) scores[c] = c < limit ? scores[c] : kNegInf;
  if (documents && documents[j0] != documents[i]) {  // only a block that starts in an earlier document needs this
    const int32_t doc = documents[i];
    for (int64_t c = 0; c < limit; ++c) scores[c] = documents[j0 + c] == doc ? scores[c] : kNegInf;
  }
}

// The largest of the kBlock scores and `init`.
inline float block_max(const float* scores, float init) {
  float part[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) part[l] = init;
  for (int64_t c = 0; c < kBlock; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] = scores[c + l] > part[l] ? scores[c + l] : part[l];
  float m = init;
  for (int64_t l = 0; l < kLanes; ++l) m = part[l] > m ? part[l] : m;
  return m;
}

// scores[c] = e^(scores[c] - shift); returns their sum.
inline float exp_block(float* scores, float shift) {
  for (int64_t c = 0; c < kBlock; ++c) scores[c] = exp_approx(scores[c] - shift);
  float part[kLanes] = {};
  for (int64_t c = 0; c < kBlock; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += scores[c + l];
  return sum_lanes(part);
}

// The general forms, for any head_dim (those without a vectorised instantiation below).
template <typename T>
void forward_impl(const AttentionShape& a, const T* q, const T* k, const T* v, T* out, float* lse, int64_t begin,
                  int64_t end) {
  const int64_t D = a.head_dim, S = a.seq, H = a.heads, group = a.heads / a.kv_heads;
  const int64_t blocks = (S + kBlock - 1) / kBlock;
  Scratch<> scratch(kBlock * D * 4 + kBlock * 4);
  float* qs = scratch.data;            // kBlock x D, scaled queries
  float* key_t = qs + kBlock * D;      // D x kBlock
  float* values = key_t + kBlock * D;  // kBlock x D
  float* acc = values + kBlock * D;    // kBlock x D, unnormalised outputs
  float* row_max = acc + kBlock * D;   // kBlock
  float* row_sum = row_max + kBlock;   // kBlock
  float* scores = row_sum + kBlock;    // kBlock
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / (H * blocks), h = (item / blocks) % H, qb = item % blocks, hk = h / group;
    const int64_t i0 = qb * kBlock, rows = S - i0 < kBlock ? S - i0 : kBlock;
    const int32_t* documents = a.documents ? a.documents + b * S : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = row(q, a.q_stride, b, i0 + r, h);
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] = to_float(src[d]) * a.scale;
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
      row_max[r] = kNegInf;
      row_sum[r] = 0.0f;
    }
    const Range keys = visible_keys(a, documents, i0, rows);
    for (int64_t j0 = keys.begin / kBlock * kBlock; j0 < keys.end; j0 += kBlock) {
      const int64_t cols = keys.end - j0 < kBlock ? keys.end - j0 : kBlock;
      load_key_block<0>(a, k, a.k_stride, b, hk, j0, cols, key_t, nullptr);
      load_key_block<0>(a, v, a.v_stride, b, hk, j0, cols, nullptr, values);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        row_scores(qs + r * D, key_t, D, scores);
        mask_scores(documents, i, j0, cols, scores);
        const float m = block_max(scores, row_max[r]);
        if (m == kNegInf) continue;  // nothing visible yet in this row
        const float rescale = exp_approx(row_max[r] - m);
        const float sum = exp_block(scores, m);
        row_max[r] = m;
        row_sum[r] = row_sum[r] * rescale + sum;
        float* orow = acc + r * D;
        for (int64_t d = 0; d < D; ++d) orow[d] *= rescale;
        for (int64_t c = 0; c < cols; ++c) {
          const float p = scores[c];
          const float* vr = values + c * D;
          for (int64_t d = 0; d < D; ++d) orow[d] += p * vr[d];
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / row_sum[r];
      T* dst = row(out, a.out_stride, b, i0 + r, h);
      for (int64_t d = 0; d < D; ++d) store(dst + d, acc[r * D + d] * inv);
      lse[(b * H + h) * S + i0 + r] = row_max[r] + __builtin_logf(row_sum[r]);
    }
  }
}

template <typename T>
void backward_impl(const AttentionShape& a, const T* q, const T* k, const T* v, const T* out, const T* grad_out,
                   const float* lse, T* grad_q, T* grad_k, T* grad_v, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim, S = a.seq, H = a.heads, HK = a.kv_heads, group = a.heads / a.kv_heads;
  const int64_t blocks = (S + kBlock - 1) / kBlock;
  Scratch<> scratch(S * D * 3 + kBlock * D * 6 + kBlock * kBlock * 2 + kBlock * 4 + D);
  float* dk_acc = scratch.data;          // S x D
  float* dv_acc = dk_acc + S * D;        // S x D
  float* dq_acc = dv_acc + S * D;        // S x D
  float* qs = dq_acc + S * D;            // kBlock x D, scaled queries
  float* dout = qs + kBlock * D;         // kBlock x D
  float* key_t = dout + kBlock * D;      // D x kBlock
  float* value_t = key_t + kBlock * D;   // D x kBlock
  float* keys = value_t + kBlock * D;    // kBlock x D
  float* dq_row = keys + kBlock * D;     // kBlock x D (spare row buffer)
  float* probs = dq_row + kBlock * D;    // kBlock x kBlock
  float* dscores = probs + kBlock * kBlock;  // kBlock x kBlock
  float* delta = dscores + kBlock * kBlock;  // kBlock
  float* row_lse = delta + kBlock;           // kBlock
  float* tmp = row_lse + kBlock;             // kBlock
  float* tmp_row = tmp + kBlock;             // D
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / HK, hk = item % HK;
    const int32_t* documents = a.documents ? a.documents + b * S : nullptr;
    for (int64_t x = 0; x < S * D; ++x) dk_acc[x] = 0.0f, dv_acc[x] = 0.0f;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t x = 0; x < S * D; ++x) dq_acc[x] = 0.0f;
      for (int64_t qb = 0; qb < blocks; ++qb) {
        const int64_t i0 = qb * kBlock, rows = S - i0 < kBlock ? S - i0 : kBlock;
        for (int64_t r = 0; r < rows; ++r) {
          const T* qsrc = row(q, a.q_stride, b, i0 + r, h);
          const T* gsrc = row(grad_out, a.grad_out_stride, b, i0 + r, h);
          const T* osrc = row(out, a.out_stride, b, i0 + r, h);
          for (int64_t d = 0; d < D; ++d) {
            qs[r * D + d] = to_float(qsrc[d]) * a.scale;
            dout[r * D + d] = to_float(gsrc[d]);
            tmp_row[d] = to_float(osrc[d]);
          }
          delta[r] = dot(dout + r * D, tmp_row, D);
          row_lse[r] = lse[(b * H + h) * S + i0 + r];
        }
        const Range visible = visible_keys(a, documents, i0, rows);
        for (int64_t j0 = visible.begin / kBlock * kBlock; j0 < visible.end; j0 += kBlock) {
          const int64_t cols = visible.end - j0 < kBlock ? visible.end - j0 : kBlock;
          load_key_block<0>(a, k, a.k_stride, b, hk, j0, cols, key_t, keys);
          load_key_block<0>(a, v, a.v_stride, b, hk, j0, cols, value_t, nullptr);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            float* p = probs + r * kBlock;
            float* ds = dscores + r * kBlock;
            row_scores(qs + r * D, key_t, D, p);
            mask_scores(documents, i, j0, cols, p);
            const float l = row_lse[r];
            for (int64_t c = 0; c < kBlock; ++c) p[c] = exp_approx(p[c] - l);  // masked: exactly 0
            row_scores(dout + r * D, value_t, D, tmp);  // dP = dO V^T
            const float dl = delta[r];
            for (int64_t c = 0; c < kBlock; ++c) ds[c] = p[c] * (tmp[c] - dl);
            // dQ_i += scale * sum_c dS_ic K_c
            float* dq = dq_acc + i * D;
            for (int64_t c = 0; c < cols; ++c) {
              const float w = ds[c] * a.scale;
              const float* kr = keys + c * D;
              for (int64_t d = 0; d < D; ++d) dq[d] += w * kr[d];
            }
          }
          for (int64_t r = rows; r < kBlock; ++r)
            for (int64_t c = 0; c < kBlock; ++c) probs[r * kBlock + c] = 0.0f, dscores[r * kBlock + c] = 0.0f;
          // dK_c += sum_r dS_rc Qs_r;  dV_c += sum_r P_rc dO_r
          for (int64_t c = 0; c < cols; ++c) {
            float* dk = dk_acc + (j0 + c) * D;
            float* dv = dv_acc + (j0 + c) * D;
            for (int64_t r = 0; r < rows; ++r) {
              const float w = dscores[r * kBlock + c], pw = probs[r * kBlock + c];
              const float* qr = qs + r * D;
              const float* gr = dout + r * D;
              for (int64_t d = 0; d < D; ++d) {
                dk[d] += w * qr[d];
                dv[d] += pw * gr[d];
              }
            }
          }
        }
      }
      for (int64_t i = 0; i < S; ++i) {
        T* dst = row(grad_q, a.grad_q_stride, b, i, h);
        for (int64_t d = 0; d < D; ++d) store(dst + d, dq_acc[i * D + d]);
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      T* dk = row(grad_k, a.grad_k_stride, b, j, hk);
      T* dv = row(grad_v, a.grad_v_stride, b, j, hk);
      for (int64_t d = 0; d < D; ++d) store(dk + d, dk_acc[j * D + d]), store(dv + d, dv_acc[j * D + d]);
    }
  }
}

// The vectorised forms for head dims that are multiples of 16: a row's 64 scores are four Vec16 and its output or
// gradient rows kD / 16, summed in registers in passes of the sizes below.
constexpr int64_t kKeyVecs = kBlock / kVec;

// How the inner loops use the registers, so that each key (or value) vector loaded serves several rows:
//   kScoreRows:       query rows whose scores are computed together;
//   kAccumulatorVecs: Vec16 accumulators one pass keeps (scores or output rows of all the rows handled together);
//   kChunkVecs:       the most Vec16 of one output row's head_dim a pass accumulates; longer rows are summed in
//                     several passes, each re-reading the weights (scores likewise, kAccumulatorVecs / kScoreRows
//                     Vec16 of each row's 64 per pass).
// AVX-512 has 32 registers of 64 bytes: 4 rows and whole head dims up to 192. AVX2 has 16 of 32 bytes, two per Vec16:
// 4 rows one Vec16 at a time (8 registers of sums), measured 1.13-1.53x faster there (forward + backward, head dims
// 16-192) than one row of whole head dims, which overflowed the registers. The generic copy (SSE, four registers per Vec16) is fastest
// one row at a time.
#if defined(TITAN_ISA_WIDE_REGISTERS)
constexpr int64_t kScoreRows = 4, kAccumulatorVecs = 16, kChunkVecs = 16;
#elif defined(__AVX2__)
constexpr int64_t kScoreRows = 4, kAccumulatorVecs = 4, kChunkVecs = 1;
#else
constexpr int64_t kScoreRows = 1, kAccumulatorVecs = 4, kChunkVecs = 16;
#endif

// The Vec16 of a head_dim-kD row that one pass of accumulate_rows sums.
template <int64_t kD>
constexpr int64_t chunk_vecs() {
  return kD / kVec < kChunkVecs ? kD / kVec : kChunkVecs;
}

// How the inner products multiply and add. FloatFma: one float of a row times a vector of 16 floats per step.
struct FloatFma {
  using Word = float;
  using Operand = Vec16;
  static constexpr int64_t kPerWord = 1;  // a row's values per word
  static Vec16 load(const float* p) { return load16(p); }
  static Vec16 broadcast(float w) { return splat(w); }
  static Vec16 madd(Vec16 acc, Vec16 w, Vec16 v) { return acc + w * v; }
};

// s[r][x] = scale * (row r of `rows` . the 64 keys of key_t), for R rows kD / kPerWord words apart; key_t holds the
// block's 64 keys side by side, one word of each per step.
// (Accumulated in locals: the compiler cannot keep the output in registers while it may alias the inputs.)
template <typename Ops, int64_t kD, int64_t R>
__attribute__((always_inline)) inline void scores_rows(const typename Ops::Word* rows, const typename Ops::Word* key_t,
                                                       float scale, Vec16 (*s)[kKeyVecs]) {
  constexpr int64_t kSteps = kD / Ops::kPerWord;
  constexpr int64_t kKeyChunk = kKeyVecs * R <= kAccumulatorVecs ? kKeyVecs : kAccumulatorVecs / R;
  static_assert(kKeyChunk >= 1 && kKeyVecs % kKeyChunk == 0, "the keys are scored in whole chunks of vectors");
  for (int64_t x0 = 0; x0 < kKeyVecs; x0 += kKeyChunk) {
    Vec16 acc[R][kKeyChunk];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t x = 0; x < kKeyChunk; ++x) acc[r][x] = splat(0.0f);
    for (int64_t step = 0; step < kSteps; ++step) {
      typename Ops::Operand kt[kKeyChunk];
      for (int64_t x = 0; x < kKeyChunk; ++x) kt[x] = Ops::load(key_t + step * kBlock + (x0 + x) * kVec);
      for (int64_t r = 0; r < R; ++r) {
        const typename Ops::Operand w = Ops::broadcast(rows[r * kSteps + step]);
        for (int64_t x = 0; x < kKeyChunk; ++x) acc[r][x] = Ops::madd(acc[r][x], w, kt[x]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t x = 0; x < kKeyChunk; ++x) s[r][x0 + x] = scale == 1.0f ? acc[r][x] : acc[r][x] * scale;
  }
}

// out[r] += sum over c in [begin, end) of the word weights[r * out_stride + c * sum_stride] times the word row c of
// `rows` (kD words each), for R outputs of kD floats kD apart, kept in registers over the sum.
template <typename Ops, int64_t kD, int64_t R>
__attribute__((always_inline)) inline void accumulate_rows(const typename Ops::Word* weights, int64_t out_stride,
                                                           int64_t sum_stride, int64_t begin, int64_t end,
                                                           const typename Ops::Word* rows, float* out) {
  constexpr int64_t NV = kD / kVec, kChunk = chunk_vecs<kD>();
  static_assert(NV % kChunk == 0, "head_dim is summed in whole chunks of vectors");
  for (int64_t x0 = 0; x0 < NV; x0 += kChunk) {
    Vec16 o[R][kChunk];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t x = 0; x < kChunk; ++x) o[r][x] = load16(out + r * kD + (x0 + x) * kVec);
    for (int64_t c = begin; c < end; ++c) {
      typename Ops::Operand v[kChunk];
      for (int64_t x = 0; x < kChunk; ++x) v[x] = Ops::load(rows + c * kD + (x0 + x) * kVec);
      for (int64_t r = 0; r < R; ++r) {
        const typename Ops::Operand w = Ops::broadcast(weights[r * out_stride + c * sum_stride]);
        for (int64_t x = 0; x < kChunk; ++x) o[r][x] = Ops::madd(o[r][x], w, v[x]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t x = 0; x < kChunk; ++x) store16(out + r * kD + (x0 + x) * kVec, o[r][x]);
  }
}

// For rows [r, r + n) of a block: the end of the keys any of them sees (weights past a row's own end are zero).
inline int64_t longest(const int64_t* last, int64_t n) {
  int64_t m = 0;
  for (int64_t r = 0; r < n; ++r) m = last[r] > m ? last[r] : m;
  return m;
}

template <int64_t kD>
constexpr int64_t accumulate_rows_at_once() {
  constexpr int64_t n = kAccumulatorVecs / chunk_vecs<kD>();
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

// Hides keys after query i (causal) and, when the block starts in another document, keys of other documents.
inline void mask_vec(const int32_t* documents, int64_t i, int64_t j0, Vec16* s) {
  if (j0 + kBlock - 1 > i) {
    Int16 index;
    for (int l = 0; l < 16; ++l) index[l] = l;
    for (int64_t x = 0; x < kKeyVecs; ++x) {
      const Int16 key = index + static_cast<int32_t>(j0 + x * kVec);
      s[x] = key <= static_cast<int32_t>(i) ? s[x] : splat(kNegInf);
    }
  }
  if (documents && documents[j0] != documents[i]) {
    float buffer[kBlock];
    for (int64_t x = 0; x < kKeyVecs; ++x) store16(buffer + x * kVec, s[x]);
    const int64_t limit = i - j0 + 1 < kBlock ? i - j0 + 1 : kBlock;
    for (int64_t c = 0; c < limit; ++c)
      if (documents[j0 + c] != documents[i]) buffer[c] = kNegInf;
    for (int64_t x = 0; x < kKeyVecs; ++x) s[x] = load16(buffer + x * kVec);
  }
}

template <int64_t kD, typename T>
void forward_vec(const AttentionShape& a, const T* q, const T* k, const T* v, T* out, float* lse, int64_t begin,
                 int64_t end) {
  constexpr int64_t D = kD, NV = kD / kVec;
  const int64_t S = a.seq, H = a.heads, group = a.heads / a.kv_heads;
  const int64_t blocks = (S + kBlock - 1) / kBlock;
  Scratch<> scratch((kBlock + kScoreRows) * D + kBlock * D * 3 + kBlock * kBlock + kBlock * 3);
  float* qs = scratch.data;                        // kBlock (+ kScoreRows spare) x D, scaled queries
  float* key_t = qs + (kBlock + kScoreRows) * D;   // D x kBlock
  float* values = key_t + kBlock * D;              // kBlock x D
  float* acc = values + kBlock * D;                // kBlock x D, unnormalised outputs
  float* probs = acc + kBlock * D;                 // kBlock x kBlock
  float* row_max = probs + kBlock * kBlock;        // kBlock
  float* row_sum = row_max + kBlock;               // kBlock
  float* rescale = row_sum + kBlock;               // kBlock
  int64_t last[kBlock];                            // per row: keys of the block it sees
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / (H * blocks), h = (item / blocks) % H, qb = item % blocks, hk = h / group;
    const int64_t i0 = qb * kBlock, rows = S - i0 < kBlock ? S - i0 : kBlock;
    const int32_t* documents = a.documents ? a.documents + b * S : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = row(q, a.q_stride, b, i0 + r, h);
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] = to_float(src[d]) * a.scale;
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
      row_max[r] = kNegInf;
      row_sum[r] = 0.0f;
    }
    const Range keys = visible_keys(a, documents, i0, rows);
    for (int64_t j0 = keys.begin / kBlock * kBlock; j0 < keys.end; j0 += kBlock) {
      const int64_t cols = keys.end - j0 < kBlock ? keys.end - j0 : kBlock;
      load_key_block<kD>(a, k, a.k_stride, b, hk, j0, cols, key_t, nullptr);
      load_key_block<kD>(a, v, a.v_stride, b, hk, j0, cols, nullptr, values);
      // Scores and softmax, kScoreRows rows at a time (rows past the block's end are computed and ignored).
      for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
        Vec16 s[kScoreRows][kKeyVecs];
        scores_rows<FloatFma, kD, kScoreRows>(qs + r0 * D, key_t, 1.0f, s);
        for (int64_t rr = 0; rr < kScoreRows && r0 + rr < rows; ++rr) {
          const int64_t r = r0 + rr, i = i0 + r;
          float* p = probs + r * kBlock;
          last[r] = i - j0 + 1 < cols ? i - j0 + 1 : cols;
          mask_vec(documents, i, j0, s[rr]);
          Vec16 mv = splat(row_max[r]);
          for (int64_t x = 0; x < kKeyVecs; ++x) mv = vmax(mv, s[rr][x]);
          const float m = hmax(mv);
          if (m == kNegInf) {  // nothing visible yet in this row
            for (int64_t c = 0; c < kBlock; ++c) p[c] = 0.0f;
            rescale[r] = 1.0f;
            continue;
          }
          rescale[r] = exp_approx(row_max[r] - m);
          Vec16 sum = splat(0.0f);
          for (int64_t x = 0; x < kKeyVecs; ++x) {
            const Vec16 e = exp16(s[rr][x] - m);
            sum += e;
            store16(p + x * kVec, e);
          }
          row_max[r] = m;
          row_sum[r] = row_sum[r] * rescale[r] + hsum(sum);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t x = 0; x < NV; ++x) store16(acc + r * D + x * kVec, load16(acc + r * D + x * kVec) * rescale[r]);
      constexpr int64_t R = accumulate_rows_at_once<kD>();
      int64_t r = 0;
      for (; r + R <= rows; r += R)
        accumulate_rows<FloatFma, kD, R>(probs + r * kBlock, kBlock, 1, 0, longest(last + r, R), values, acc + r * D);
      for (; r < rows; ++r) accumulate_rows<FloatFma, kD, 1>(probs + r * kBlock, kBlock, 1, 0, last[r], values, acc + r * D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / row_sum[r];
      T* dst = row(out, a.out_stride, b, i0 + r, h);
      for (int64_t d = 0; d < D; ++d) store(dst + d, acc[r * D + d] * inv);
      lse[(b * H + h) * S + i0 + r] = row_max[r] + __builtin_logf(row_sum[r]);
    }
  }
}

template <int64_t kD, typename T>
void backward_vec(const AttentionShape& a, const T* q, const T* k, const T* v, const T* out, const T* grad_out,
                  const float* lse, T* grad_q, T* grad_k, T* grad_v, int64_t begin, int64_t end) {
  constexpr int64_t D = kD, NV = kD / kVec;
  const int64_t S = a.seq, H = a.heads, HK = a.kv_heads, group = a.heads / a.kv_heads;
  const int64_t blocks = (S + kBlock - 1) / kBlock;
  Scratch<> scratch(S * D * 3 + (kBlock + kScoreRows) * D * 2 + kBlock * D * 3 + kBlock * kBlock * 2 + kBlock * 2);
  float* dk_acc = scratch.data;                     // S x D
  float* dv_acc = dk_acc + S * D;                   // S x D
  float* dq_acc = dv_acc + S * D;                   // S x D, unscaled
  float* qs = dq_acc + S * D;                       // kBlock (+ kScoreRows spare) x D, scaled queries
  float* dout = qs + (kBlock + kScoreRows) * D;     // kBlock (+ kScoreRows spare) x D
  int64_t last[kBlock];                             // per row: keys of the block it sees
  float* key_t = dout + (kBlock + kScoreRows) * D;  // D x kBlock
  float* value_t = key_t + kBlock * D;       // D x kBlock
  float* keys = value_t + kBlock * D;        // kBlock x D
  float* probs = keys + kBlock * D;          // kBlock x kBlock
  float* dscores = probs + kBlock * kBlock;  // kBlock x kBlock
  float* delta = dscores + kBlock * kBlock;  // kBlock
  float* row_lse = delta + kBlock;           // kBlock
  const Vec16 zero = splat(0.0f);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / HK, hk = item % HK;
    const int32_t* documents = a.documents ? a.documents + b * S : nullptr;
    for (int64_t x = 0; x < S * D; ++x) dk_acc[x] = 0.0f, dv_acc[x] = 0.0f;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t x = 0; x < S * D; ++x) dq_acc[x] = 0.0f;
      for (int64_t qb = 0; qb < blocks; ++qb) {
        const int64_t i0 = qb * kBlock, rows = S - i0 < kBlock ? S - i0 : kBlock;
        for (int64_t r = 0; r < rows; ++r) {
          const T* qsrc = row(q, a.q_stride, b, i0 + r, h);
          const T* gsrc = row(grad_out, a.grad_out_stride, b, i0 + r, h);
          const T* osrc = row(out, a.out_stride, b, i0 + r, h);
          float o[D];
          for (int64_t d = 0; d < D; ++d) {
            qs[r * D + d] = to_float(qsrc[d]) * a.scale;
            dout[r * D + d] = to_float(gsrc[d]);
            o[d] = to_float(osrc[d]);
          }
          Vec16 dot_v = zero;
          for (int64_t x = 0; x < NV; ++x) dot_v += load16(dout + r * D + x * kVec) * load16(o + x * kVec);
          delta[r] = hsum(dot_v);
          row_lse[r] = lse[(b * H + h) * S + i0 + r];
        }
        for (int64_t x = rows * kBlock; x < kBlock * kBlock; ++x) probs[x] = 0.0f, dscores[x] = 0.0f;
        const Range visible = visible_keys(a, documents, i0, rows);
        for (int64_t j0 = visible.begin / kBlock * kBlock; j0 < visible.end; j0 += kBlock) {
          const int64_t cols = visible.end - j0 < kBlock ? visible.end - j0 : kBlock;
          load_key_block<kD>(a, k, a.k_stride, b, hk, j0, cols, key_t, keys);
          load_key_block<kD>(a, v, a.v_stride, b, hk, j0, cols, value_t, nullptr);
          for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
            Vec16 p[kScoreRows][kKeyVecs], dp[kScoreRows][kKeyVecs];
            scores_rows<FloatFma, kD, kScoreRows>(qs + r0 * D, key_t, 1.0f, p);
            scores_rows<FloatFma, kD, kScoreRows>(dout + r0 * D, value_t, 1.0f, dp);  // dP = dO V^T
            for (int64_t rr = 0; rr < kScoreRows && r0 + rr < rows; ++rr) {
              const int64_t r = r0 + rr, i = i0 + r;
              last[r] = i - j0 + 1 < cols ? i - j0 + 1 : cols;
              mask_vec(documents, i, j0, p[rr]);
              const float l = row_lse[r], dl = delta[r];
              for (int64_t x = 0; x < kKeyVecs; ++x) {
                const Vec16 e = exp16(p[rr][x] - l);  // masked: exactly 0
                store16(probs + r * kBlock + x * kVec, e);
                store16(dscores + r * kBlock + x * kVec, e * (dp[rr][x] - dl));
              }
            }
          }
          // dQ_i += sum_c dS_ic K_c (scaled when stored)
          constexpr int64_t R = accumulate_rows_at_once<kD>();
          int64_t r = 0;
          for (; r + R <= rows; r += R)
            accumulate_rows<FloatFma, kD, R>(dscores + r * kBlock, kBlock, 1, 0, longest(last + r, R), keys, dq_acc + (i0 + r) * D);
          for (; r < rows; ++r) accumulate_rows<FloatFma, kD, 1>(dscores + r * kBlock, kBlock, 1, 0, last[r], keys, dq_acc + (i0 + r) * D);
          // dK_c += sum_r dS_rc Qs_r and dV_c += sum_r P_rc dO_r over the rows that see key c (from row j0 + c - i0 on)
          int64_t c = 0;
          for (; c + R <= cols; c += R) {
            const int64_t first = j0 + c - i0 > 0 ? j0 + c - i0 : 0;
            accumulate_rows<FloatFma, kD, R>(dscores + c, 1, kBlock, first, rows, qs, dk_acc + (j0 + c) * D);
            accumulate_rows<FloatFma, kD, R>(probs + c, 1, kBlock, first, rows, dout, dv_acc + (j0 + c) * D);
          }
          for (; c < cols; ++c) {
            const int64_t first = j0 + c - i0 > 0 ? j0 + c - i0 : 0;
            accumulate_rows<FloatFma, kD, 1>(dscores + c, 1, kBlock, first, rows, qs, dk_acc + (j0 + c) * D);
            accumulate_rows<FloatFma, kD, 1>(probs + c, 1, kBlock, first, rows, dout, dv_acc + (j0 + c) * D);
          }
        }
      }
      for (int64_t i = 0; i < S; ++i) {
        T* dst = row(grad_q, a.grad_q_stride, b, i, h);
        for (int64_t d = 0; d < D; ++d) store(dst + d, dq_acc[i * D + d] * a.scale);
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      T* dk = row(grad_k, a.grad_k_stride, b, j, hk);
      T* dv = row(grad_v, a.grad_v_stride, b, j, hk);
      for (int64_t d = 0; d < D; ++d) store(dk + d, dk_acc[j * D + d]), store(dv + d, dv_acc[j * D + d]);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 inputs on the CPU's bf16 dot-product instruction (vdpbf16ps: each of 16 float lanes adds the two products of
// a pair of bf16 values), for head dims that are multiples of 16. The products are exact and summed in float (the
// instruction flushes denormal inputs and results to zero); the probabilities (and in backward dS) are rounded to
// bf16 for the product that follows, as GPU flash attention does.
// Operands live as uint32 words, each a pair of bf16 values (low half first), in three layouts:
//   rows:         a row's own values, read as kD / 2 pairs along head_dim (the broadcast side of a score);
//   transposed:   t[p * kBlock + c] = row c's pair p, the block's 64 rows side by side (the other side of a score);
//   interleaved:  w[rp * kD + d] = (row 2rp, row 2rp + 1) at column d (for sums over rows into head_dim lanes).
static_assert(kScoreRows % 2 == 0, "rows are paired for the interleaved layout");

inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16; }
inline __m512bh words(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh splat_word(uint32_t w) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(w)); }
// 16 floats rounded to bf16 (to nearest even) in the low halves of 16 words.
inline Uint16x bf16_words(Vec16 v) {
  const __m256bh rounded = _mm512_cvtneps_pbh((__m512)v);
  Half16 h;
  std::memcpy(&h, &rounded, sizeof h);
  return __builtin_convertvector(h, Uint16x);
}

// Rows [j0, j0 + kBlock) of `src` (one head of a (batch, seq, head) strided tensor) in the transposed layout, zero
// past the sequence.
template <int64_t kD>
void transpose_block(const AttentionShape& a, const uint16_t* src, const int64_t* stride, int64_t b, int64_t h,
                     int64_t j0, uint32_t* out) {
  for (int64_t c = 0; c < kBlock; ++c) {
    const uint16_t* r = j0 + c < a.seq ? row(src, stride, b, j0 + c, h) : nullptr;
    for (int64_t p = 0; p < kD / 2; ++p) out[p * kBlock + c] = r ? bf16_pair(r[2 * p], r[2 * p + 1]) : 0u;
  }
}

// The same rows in the interleaved layout, zero past the sequence.
template <int64_t kD>
void interleave_block(const AttentionShape& a, const uint16_t* src, const int64_t* stride, int64_t b, int64_t h,
                      int64_t j0, uint32_t* out) {
  for (int64_t rp = 0; rp < kBlock / 2; ++rp) {
    const int64_t j = j0 + 2 * rp;
    const uint16_t* r0 = j < a.seq ? row(src, stride, b, j, h) : nullptr;
    const uint16_t* r1 = j + 1 < a.seq ? row(src, stride, b, j + 1, h) : nullptr;
    for (int64_t d = 0; d < kD; ++d) out[rp * kD + d] = bf16_pair(r0 ? r0[d] : 0, r1 ? r1[d] : 0);
  }
}

// Bf16Dot: a word of two bf16 values of a row times a vector of 16 such pairs per step (vdpbf16ps).
struct Bf16Dot {
  using Word = uint32_t;
  using Operand = __m512bh;
  static constexpr int64_t kPerWord = 2;
  static __m512bh load(const uint32_t* p) { return words(p); }
  static __m512bh broadcast(uint32_t w) { return splat_word(w); }
  static Vec16 madd(Vec16 acc, __m512bh w, __m512bh v) { return (Vec16)_mm512_dpbf16_ps((__m512)acc, w, v); }
};

// One row's 64 values as 32 bf16 pairs along the row.
inline void store_row_pairs(uint32_t* out, const Vec16* s) {
  for (int64_t x = 0; x < kKeyVecs; x += 2)
    _mm512_storeu_si512(out + x * kVec / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)s[x + 1], (__m512)s[x]));
}

// Two rows' 64 values interleaved: word c = (lo[c], hi[c]).
inline void store_interleaved(uint32_t* out, const Vec16* lo, const Vec16* hi) {
  for (int64_t x = 0; x < kKeyVecs; ++x) {
    const Uint16x w = bf16_words(lo[x]) | bf16_words(hi[x]) << 16;
    std::memcpy(out + x * kVec, &w, sizeof w);
  }
}

// The pairs that hold n rows (or keys): n / 2 rounded up.
inline int64_t pairs_of(int64_t n) { return (n + 1) / 2; }

template <int64_t kD>
void forward_dot(const AttentionShape& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                 float* lse, int64_t begin, int64_t end) {
  constexpr int64_t D = kD, NV = kD / kVec, P = kD / 2, HB = kBlock / 2;
  const int64_t S = a.seq, H = a.heads, group = a.heads / a.kv_heads;
  const int64_t blocks = (S + kBlock - 1) / kBlock;
  // Every key block transposed and every value block interleaved, for one (batch, kv head) at a time: consecutive
  // items share them, so they are prepared once as the query blocks first reach them.
  Scratch<uint32_t> scratch_words(blocks * kBlock * P * 2 + (kBlock + kScoreRows) * P + kBlock * HB);
  uint32_t* key_t = scratch_words.data;                  // blocks x (P x kBlock)
  uint32_t* value_i = key_t + blocks * kBlock * P;       // blocks x (HB x D)
  uint32_t* qrows = value_i + blocks * kBlock * P;       // (kBlock + kScoreRows spare) x P
  uint32_t* probs = qrows + (kBlock + kScoreRows) * P;   // kBlock x HB: the block's probabilities in bf16
  Scratch<> scratch(kBlock * D + kBlock * 3);
  float* acc = scratch.data;            // kBlock x D, unnormalised outputs
  float* row_max = acc + kBlock * D;    // kBlock
  float* row_sum = row_max + kBlock;    // kBlock
  float* rescale = row_sum + kBlock;    // kBlock
  int64_t last[kBlock];                 // per row: keys of the block it sees
  int64_t cached_b = -1, cached_hk = -1, prepared = 0;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / (H * blocks), h = (item / blocks) % H, qb = item % blocks, hk = h / group;
    const int64_t i0 = qb * kBlock, rows = S - i0 < kBlock ? S - i0 : kBlock;
    const int32_t* documents = a.documents ? a.documents + b * S : nullptr;
    if (b != cached_b || hk != cached_hk) cached_b = b, cached_hk = hk, prepared = 0;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(qrows + r * P, row(q, a.q_stride, b, i0 + r, h), D * sizeof(uint16_t));
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
      row_max[r] = kNegInf;
      row_sum[r] = 0.0f;
    }
    const Range keys = visible_keys(a, documents, i0, rows);
    for (int64_t j0 = keys.begin / kBlock * kBlock; j0 < keys.end; j0 += kBlock) {
      const int64_t cols = keys.end - j0 < kBlock ? keys.end - j0 : kBlock, jb = j0 / kBlock;
      for (; prepared <= jb; ++prepared) {
        transpose_block<kD>(a, k, a.k_stride, b, hk, prepared * kBlock, key_t + prepared * kBlock * P);
        interleave_block<kD>(a, v, a.v_stride, b, hk, prepared * kBlock, value_i + prepared * kBlock * P);
      }
      // Scores and softmax, kScoreRows rows at a time (rows past the block's end are computed and ignored).
      for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
        Vec16 s[kScoreRows][kKeyVecs];
        scores_rows<Bf16Dot, kD, kScoreRows>(qrows + r0 * P, key_t + jb * kBlock * P, a.scale, s);
        for (int64_t rr = 0; rr < kScoreRows && r0 + rr < rows; ++rr) {
          const int64_t r = r0 + rr, i = i0 + r;
          last[r] = i - j0 + 1 < cols ? i - j0 + 1 : cols;
          mask_vec(documents, i, j0, s[rr]);
          Vec16 mv = splat(row_max[r]);
          for (int64_t x = 0; x < kKeyVecs; ++x) mv = vmax(mv, s[rr][x]);
          const float m = hmax(mv);
          if (m == kNegInf) {  // nothing visible yet in this row
            for (int64_t c = 0; c < HB; ++c) probs[r * HB + c] = 0u;
            rescale[r] = 1.0f;
            continue;
          }
          rescale[r] = exp_approx(row_max[r] - m);
          Vec16 e[kKeyVecs], sum = splat(0.0f);
          for (int64_t x = 0; x < kKeyVecs; ++x) {
            e[x] = exp16(s[rr][x] - m);
            sum += e[x];
          }
          store_row_pairs(probs + r * HB, e);
          row_max[r] = m;
          row_sum[r] = row_sum[r] * rescale[r] + hsum(sum);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t x = 0; x < NV; ++x) store16(acc + r * D + x * kVec, load16(acc + r * D + x * kVec) * rescale[r]);
      const uint32_t* values = value_i + jb * kBlock * P;
      constexpr int64_t R = accumulate_rows_at_once<kD>();
      int64_t r = 0;
      for (; r + R <= rows; r += R)
        accumulate_rows<Bf16Dot, kD, R>(probs + r * HB, HB, 1, 0, pairs_of(longest(last + r, R)), values, acc + r * D);
      for (; r < rows; ++r) accumulate_rows<Bf16Dot, kD, 1>(probs + r * HB, HB, 1, 0, pairs_of(last[r]), values, acc + r * D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / row_sum[r];
      uint16_t* dst = row(out, a.out_stride, b, i0 + r, h);
      for (int64_t x = 0; x < NV; ++x) store16(dst + x * kVec, load16(acc + r * D + x * kVec) * inv);
      lse[(b * H + h) * S + i0 + r] = row_max[r] + __builtin_logf(row_sum[r]);
    }
  }
}

template <int64_t kD>
void backward_dot(const AttentionShape& a, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                  const uint16_t* out, const uint16_t* grad_out, const float* lse, uint16_t* grad_q, uint16_t* grad_k,
                  uint16_t* grad_v, int64_t begin, int64_t end) {
  constexpr int64_t D = kD, NV = kD / kVec, P = kD / 2, HB = kBlock / 2;
  const int64_t S = a.seq, H = a.heads, HK = a.kv_heads, group = a.heads / a.kv_heads;
  const int64_t blocks = (S + kBlock - 1) / kBlock, block_words = kBlock * P;
  Scratch<uint32_t> scratch_words(blocks * block_words * 3 + (kBlock + kScoreRows) * P * 2 + block_words * 2 +
                                  kBlock * HB * 3);
  uint32_t* key_t = scratch_words.data;                  // blocks x (P x kBlock): keys for the scores
  uint32_t* key_i = key_t + blocks * block_words;        // blocks x (HB x D): keys for dQ
  uint32_t* value_t = key_i + blocks * block_words;      // blocks x (P x kBlock): values for dP
  uint32_t* qrows = value_t + blocks * block_words;      // (kBlock + kScoreRows spare) x P
  uint32_t* drows = qrows + (kBlock + kScoreRows) * P;   // the same for dO
  uint32_t* q_i = drows + (kBlock + kScoreRows) * P;     // HB x D: queries for dK
  uint32_t* d_i = q_i + block_words;                     // HB x D: dO for dV
  uint32_t* ds_rows = d_i + block_words;                 // kBlock x HB: dS along keys, for dQ
  uint32_t* ds_i = ds_rows + kBlock * HB;                // HB x kBlock: dS interleaved over rows, for dK
  uint32_t* p_i = ds_i + kBlock * HB;                    // HB x kBlock: P interleaved over rows, for dV
  Scratch<> scratch(S * D * 3 + kBlock * 2);
  float* dk_acc = scratch.data;      // S x D, unscaled
  float* dv_acc = dk_acc + S * D;    // S x D
  float* dq_acc = dv_acc + S * D;    // S x D, unscaled
  float* delta = dq_acc + S * D;     // kBlock
  float* row_lse = delta + kBlock;   // kBlock
  int64_t last[kBlock];              // per row: keys of the block it sees
  const Vec16 zero = splat(0.0f);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / HK, hk = item % HK;
    const int32_t* documents = a.documents ? a.documents + b * S : nullptr;
    for (int64_t jb = 0; jb < blocks; ++jb) {
      transpose_block<kD>(a, k, a.k_stride, b, hk, jb * kBlock, key_t + jb * block_words);
      interleave_block<kD>(a, k, a.k_stride, b, hk, jb * kBlock, key_i + jb * block_words);
      transpose_block<kD>(a, v, a.v_stride, b, hk, jb * kBlock, value_t + jb * block_words);
    }
    for (int64_t x = 0; x < S * D; ++x) dk_acc[x] = 0.0f, dv_acc[x] = 0.0f;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t x = 0; x < S * D; ++x) dq_acc[x] = 0.0f;
      for (int64_t qb = 0; qb < blocks; ++qb) {
        const int64_t i0 = qb * kBlock, rows = S - i0 < kBlock ? S - i0 : kBlock;
        for (int64_t r = 0; r < rows; ++r) {
          const uint16_t* gsrc = row(grad_out, a.grad_out_stride, b, i0 + r, h);
          const uint16_t* osrc = row(out, a.out_stride, b, i0 + r, h);
          std::memcpy(qrows + r * P, row(q, a.q_stride, b, i0 + r, h), D * sizeof(uint16_t));
          std::memcpy(drows + r * P, gsrc, D * sizeof(uint16_t));
          Vec16 dot_v = zero;
          for (int64_t x = 0; x < NV; ++x) dot_v += load16(gsrc + x * kVec) * load16(osrc + x * kVec);
          delta[r] = hsum(dot_v);
          row_lse[r] = lse[(b * H + h) * S + i0 + r];
        }
        interleave_block<kD>(a, q, a.q_stride, b, h, i0, q_i);
        interleave_block<kD>(a, grad_out, a.grad_out_stride, b, h, i0, d_i);
        const Range visible = visible_keys(a, documents, i0, rows);
        for (int64_t j0 = visible.begin / kBlock * kBlock; j0 < visible.end; j0 += kBlock) {
          const int64_t cols = visible.end - j0 < kBlock ? visible.end - j0 : kBlock, jb = j0 / kBlock;
          // P and dS, kScoreRows rows at a time; rows past the block's end get zeros.
          for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
            Vec16 p[kScoreRows][kKeyVecs], dp[kScoreRows][kKeyVecs];
            scores_rows<Bf16Dot, kD, kScoreRows>(qrows + r0 * P, key_t + jb * block_words, a.scale, p);
            scores_rows<Bf16Dot, kD, kScoreRows>(drows + r0 * P, value_t + jb * block_words, 1.0f, dp);  // dP = dO V^T
            for (int64_t rr = 0; rr < kScoreRows; ++rr) {
              const int64_t r = r0 + rr, i = i0 + r;
              if (r < rows) {
                last[r] = i - j0 + 1 < cols ? i - j0 + 1 : cols;
                mask_vec(documents, i, j0, p[rr]);
                const float l = row_lse[r], dl = delta[r];
                for (int64_t x = 0; x < kKeyVecs; ++x) {
                  p[rr][x] = exp16(p[rr][x] - l);  // masked: exactly 0
                  dp[rr][x] = p[rr][x] * (dp[rr][x] - dl);
                }
              } else {
                for (int64_t x = 0; x < kKeyVecs; ++x) p[rr][x] = zero, dp[rr][x] = zero;
              }
              store_row_pairs(ds_rows + r * HB, dp[rr]);
            }
            for (int64_t rr = 0; rr < kScoreRows; rr += 2) {
              store_interleaved(ds_i + (r0 + rr) / 2 * kBlock, dp[rr], dp[rr + 1]);
              store_interleaved(p_i + (r0 + rr) / 2 * kBlock, p[rr], p[rr + 1]);
            }
          }
          // dQ_i += sum_c dS_ic K_c (scaled when stored)
          const uint32_t* keys = key_i + jb * block_words;
          constexpr int64_t R = accumulate_rows_at_once<kD>();
          int64_t r = 0;
          for (; r + R <= rows; r += R)
            accumulate_rows<Bf16Dot, kD, R>(ds_rows + r * HB, HB, 1, 0, pairs_of(longest(last + r, R)), keys, dq_acc + (i0 + r) * D);
          for (; r < rows; ++r)
            accumulate_rows<Bf16Dot, kD, 1>(ds_rows + r * HB, HB, 1, 0, pairs_of(last[r]), keys, dq_acc + (i0 + r) * D);
          // dK_c += sum_r dS_rc Q_r (scaled when stored) and dV_c += sum_r P_rc dO_r over the row pairs holding a row
          // that sees key c (from row j0 + c - i0 on)
          int64_t c = 0;
          for (; c + R <= cols; c += R) {
            const int64_t first = (j0 + c - i0 > 0 ? j0 + c - i0 : 0) / 2;
            accumulate_rows<Bf16Dot, kD, R>(ds_i + c, 1, kBlock, first, pairs_of(rows), q_i, dk_acc + (j0 + c) * D);
            accumulate_rows<Bf16Dot, kD, R>(p_i + c, 1, kBlock, first, pairs_of(rows), d_i, dv_acc + (j0 + c) * D);
          }
          for (; c < cols; ++c) {
            const int64_t first = (j0 + c - i0 > 0 ? j0 + c - i0 : 0) / 2;
            accumulate_rows<Bf16Dot, kD, 1>(ds_i + c, 1, kBlock, first, pairs_of(rows), q_i, dk_acc + (j0 + c) * D);
            accumulate_rows<Bf16Dot, kD, 1>(p_i + c, 1, kBlock, first, pairs_of(rows), d_i, dv_acc + (j0 + c) * D);
          }
        }
      }
      for (int64_t i = 0; i < S; ++i) {
        uint16_t* dst = row(grad_q, a.grad_q_stride, b, i, h);
        for (int64_t x = 0; x < NV; ++x) store16(dst + x * kVec, load16(dq_acc + i * D + x * kVec) * a.scale);
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      uint16_t* dk = row(grad_k, a.grad_k_stride, b, j, hk);
      uint16_t* dv = row(grad_v, a.grad_v_stride, b, j, hk);
      for (int64_t x = 0; x < NV; ++x) {
        store16(dk + x * kVec, load16(dk_acc + j * D + x * kVec) * a.scale);
        store16(dv + x * kVec, load16(dv_acc + j * D + x * kVec));
      }
    }
  }
}
#endif  // __AVX512BF16__

template <typename T>
void forward_dispatch(const AttentionShape& a, const T* q, const T* k, const T* v, T* out, float* lse, int64_t begin,
                      int64_t end) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    switch (a.head_dim) {
      case 16: return forward_dot<16>(a, q, k, v, out, lse, begin, end);
      case 32: return forward_dot<32>(a, q, k, v, out, lse, begin, end);
      case 64: return forward_dot<64>(a, q, k, v, out, lse, begin, end);
      case 128: return forward_dot<128>(a, q, k, v, out, lse, begin, end);
      case 192: return forward_dot<192>(a, q, k, v, out, lse, begin, end);
      default: break;
    }
  }
#endif
  switch (a.head_dim) {
    case 16: return forward_vec<16>(a, q, k, v, out, lse, begin, end);
    case 32: return forward_vec<32>(a, q, k, v, out, lse, begin, end);
    case 64: return forward_vec<64>(a, q, k, v, out, lse, begin, end);
    case 128: return forward_vec<128>(a, q, k, v, out, lse, begin, end);
    case 192: return forward_vec<192>(a, q, k, v, out, lse, begin, end);
    default: return forward_impl(a, q, k, v, out, lse, begin, end);
  }
}

template <typename T>
void backward_dispatch(const AttentionShape& a, const T* q, const T* k, const T* v, const T* out, const T* grad_out,
                       const float* lse, T* grad_q, T* grad_k, T* grad_v, int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    switch (a.head_dim) {
      case 16: return backward_dot<16>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
      case 32: return backward_dot<32>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
      case 64: return backward_dot<64>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
      case 128: return backward_dot<128>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
      case 192: return backward_dot<192>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
      default: break;
    }
  }
#endif
  switch (a.head_dim) {
    case 16: return backward_vec<16>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
    case 32: return backward_vec<32>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
    case 64: return backward_vec<64>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
    case 128: return backward_vec<128>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
    case 192: return backward_vec<192>(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
    default: return backward_impl(a, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
  }
}

}  // namespace

void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v, float* out, float* lse,
                       int64_t begin, int64_t end) {
  forward_dispatch(s, q, k, v, out, lse, begin, end);
}
void attention_forward(const AttentionShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                       float* lse, int64_t begin, int64_t end) {
  forward_dispatch(s, q, k, v, out, lse, begin, end);
}
void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v, const float* out,
                        const float* grad_out, const float* lse, float* grad_q, float* grad_k, float* grad_v,
                        int64_t begin, int64_t end) {
  backward_dispatch(s, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
}
void attention_backward(const AttentionShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                        const uint16_t* out, const uint16_t* grad_out, const float* lse, uint16_t* grad_q,
                        uint16_t* grad_k, uint16_t* grad_v, int64_t begin, int64_t end) {
  backward_dispatch(s, q, k, v, out, grad_out, lse, grad_q, grad_k, grad_v, begin, end);
}

}  // namespace titan::kernels::isa::TITAN_ISA
