// The step line's GPU numbers: the caching allocator's peak (non-zero, below the device's memory, reset per
// window) and the peak FLOP/s that MFU divides by (this GPU found in torchtitan's table).
#include "gpu_test_util.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include "titan/components/metrics/cuda_device.h"
#include "titan/components/metrics/memory.h"
#include "titan/components/metrics/peak_flops.h"

using titan_gpu_test::figure;

TEST(CudaMetrics, MemoryMonitorReportsTheCachingAllocatorsPeak) {
  TITAN_REQUIRE_CUDA();
  const at::Device device(at::kCUDA, 0);
  titan::metrics::MemoryMonitor monitor(device);
  const double total_gib = monitor.capacity_bytes() / (1024.0 * 1024.0 * 1024.0);
  EXPECT_GT(total_gib, 1.0);
  EXPECT_NE(monitor.describe().find("CUDA capacity"), std::string::npos) << monitor.describe();
  figure("gpu.name", titan::metrics::cuda_device_name(0));
  figure("gpu.memory_gib", total_gib);

  c10::cuda::CUDACachingAllocator::emptyCache();
  monitor.reset_peak();
  {
    at::Tensor block = at::empty({1LL << 28}, at::TensorOptions().device(device).dtype(at::kFloat));  // 1 GiB
    block.fill_(1.0);
    auto stats = monitor.peak();
    EXPECT_GE(stats.peak_gib, 1.0);
    EXPECT_LT(stats.peak_gib, total_gib);
    EXPECT_GT(stats.peak_pct, 0.0);
    EXPECT_LT(stats.peak_pct, 100.0);
    figure("gpu.memory_monitor_peak_gib_after_1gib", stats.peak_gib);
  }
  // A new window starts from what is reserved now: after returning the cache, well below the 1 GiB peak.
  c10::cuda::CUDACachingAllocator::emptyCache();
  monitor.reset_peak();
  EXPECT_LT(monitor.peak().peak_gib, 0.5);
}

TEST(CudaMetrics, PeakFlopsKnowsThisGpu) {
  TITAN_REQUIRE_CUDA();
  const std::string name = titan::metrics::cuda_device_name(0);
  auto peak = titan::metrics::peak_flops(at::Device(at::kCUDA, 0), at::kBFloat16);
  EXPECT_GT(peak.flops, 0.0);
  figure("gpu.peak_flops_used_for_mfu", peak.flops);
  figure("gpu.peak_flops_derivation", peak.derivation);
  // The GPUs this project is tested on must not fall back to the A100 guess.
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) {
    EXPECT_EQ(peak.derivation.find("unknown"), std::string::npos) << peak.derivation;
  }
}
