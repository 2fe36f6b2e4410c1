// Autocast state as a value, and a scope that enters one: used for the training forward and to re-enter the
// forward's state when activation checkpointing recomputes in backward (autocast is thread-local and off by then).
#pragma once
#include <ATen/autocast_mode.h>

#include <optional>

namespace titan::nn {

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

// Enters `inner` and restores the outer state on exit. Autocast caches low-precision copies of weights until the
// outermost region ends; the nesting bookkeeping here clears them, so no copy outlives an optimizer step.
class AutocastRegion {
 public:
  explicit AutocastRegion(const AutocastState& inner) : outer_(AutocastState::current()) {
    inner.apply();
    active_ = inner.cpu_enabled || inner.cuda_enabled;
    if (active_) at::autocast::increment_nesting();
  }
  ~AutocastRegion() {
    if (active_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    outer_.apply();
  }
  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

 private:
  AutocastState outer_;
  bool active_ = false;
};

}  // namespace titan::nn
