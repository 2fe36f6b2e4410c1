// Cross-entropy over rows of logits, in two passes that read the logits in their own dtype (never a float32
// copy): the row statistics (maximum, sum of exponentials, the label's logit), then, once the log-sum-exp is known
// (after the vocabulary shards have combined theirs under loss parallelism), the gradient written over the logits.
#include "titan/kernels/isa/kernels.h"
#include "titan/kernels/isa/scalar_math.h"

namespace titan::kernels::isa::TITAN_ISA {
namespace {

template <typename T>
void stats_impl(int64_t vocab, const T* logits, const int64_t* local_label, float* row_max, float* row_sum_exp,
                float* row_target, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* x = logits + r * vocab;
    int64_t i = 0;
    Vec16 m16 = splat(kNegInf);
    for (; i + kVec <= vocab; i += kVec) m16 = vmax(m16, load16(x + i));
    float m = hmax(m16);
    for (; i < vocab; ++i) m = to_float(x[i]) > m ? to_float(x[i]) : m;
    // A row of -inf (or empty) sums to 0 with its maximum kept finite, so nothing below is NaN.
    const float shift = m == kNegInf ? 0.0f : m;
    Vec16 s16 = splat(0.0f);
    for (i = 0; i + kVec <= vocab; i += kVec) s16 += exp16(load16(x + i) - shift);
    float s = hsum(s16);
    for (; i < vocab; ++i) s += exp_approx(to_float(x[i]) - shift);
    row_max[r] = shift;
    row_sum_exp[r] = s;
    const int64_t label = local_label[r];
    row_target[r] = label >= 0 ? to_float(x[label]) : 0.0f;
  }
}

template <typename T>
void grad_impl(int64_t vocab, T* logits, const int64_t* local_label, const float* row_lse, const float* row_scale,
               int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* x = logits + r * vocab;
    const float lse = row_lse[r], scale = row_scale[r];
    const int64_t label = local_label[r];
    // The label's logit is read before its column is overwritten.
    const float at_label = label >= 0 ? to_float(x[label]) : 0.0f;
    int64_t i = 0;
    for (; i + kVec <= vocab; i += kVec) store16(x + i, exp16(load16(x + i) - lse) * scale);
    for (; i < vocab; ++i) store(x + i, exp_approx(to_float(x[i]) - lse) * scale);
    if (label >= 0) store(x + label, (exp_approx(at_label - lse) - 1.0f) * scale);
  }
}

}  // namespace

void cross_entropy_stats(int64_t vocab, const float* logits, const int64_t* local_label, float* row_max,
                         float* row_sum_exp, float* row_target, int64_t begin, int64_t end) {
  stats_impl(vocab, logits, local_label, row_max, row_sum_exp, row_target, begin, end);
}
void cross_entropy_stats(int64_t vocab, const uint16_t* logits, const int64_t* local_label, float* row_max,
                         float* row_sum_exp, float* row_target, int64_t begin, int64_t end) {
  stats_impl(vocab, logits, local_label, row_max, row_sum_exp, row_target, begin, end);
}
void cross_entropy_grad(int64_t vocab, float* logits, const int64_t* local_label, const float* row_lse,
                        const float* row_scale, int64_t begin, int64_t end) {
  grad_impl(vocab, logits, local_label, row_lse, row_scale, begin, end);
}
void cross_entropy_grad(int64_t vocab, uint16_t* logits, const int64_t* local_label, const float* row_lse,
                        const float* row_scale, int64_t begin, int64_t end) {
  grad_impl(vocab, logits, local_label, row_lse, row_scale, begin, end);
}

}  // namespace titan::kernels::isa::TITAN_ISA
