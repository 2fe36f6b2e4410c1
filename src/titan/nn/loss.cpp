#include "titan/nn/loss.h"

namespace titan {

at::Tensor cross_entropy_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), labels.flatten(0, 1), /*weight=*/{},
                                at::Reduction::Sum, kIgnoreIndex);
}

int64_t count_valid_tokens(const at::Tensor& labels) { return labels.ne(kIgnoreIndex).sum().item<int64_t>(); }

}  // namespace titan
