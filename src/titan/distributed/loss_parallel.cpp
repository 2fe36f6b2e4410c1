#include "titan/distributed/loss_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include "titan/distributed/autograd_group.h"

namespace titan::distributed {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local_logits, const at::Tensor& labels, int64_t vocab_begin,
                            c10::intrusive_ptr<GroupHolder> holder, int64_t ignore_index) {
    Communicator& group = *holder->group;
    const int64_t local_vocab = local_logits.size(-1);
    at::Tensor x = local_logits.reshape({-1, local_vocab}).to(at::kFloat);
    at::Tensor flat_labels = labels.reshape({-1});
    // A shift by the global maximum keeps exp() in range; it cancels in the loss, so no gradient flows through it.
    at::Tensor max = std::get<0>(x.max(1)).contiguous();
    group.all_reduce(max, ReduceOp::Max);
    at::Tensor shifted = x - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = exp.sum(1).contiguous();
    group.all_reduce(sum_exp, ReduceOp::Sum);
    at::Tensor valid = flat_labels.ne(ignore_index);
    at::Tensor local_label = flat_labels - vocab_begin;
    at::Tensor here = valid.logical_and(local_label.ge(0)).logical_and(local_label.lt(local_vocab));
    at::Tensor index = at::where(here, local_label, at::zeros_like(local_label));
    at::Tensor target = shifted.gather(1, index.unsqueeze(1)).squeeze(1).mul(here.to(at::kFloat)).contiguous();
    group.all_reduce(target, ReduceOp::Sum);
    at::Tensor per_token = (sum_exp.log() - target).mul(valid.to(at::kFloat));
    // softmax of this rank's slice, kept for backward (the same memory as float32 local logits).
    exp.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({exp, index, here, valid});
    ctx->saved_data["shape"] = local_logits.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(local_logits.scalar_type());
    return per_token.sum();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], index = saved[1], here = saved[2], valid = saved[3];
    // d loss / d logits = softmax - one_hot(label) on valid tokens, zero on ignored ones.
    at::Tensor grad = softmax.mul(valid.to(at::kFloat).unsqueeze(1));
    grad.scatter_add_(1, index.unsqueeze(1), here.to(at::kFloat).neg().unsqueeze(1));
    grad.mul_(grads[0]);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.view(ctx->saved_data["shape"].toIntVector()).to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy_sum(const at::Tensor& local_logits, const at::Tensor& labels, int64_t vocab_begin,
                                            const std::shared_ptr<Communicator>& group, int64_t ignore_index) {
  return VocabParallelCrossEntropy::apply(local_logits, labels, vocab_begin, hold(group), ignore_index);
}

}  // namespace titan::distributed
