// Cross-entropy summed in float32 over tokens whose label is not kIgnoreIndex; callers divide by the number of
// valid tokens in the global batch so micro-batches and ranks weigh every token equally.
#pragma once
#include <ATen/ATen.h>

namespace titan {

constexpr int64_t kIgnoreIndex = -100;

// logits (batch, seq, vocab) in any float dtype; labels int64 (batch, seq).
at::Tensor cross_entropy_sum(const at::Tensor& logits, const at::Tensor& labels);
int64_t count_valid_tokens(const at::Tensor& labels);

}  // namespace titan
