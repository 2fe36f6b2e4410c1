// DDP: every rank holds all parameters; gradients are summed across replicas in buckets that are launched, in a
// fixed order, as soon as backward has produced all of a bucket's gradients, so communication overlaps the rest of
// backward. With gradient accumulation only the last micro-batch's backward synchronises.
#include "titan/distributed/ddp.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::distributed {

Ddp::Ddp(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group, int64_t first_bucket_bytes,
         int64_t bucket_bytes)
    : params_(std::move(parameters)), group_(std::move(group)) {
  // Buckets in reverse registration order: the order in which backward produces gradients.
  int64_t cap = first_bucket_bytes, bytes = 0;
  bucket_of_.assign(params_.size(), 0);
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    const at::Tensor& p = params_[i];
    const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
    if (buckets_.empty() || (bytes + size > cap && !buckets_.back().params.empty()) ||
        buckets_.back().dtype != p.scalar_type()) {
      if (!buckets_.empty()) cap = bucket_bytes;
      buckets_.push_back(Bucket{});
      buckets_.back().dtype = p.scalar_type();
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.params.push_back(i);
    b.offsets.push_back(b.numel);
    b.numel += p.numel();
    bytes += size;
    bucket_of_[i] = static_cast<int64_t>(buckets_.size()) - 1;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i, alive = alive_](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (*alive) on_gradient_ready(static_cast<int64_t>(i));
          return outputs;
        }));
    accumulators_.push_back(accumulator);
  }
}

Ddp::~Ddp() { *alive_ = false; }

void Ddp::before_backward(bool last_microbatch) { sync_ = last_microbatch; }

void Ddp::on_gradient_ready(int64_t index) {
  if (!sync_) return;
  Bucket& b = buckets_[bucket_of_[index]];
  if (++b.ready == static_cast<int64_t>(b.params.size())) launch_ready();
}

void Ddp::launch_ready() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].ready == static_cast<int64_t>(buckets_[next_bucket_].params.size()))
    launch(buckets_[next_bucket_++]);
}

void Ddp::launch(Bucket& b) {
  const auto& any = params_[b.params.front()];
  b.buffer = at::empty({b.numel}, any.options().dtype(b.dtype).requires_grad(false));
  for (size_t k = 0; k < b.params.size(); ++k) {
    const at::Tensor& p = params_[b.params[k]];
    at::Tensor slot = b.buffer.narrow(0, b.offsets[k], p.numel());
    if (p.grad().defined()) slot.copy_(p.grad().reshape(-1));
    else slot.zero_();  // a parameter this backward did not reach: contributes zero, as on every rank
    // The bucket holds the gradient from now on (its slot becomes the gradient once reduced): one copy of the
    // gradients at the end of backward, not two (PyTorch's DDP with gradient_as_bucket_view).
    p.mutable_grad() = at::Tensor();
  }
  b.work = group_->all_reduce(b.buffer, ReduceOp::Sum, /*async=*/true);
  b.launched = true;
  // With a listener (an optimizer step in backward), the bucket launched before this one is finished now: its
  // all-reduce overlapped this bucket's backward, and its gradients are stepped and freed while backward goes on.
  if (listener_ && &b != &buckets_.front()) {
    Bucket& previous = *(&b - 1);
    if (previous.buffer.defined()) {
      wait(previous);
      std::vector<at::Tensor> ready;
      for (int64_t index : previous.params) ready.push_back(params_[index]);
      listener_(ready);
      previous.buffer = at::Tensor();
    }
  }
}

void Ddp::wait(Bucket& b) {
  if (!b.work) return;
  auto start = std::chrono::steady_clock::now();
  b.work->wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  b.work.reset();
  for (size_t k = 0; k < b.params.size(); ++k) {
    at::Tensor& p = params_[b.params[k]];
    p.mutable_grad() = b.buffer.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
  }
}

void Ddp::finish_gradients() {
  if (!sync_) return;
  at::NoGradGuard no_grad;
  // Buckets whose parameters did not all receive gradients are launched now, still in bucket order.
  for (; next_bucket_ < buckets_.size(); ++next_bucket_) launch(buckets_[next_bucket_]);
  for (auto& b : buckets_) {
    wait(b);
    b.buffer = at::Tensor();
    b.ready = 0;
    b.launched = false;
  }
  next_bucket_ = 0;
  sync_ = false;
}

std::string Ddp::describe() const {
  int64_t first = buckets_.empty() ? 0 : buckets_.front().numel;
  return cat("DDP over ", group_->size(), " replicas: ", buckets_.size(), " gradient buckets (first ",
             with_thousands(first), " elements), all-reduce overlapped with backward");
}

int64_t Ddp::bytes_communicated() const { return group_->bytes_communicated(); }

}  // namespace titan::distributed
