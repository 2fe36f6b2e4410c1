// CUDA device facts for metrics (name, memory, caching-allocator peaks); stubs that report "no CUDA" when
// LibTorch was built without it (TITAN_WITH_CUDA unset).
#pragma once
#include <cstdint>
#include <string>

namespace titan::metrics {

bool cuda_available();
std::string cuda_device_name(int index);
double cuda_total_memory_bytes(int index);
// Free device memory (cudaMemGetInfo) plus what this process's caching allocator already holds on it.
double cuda_usable_memory_bytes(int index);
int64_t cuda_peak_reserved_bytes(int index);
void cuda_reset_peak(int index);

}  // namespace titan::metrics
