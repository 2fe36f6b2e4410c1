// Counts the bytes LibTorch allocates on the CPU (current and peak), by wrapping the CPU allocator. Used to
// measure activation memory exactly (peak RSS also counts allocator caching and library pages).
#pragma once
#include <cstdint>

namespace titan::metrics {

// Installs the counting allocator (idempotent); tensors allocated before keep their original deleters.
void install_cpu_allocation_tracker();
int64_t cpu_bytes_in_use();
int64_t cpu_peak_bytes();
void reset_cpu_peak_bytes();  // peak := current

}  // namespace titan::metrics
