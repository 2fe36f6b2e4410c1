// Peak FLOP/s of the device a rank trains on, for MFU: torchtitan's table of GPU bf16 peaks on GPUs; on a CPU,
// derived from vector width, FMA units, the cores used and the clock (TITAN_PEAK_FLOPS overrides either).
#pragma once
#include <string>

#include <ATen/ATen.h>

namespace titan::metrics {

struct PeakFlops {
  double flops = 0;         // per device, FLOP/s
  std::string derivation;   // how the figure was obtained, printed at start-up
};

// dtype: the compute dtype (float32, or bfloat16 under mixed precision or bf16 training).
PeakFlops peak_flops(const at::Device& device, at::ScalarType compute_dtype);

// Peak bf16 FLOP/s of a GPU from its name (A100, H100 SXM/PCIe/NVL, H200, H20, B200, MI250X, MI300X/MI325X,
// MI355X, L40S); 0 when unknown.
double gpu_peak_flops_by_name(const std::string& name);

// The CPU clock in Hz: cpufreq's maximum, /proc/cpuinfo, or a timed chain of dependent adds.
double cpu_clock_hz(std::string& how);

}  // namespace titan::metrics
