#include "titan/distributed/loss_parallel.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "titan/distributed/autograd_group.h"
#include "titan/kernels/fused_ops.h"
#include "titan/nn/matmul.h"

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

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& labels,
                            int64_t vocab_begin, c10::intrusive_ptr<GroupHolder> holder, int64_t ignore_index,
                            bool grad_x_wanted, bool grad_weight_wanted) {
    Communicator* group = holder->group.get();
    const int64_t tokens = x.size(0), local_vocab = weight.size(0);
    const at::Tensor valid = labels.ne(ignore_index);
    const at::Tensor local = labels - vocab_begin;
    const at::Tensor here = valid.logical_and(local.ge(0)).logical_and(local.lt(local_vocab));
    const at::Tensor local_label = at::where(here, local, at::full_like(local, -1)).contiguous();
    const at::Tensor scale = valid.to(at::kFloat).contiguous();
    const bool float32 = x.scalar_type() == at::kFloat;
    at::Tensor grad_x = grad_x_wanted ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_weight = grad_weight_wanted ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor total = at::zeros({}, x.options().dtype(at::kFloat));
    const at::Tensor weight_t = weight.t();
    const int64_t chunk = linear_cross_entropy_chunk(tokens, local_vocab);
    for (int64_t begin = 0; begin < tokens; begin += chunk) {
      const int64_t n = std::min(chunk, tokens - begin);
      const at::Tensor xc = x.narrow(0, begin, n), labels_c = local_label.narrow(0, begin, n), scale_c = scale.narrow(0, begin, n);
      at::Tensor logits = nn::mm(xc, weight_t);
      auto stats = kernels::cross_entropy_row_stats(logits, labels_c);
      at::Tensor max = stats.max, sum_exp = stats.sum_exp, target = stats.target;
      if (group) {
        // The global maximum, each shard's sum rescaled to it, then the sums and the label's logit in one reduction.
        at::Tensor global_max = max.clone();
        group->all_reduce(global_max, ReduceOp::Max);
        at::Tensor packed = at::cat({sum_exp * (max - global_max).exp(), target});
        group->all_reduce(packed, ReduceOp::Sum);
        sum_exp = packed.narrow(0, 0, n);
        target = packed.narrow(0, n, n);
        max = global_max;
      }
      const at::Tensor lse = sum_exp.log() + max;
      total += ((lse - target) * scale_c).sum();
      if (!grad_x_wanted && !grad_weight_wanted) continue;
      kernels::cross_entropy_row_grad_(logits, labels_c, lse.contiguous(), scale_c);  // logits now hold d loss / d logits
      if (grad_x_wanted) {
        at::Tensor slice = grad_x.narrow(0, begin, n);
        nn::mm_out(slice, logits, weight);
      }
      if (grad_weight_wanted) {
        if (float32) grad_weight.addmm_(logits.t(), xc);
        else grad_weight.add_(nn::mm(logits.t(), xc));
      }
    }
    if (grad_x.defined()) ctx->saved_data["grad_x"] = grad_x;
    if (grad_weight.defined()) ctx->saved_data["grad_weight"] = grad_weight;
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradients were computed in forward for a loss gradient of 1; they are scaled in place and handed on (the
    // graph is not retained for a second backward).
    const at::Tensor& g = grads[0];
    auto& saved = ctx->saved_data;
    at::Tensor grad_x = saved.count("grad_x") ? saved["grad_x"].toTensor() : at::Tensor();
    at::Tensor grad_weight = saved.count("grad_weight") ? saved["grad_weight"].toTensor() : at::Tensor();
    const auto weight_dtype = static_cast<at::ScalarType>(saved["weight_dtype"].toInt());
    saved.clear();
    if (grad_x.defined()) grad_x.mul_(g);
    if (grad_weight.defined()) grad_weight = grad_weight.mul_(g).to(weight_dtype);
    return {grad_x, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t linear_cross_entropy_chunk(int64_t tokens, int64_t local_vocab) {
  const int64_t by_size = (int64_t{1} << 22) / std::max<int64_t>(1, local_vocab);
  return std::max<int64_t>(1, std::min(tokens, std::max<int64_t>(1024, by_size)));
}

at::Tensor linear_cross_entropy_sum(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& labels, int64_t vocab_begin,
                                    const std::shared_ptr<Communicator>& group, int64_t ignore_index) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) && labels.numel() * x.size(-1) == x.numel(),
              "fused output projection and cross-entropy: x ", x.sizes(), ", weight ", weight.sizes(), " and labels ",
              labels.sizes(), " do not fit");
  // Under autocast the projection computes in the autocast dtype, as at::linear would (the weight's copy cached).
  const auto device = x.device().type();
  at::ScalarType dtype = x.scalar_type();
  if (at::autocast::is_autocast_enabled(device)) dtype = at::autocast::get_autocast_dtype(device);
  TORCH_CHECK(dtype == weight.scalar_type() || at::autocast::is_autocast_enabled(device),
              "fused output projection and cross-entropy: x is ", x.scalar_type(), " and the weight ", weight.scalar_type());
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(dtype).contiguous();
  const at::Tensor w = at::autocast::cached_cast(dtype, weight, device);
  const bool grad = at::GradMode::is_enabled();
  return LinearCrossEntropy::apply(x2, w, labels.reshape({-1}).to(at::kLong), vocab_begin, hold(group), ignore_index,
                                   grad && x2.requires_grad(), grad && w.requires_grad());
}

at::Tensor vocab_parallel_cross_entropy_sum(const at::Tensor& local_logits, const at::Tensor& labels, int64_t vocab_begin,
                                            const std::shared_ptr<Communicator>& group, int64_t ignore_index) {
  return VocabParallelCrossEntropy::apply(local_logits, labels, vocab_begin, hold(group), ignore_index);
}

}  // namespace titan::distributed
