#include "titan/nn/kept_ops.h"

#include <mutex>

#include "titan/common/error.h"
#include "titan/kernels/fused_ops.h"
#include "titan/nn/matmul.h"

namespace titan::nn {
namespace {

std::mutex g_observer_mutex;
KeptOps::Observer g_observer;

}  // namespace

at::Tensor KeptOps::product(const std::function<at::Tensor(const at::Tensor& kept)>& run) {
  if (++products_ % 2 == 0) return run(at::Tensor());
  if (recomputing_) return run(reuse("a product's output"));
  at::Tensor y = run(at::Tensor());
  keep(y);
  return y;
}

at::Tensor KeptOps::linear(const at::Tensor& x, const at::Tensor& weight) {
  return product([&](const at::Tensor& kept) { return kept.defined() ? linear_with_output(x, weight, kept) : nn::linear(x, weight); });
}

at::Tensor KeptOps::attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents) {
  if (recomputing_) {
    const at::Tensor& out = reuse("attention's output");
    return kernels::attention_with_outputs(q, k, v, documents, out, reuse("attention's log-sum-exp"));
  }
  auto [out, lse] = kernels::attention_outputs(q, k, v, documents);
  keep(out);
  keep(lse);
  return out;
}

void KeptOps::start_recomputation() {
  recomputing_ = true;
  products_ = 0;
  next_ = 0;
}

void KeptOps::keep(const at::Tensor& t) {
  kept_.push_back(t);
  versions_.push_back(t._version());
}

const at::Tensor& KeptOps::reuse(const char* what) {
  if (next_ >= kept_.size())
    fail("op-level activation checkpointing: the recomputation asked for ", what, " beyond the ", kept_.size(),
         " tensors the forward kept (the block's operations differ between forward and recomputation)");
  if (kept_[next_]._version() != versions_[next_])
    fail("op-level activation checkpointing: ", what, " kept from the forward was changed in place afterwards");
  return kept_[next_++];
}

void KeptOps::set_observer(Observer observer) {
  std::lock_guard<std::mutex> lock(g_observer_mutex);
  g_observer = std::move(observer);
}

void KeptOps::notify(const std::vector<at::Tensor>& kept) {
  std::lock_guard<std::mutex> lock(g_observer_mutex);
  if (g_observer) g_observer(kept);
}

}  // namespace titan::nn
