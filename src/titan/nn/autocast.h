// Autocast state as a value, and a scope that enters one: used for the training forward and to re-enter the
// forward's state when activation checkpointing recomputes in backward (autocast is thread-local and off by then).
#pragma once
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <optional>
#include <vector>

namespace titan::nn {

// A scope in which autocast (thread-local, possibly on) changes no dtype: for code that computes in a dtype of its
// own choosing (float32 routing, float8 casts, bf16 products computed in float32).
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA})};
};

struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState current() {
    AutocastState s;
    s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    return s;
  }
  // The current state with autocast on for `device` in `dtype` (unchanged when dtype is empty).
  static AutocastState enabled_for(at::DeviceType device, std::optional<at::ScalarType> dtype) {
    AutocastState s = current();
    if (!dtype) return s;
    if (device == at::kCUDA) s.cuda_enabled = true, s.cuda_dtype = *dtype;
    else s.cpu_enabled = true, s.cpu_dtype = *dtype;
    return s;
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// Keeps autocast's low-precision copies of the weights over a whole training step (every micro-batch's forward
// and backward, activation-checkpoint recomputation included), so each weight is cast once per step; the copies
// are dropped when the scope ends, before the optimizer changes the weights. Does nothing when `enabled` is false.
class StepWeightCasts {
 public:
  explicit StepWeightCasts(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    at::autocast::increment_nesting();
    held().fetch_add(1);
  }
  ~StepWeightCasts() {
    if (!enabled_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    held().fetch_sub(1);
  }
  StepWeightCasts(const StepWeightCasts&) = delete;
  StepWeightCasts& operator=(const StepWeightCasts&) = delete;

  // Whether some thread holds a step's casts (autograd may recompute on another thread, on GPUs). While one does,
  // no autocast region on any thread clears the cache: titan runs no autocast work beside the training step.
  static bool active() { return held().load() > 0; }

 private:
  static std::atomic<int>& held() {
    static std::atomic<int> count{0};
    return count;
  }
  bool enabled_;
};

// Casts the matrices among `parameters` (what autocast's lower-precision ops, linear and matmul, take) into
// autocast's cache now, with gradient tracking, while a step's casts are held. Called before a forward that runs
// without gradients (activation checkpointing). A safeguard for LibTorch releases before pytorch/pytorch#165068
// (late 2025), which cached a copy made without gradients as it was: the recomputation in backward, reusing it,
// would leave the weights without gradients. Later releases make every cached copy with gradient tracking.
inline void cast_weights_ahead(const std::vector<at::Tensor>& parameters) {
  if (!StepWeightCasts::active() || !at::GradMode::is_enabled() || !at::autocast::is_autocast_cache_enabled()) return;
  for (const auto& p : parameters) {
    if (!p.defined() || p.dim() < 2 || p.scalar_type() != at::kFloat || !p.requires_grad()) continue;
    const auto device = p.device().type();
    if (!at::autocast::is_autocast_enabled(device)) continue;
    at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), p, device);
  }
}

// Enters `inner` and restores the outer state on exit. Autocast caches low-precision copies of weights until the
// outermost region ends; the nesting bookkeeping here clears them, so no copy outlives an optimizer step. While a
// StepWeightCasts is held the copies stay until it ends.
class AutocastRegion {
 public:
  explicit AutocastRegion(const AutocastState& inner) : outer_(AutocastState::current()) {
    inner.apply();
    active_ = inner.cpu_enabled || inner.cuda_enabled;
    if (active_) at::autocast::increment_nesting();
  }
  ~AutocastRegion() {
    if (active_ && at::autocast::decrement_nesting() == 0 && !StepWeightCasts::active()) at::autocast::clear_cache();
    outer_.apply();
  }
  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

 private:
  AutocastState outer_;
  bool active_ = false;
};

}  // namespace titan::nn
