#include "titan/components/metrics/memory.h"

#include <fstream>
#include <unistd.h>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/cuda_device.h"

namespace titan::metrics {
namespace {

int64_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line))
    if (starts_with(line, prefix)) return std::atoll(line.c_str() + prefix.size());
  return 0;
}

}  // namespace

int64_t current_rss_bytes() { return status_kib("VmRSS") * 1024; }
int64_t peak_rss_bytes() { return status_kib("VmHWM") * 1024; }

MemoryMonitor::MemoryMonitor(const at::Device& device) : device_(device) {
  if (device_.is_cuda()) capacity_ = cuda_total_memory_bytes(device_.index());
  else capacity_ = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}

MemoryStats MemoryMonitor::peak() const {
  MemoryStats s;
  double bytes = device_.is_cuda() ? static_cast<double>(cuda_peak_reserved_bytes(device_.index()))
                                   : static_cast<double>(peak_rss_bytes());
  s.peak_gib = bytes / (1024.0 * 1024.0 * 1024.0);
  s.peak_pct = capacity_ > 0 ? 100.0 * bytes / capacity_ : 0;
  return s;
}

void MemoryMonitor::reset_peak() {
  if (device_.is_cuda()) {
    cuda_reset_peak(device_.index());
    return;
  }
  // Linux (4.0+): writing 5 to clear_refs resets VmHWM to the current RSS.
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
}

std::string MemoryMonitor::describe() const {
  if (device_.is_cuda())
    return cat("CUDA capacity: ", cuda_device_name(device_.index()), " with ",
               strprintf("%.2f", capacity_ / (1024.0 * 1024.0 * 1024.0)), "GiB memory");
  return cat("CPU memory: ", strprintf("%.2f", capacity_ / (1024.0 * 1024.0 * 1024.0)), "GiB");
}

}  // namespace titan::metrics
