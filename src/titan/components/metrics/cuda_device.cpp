#include "titan/components/metrics/cuda_device.h"

#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include <ATen/Context.h>

namespace titan::metrics {

#ifdef TITAN_WITH_CUDA
bool cuda_available() { return at::hasCUDA(); }

std::string cuda_device_name(int index) { return at::cuda::getDeviceProperties(index)->name; }

double cuda_total_memory_bytes(int index) { return static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem); }

namespace {
// The caching allocator's statistics exist once LibTorch has initialised CUDA, which its first GPU tensor does; a
// monitor made before any (or a query from a fresh process) would otherwise be refused as "Invalid device argument".
void init_allocator() { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); }
}  // namespace

double cuda_usable_memory_bytes(int index) {
  init_allocator();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  const auto held = stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  return static_cast<double>(free) + static_cast<double>(held);
}

int64_t cuda_peak_reserved_bytes(int index) {
  init_allocator();
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

void cuda_reset_peak(int index) {
  init_allocator();
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}
#else
bool cuda_available() { return false; }
std::string cuda_device_name(int) { return ""; }
double cuda_total_memory_bytes(int) { return 0; }
double cuda_usable_memory_bytes(int) { return 0; }
int64_t cuda_peak_reserved_bytes(int) { return 0; }
void cuda_reset_peak(int) {}
#endif

}  // namespace titan::metrics
