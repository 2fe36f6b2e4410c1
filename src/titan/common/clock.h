// now_seconds(): a monotonic clock in seconds, for durations in logs and metrics.
#pragma once
#include <chrono>

namespace titan {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace titan
