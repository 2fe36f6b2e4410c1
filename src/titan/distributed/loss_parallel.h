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

// The output projection fused with the cross-entropy: the same sum as above for logits = x weight^T, computed in
// chunks of tokens so that neither the logits of the whole batch nor any float32 copy of them exists. x: (tokens,
// dim), or any (..., dim) with labels of shape (...); weight: (local vocab, dim), this rank's rows [vocab_begin, ...)
// of the output projection (all of them when `group` is null); labels: global ids. Both are taken in the compute
// dtype: the autocast dtype when autocast is on for their device, else theirs. Each chunk's logits are in that
// dtype, with float32 softmax statistics. With gradients enabled, d loss / d x and d loss / d weight
// are computed chunk by chunk in forward (the weight's summed in float32) and backward only scales them, so
// nothing else is kept. Under loss parallelism d loss / d x is this rank's partial sum, which the input's
// all-gather sums in backward. Collective over `group`: two all-reduces per chunk.
at::Tensor linear_cross_entropy_sum(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& labels, int64_t vocab_begin,
                                    const std::shared_ptr<Communicator>& group, int64_t ignore_index);

// Tokens per chunk of linear_cross_entropy_sum: 4M logits' worth, but at least 1,024 tokens (fewer float32
// weight-gradient accumulations; at Llama 3's 128,256-token vocabulary a chunk holds 131M logits).
int64_t linear_cross_entropy_chunk(int64_t tokens, int64_t local_vocab);

}  // namespace titan::distributed
