// Peak FLOP/s of the device a rank trains on, for MFU: torchtitan's table of GPU bf16 peaks on GPUs; on a CPU, the
// measured rate of a large matmul in the compute dtype on the threads in use, cached per machine in
// ~/.cache/titan/peak_flops.json ($XDG_CACHE_HOME/titan), with the instruction-rate bound (vector width x FMA
// units x clock x cores) printed beside it. TITAN_PEAK_FLOPS overrides either.
#pragma once
#include <string>

#include <ATen/ATen.h>

namespace titan::metrics {

struct PeakFlops {
  double flops = 0;         // per device, FLOP/s
  std::string derivation;   // how the figure was obtained, printed at start-up
};

// dtype: the compute dtype (float32, or bfloat16 under mixed precision or bf16 training).
// may_cache: read and write the per-machine cache (false when several ranks share the machine: what each measures
// then depends on its neighbours).
PeakFlops peak_flops(const at::Device& device, at::ScalarType compute_dtype, bool may_cache = true);

// Peak bf16 FLOP/s of a GPU from its name (A100, H100 SXM/PCIe/NVL, H200, H20, B200, MI250X, MI300X/MI325X,
// MI355X, L40S); 0 when unknown.
double gpu_peak_flops_by_name(const std::string& name);

// The CPU clock in Hz: cpufreq's maximum, /proc/cpuinfo, or a timed chain of dependent adds.
double cpu_clock_hz(std::string& how);

}  // namespace titan::metrics
