// Peak FLOP/s of the device a rank trains on, for MFU: torchtitan's table of GPU bf16 peaks on GPUs; on a CPU, the
// best measured rate of matmuls of several shapes in the compute dtype on the threads in use, cached per machine,
// CPU model, thread count, dtype, LibTorch version and titan build in ~/.cache/titan/peak_flops.json
// ($XDG_CACHE_HOME/titan), with the instruction-rate bound (vector width x FMA units x clock x cores) printed beside
// it, and measured again when a training step runs faster than it. A measurement made while other work held the CPUs
// (a 50 ms check of the share of CPU time busy threads get, before and after) is marked so in the cache and used only
// while the machine stays busy: the next start that finds it quiet measures again. TITAN_PEAK_FLOPS overrides either.
#pragma once
#include <string>

#include <ATen/ATen.h>

namespace titan::metrics {

struct PeakFlops {
  double flops = 0;         // per device, FLOP/s
  std::string derivation;   // how the figure was obtained, printed at start-up
  // A CPU rate titan measured (not a GPU's table, not TITAN_PEAK_FLOPS), in `dtype`, cached when `may_cache`.
  bool measured = false;
  at::ScalarType dtype = at::kFloat;
  bool may_cache = true;
};

// dtype: the compute dtype (float32, or bfloat16 under mixed precision or bf16 training).
// may_cache: read and write the per-machine cache (false when several ranks share the machine: what each measures
// then depends on its neighbours).
PeakFlops peak_flops(const at::Device& device, at::ScalarType compute_dtype, bool may_cache = true);

// For a step that reached `achieved` FLOP/s above a measured CPU peak (a cached figure from a slow moment, or a
// machine that changed under the same key): measures again, bypassing the cache, and returns the larger of that and
// `achieved`, stored in the cache, so MFU never reads above 100%. Other peaks are returned unchanged.
PeakFlops remeasured_peak_flops(const PeakFlops& peak, double achieved);

// Peak bf16 FLOP/s of a GPU from its name (A100, H100 SXM/PCIe/NVL, H200, H20, B200, MI250X, MI300X/MI325X,
// MI355X, L40S); 0 when unknown.
double gpu_peak_flops_by_name(const std::string& name);

// The share of the CPU time `threads` busy threads of this process get now (50 ms of spinning): 1 on an idle
// machine, about 0.5 when as many other threads want the same cores. TITAN_TEST_CPU_SHARE overrides it.
double cpu_share_now(int threads);

// The CPU clock in Hz: cpufreq's maximum, /proc/cpuinfo, or a timed chain of dependent adds.
double cpu_clock_hz(std::string& how);

}  // namespace titan::metrics
