// Loss parallelism: cross-entropy over logits whose vocabulary is sharded across the tensor-parallel group,
// computed without gathering them (torchtitan's loss_parallel). Every rank gets the same loss.
#pragma once
#include <ATen/ATen.h>

#include <memory>

#include "titan/distributed/communicator.h"

namespace titan::distributed {

// Sum over tokens whose label is not `ignore_index` of -log softmax(logits)[label], in float32, where this rank
// holds vocabulary entries [vocab_begin, vocab_begin + local_logits.size(-1)) of every token's logits
// (local_logits: (batch, seq, local vocab), labels: (batch, seq) global ids). Backward gives each rank the
// gradient of its own vocabulary slice. Collective over `group` (three all-reduces of batch x seq values).
at::Tensor vocab_parallel_cross_entropy_sum(const at::Tensor& local_logits, const at::Tensor& labels, int64_t vocab_begin,
                                            const std::shared_ptr<Communicator>& group, int64_t ignore_index);

}  // namespace titan::distributed
