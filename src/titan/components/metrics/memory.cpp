#include "titan/components/metrics/memory.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <fstream>
#include <utility>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "titan/common/test_faults.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/cuda_device.h"
#include "titan/components/metrics/host_block_cache.h"

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

AvailableMemory available_memory(const at::Device& device, int local_ranks) {
  if (const auto fake = test_faults::available_memory_bytes()) return {*fake, "TITAN_TEST_AVAILABLE_MEMORY_BYTES"};
  if (device.is_cuda())
    return {cuda_usable_memory_bytes(device.index()), cat("free memory of ", cuda_device_name(device.index()))};
  const double mine = static_cast<double>(current_rss_bytes()), ranks = std::max(1, local_ranks);
  double spare = 0;
  std::string source = "MemAvailable in /proc/meminfo";
  {
    std::ifstream in("/proc/meminfo");
    std::string line;
    while (std::getline(in, line))
      if (starts_with(line, "MemAvailable:")) spare = static_cast<double>(std::atoll(line.c_str() + 13)) * 1024.0;
  }
  // A container's limit (cgroup v2, then v1) may be far below the machine's memory.
  for (const auto& [limit_file, usage_file] : {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                                               std::pair{"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                                         "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    std::ifstream limit_in(limit_file), usage_in(usage_file);
    std::string limit, usage;
    if (!(limit_in >> limit) || !(usage_in >> usage) || limit == "max") continue;
    const double room = std::stod(limit) - std::stod(usage);
    if (room < spare) {
      spare = std::max(0.0, room);
      source = cat("the cgroup limit in ", limit_file);
    }
    break;
  }
  return {spare / ranks + mine, local_ranks > 1 ? cat(source, " shared by ", local_ranks, " ranks on this machine") : source};
}

std::string keep_freed_host_memory() {
  // Another malloc put in front of glibc's (jemalloc, tcmalloc, mimalloc) has its own settings.
  if (const char* preload = std::getenv("LD_PRELOAD"); preload && std::string(preload).find("malloc") != std::string::npos)
    return cat("host allocator: the one LD_PRELOAD names (", preload, ")");
  if (const char* choice = std::getenv("TITAN_HOST_ALLOCATOR"); choice && *choice) {
    const std::string value = choice;
    if (value == "malloc") return "host allocator: the C library's malloc with its defaults (TITAN_HOST_ALLOCATOR=malloc)";
    if (value != "cache") fail("TITAN_HOST_ALLOCATOR=", quote(value), ": expected \"cache\" (the default) or \"malloc\"");
  }
  std::string small = "the C library's malloc";
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::string(tunables).find("glibc.malloc.") != std::string::npos) {
    small = "glibc malloc as GLIBC_TUNABLES sets it";
  } else if (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1) {
    small = "glibc malloc (no trimming, blocks up to 32 MiB from its heap)";
  }
#endif
  if (!install_host_block_cache())
    return cat("host allocator: LibTorch's allocation tracker was installed first, so large blocks are not cached; "
               "smaller ones from ", small);
  return cat("host allocator: blocks of 1 MiB and more mapped in size classes and kept for reuse (split for smaller "
             "requests, merged again when freed), smaller ones from ",
             small, " (TITAN_HOST_ALLOCATOR=malloc leaves LibTorch's allocator alone)");
}

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
