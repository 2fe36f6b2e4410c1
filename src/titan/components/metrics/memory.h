// Peak memory for the step log line: resident set size on CPU (Linux VmHWM, reset per log window), the caching
// allocator's peak reservation on CUDA.
#pragma once
#include <cstdint>
#include <string>

#include <ATen/ATen.h>

namespace titan::metrics {

struct MemoryStats {
  double peak_gib = 0;
  double peak_pct = 0;  // of the device's capacity (total RAM on CPU)
};

class MemoryMonitor {
 public:
  explicit MemoryMonitor(const at::Device& device);
  MemoryStats peak() const;
  void reset_peak();
  std::string describe() const;  // "CPU: 23.47GiB memory"
  double capacity_bytes() const { return capacity_; }

 private:
  at::Device device_;
  double capacity_ = 0;
};

// Memory this process may still grow into, in bytes, and where the figure comes from: on CUDA the device's
// free memory plus what this process's allocator holds; on the CPU what Linux reports available (MemAvailable, or
// the cgroup's limit minus its usage when that is lower), shared evenly by `local_ranks` processes, plus this
// process's resident set.
struct AvailableMemory {
  double bytes = 0;
  std::string source;
};
AvailableMemory available_memory(const at::Device& device, int local_ranks);

// CPU training: installs the host block cache (host_block_cache.h) as LibTorch's CPU allocator, so that a step's
// large tensors reuse the blocks the previous step freed instead of page-faulting them in again, and tells glibc's
// malloc, which serves the smaller ones, not to trim its heap. Leaves everything alone when LD_PRELOAD names another
// malloc or TITAN_HOST_ALLOCATOR=malloc; leaves glibc's settings alone when GLIBC_TUNABLES sets a glibc.malloc
// tunable. Returns what was done, for the log.
std::string keep_freed_host_memory();

// Current and peak resident set size of this process in bytes (Linux /proc).
int64_t current_rss_bytes();
int64_t peak_rss_bytes();

}  // namespace titan::metrics
