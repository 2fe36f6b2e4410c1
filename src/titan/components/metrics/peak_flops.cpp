#include "titan/components/metrics/peak_flops.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/cuda_device.h"

namespace titan::metrics {
namespace {

std::string cpuinfo_field(const std::string& field) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (trim(line.substr(0, colon)) == field) return trim(line.substr(colon + 1));
  }
  return "";
}

bool has_flag(const std::string& flags, const std::string& flag) {
  std::istringstream in(flags);
  std::string f;
  while (in >> f)
    if (f == flag) return true;
  return false;
}

double measure_clock_hz() {
  // A chain of dependent integer adds retires one add per cycle on every x86 core of the last decade.
  constexpr long iterations = 20'000'000;
  double best = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    uint64_t x = 0;
    auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < iterations; ++i) {
#if defined(__x86_64__)
      asm volatile(
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
          : "+r"(x));
#else
      asm volatile("" : "+r"(x));
      x += 1;
#endif
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 8.0 * iterations / seconds);
  }
  return best;
}

}  // namespace

double cpu_clock_hz(std::string& how) {
  std::ifstream max_freq("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
  double khz = 0;
  if (max_freq >> khz && khz > 0) {
    how = "cpufreq maximum";
    return khz * 1e3;
  }
  std::string mhz = cpuinfo_field("cpu MHz");
  if (!mhz.empty() && std::atof(mhz.c_str()) > 0) {
    how = "/proc/cpuinfo";
    return std::atof(mhz.c_str()) * 1e6;
  }
  how = "measured with a dependent-add loop";
  return measure_clock_hz();
}

double gpu_peak_flops_by_name(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("A100")) return 312e12;
  if (has("H100")) return has("NVL") ? 835e12 : has("PCIe") ? 756e12 : 989e12;
  if (has("H200")) return 989e12;
  if (has("H20")) return 148e12;
  if (has("B200")) return 2.25e15;
  if (has("MI355X")) return 2500e12;
  if (has("MI300X") || has("MI325X")) return 1300e12;
  if (has("MI250X")) return 191.5e12;
  if (has("L40S") || has("l40s")) return 362e12;
  return 0;
}

PeakFlops peak_flops(const at::Device& device, at::ScalarType compute_dtype) {
  PeakFlops out;
  if (const char* env = std::getenv("TITAN_PEAK_FLOPS")) {
    out.flops = std::atof(env);
    out.derivation = cat("peak ", strprintf("%.4g", out.flops), " FLOP/s from TITAN_PEAK_FLOPS");
    return out;
  }
  if (device.is_cuda()) {
    const std::string name = cuda_device_name(device.index());
    out.flops = gpu_peak_flops_by_name(name);
    if (out.flops > 0) {
      out.derivation = cat(name, ": peak ", strprintf("%.1f", out.flops / 1e12), " TFLOP/s (dense bf16, torchtitan's table)");
    } else {
      out.flops = 312e12;
      out.derivation = cat("peak FLOP/s unknown for ", name, "; assuming A100 (312 TFLOP/s) as torchtitan does");
    }
    return out;
  }
  const std::string flags = cpuinfo_field("flags");
  const std::string vendor = cpuinfo_field("vendor_id");
  const int family = std::atoi(cpuinfo_field("cpu family").c_str());
  const bool avx512 = has_flag(flags, "avx512f"), avx2 = has_flag(flags, "avx2"), fma = has_flag(flags, "fma");
  // AMD Zen 4 (family 0x19) executes 512-bit instructions on 256-bit units.
  int vector_bits = avx512 ? 512 : avx2 ? 256 : 128;
  if (avx512 && vendor == "AuthenticAMD" && family == 0x19) vector_bits = 256;
  const int fma_units = 2;
  double per_cycle = (vector_bits / 32.0) * (fma ? 2.0 : 1.0) * fma_units;
  std::string precision = "fp32";
  if (compute_dtype == at::kBFloat16 || compute_dtype == at::kHalf) {
    if (has_flag(flags, "amx_bf16")) {
      per_cycle = 1024.0;  // one AMX tile multiply unit: 512 bf16 multiply-adds per cycle
      precision = "bf16 via AMX";
    } else if (has_flag(flags, "avx512_bf16") || has_flag(flags, "avx_vnni")) {
      per_cycle *= 2;  // dot-product instructions process two bf16 pairs per fp32 lane
      precision = "bf16 dot products";
    } else {
      precision = "bf16 computed at the fp32 rate";
    }
  }
  const int cores = at::get_num_threads();
  std::string clock_how;
  const double hz = cpu_clock_hz(clock_how);
  out.flops = cores * hz * per_cycle;
  out.derivation = cat("CPU peak ", strprintf("%.1f", out.flops / 1e9), " GFLOP/s = ", cores, " cores x ",
                       strprintf("%.2f", hz / 1e9), " GHz (", clock_how, ") x ", per_cycle, " FLOP/cycle (",
                       vector_bits, "-bit vectors, ", fma ? "FMA" : "no FMA", ", ", fma_units, " units, ", precision,
                       "); override with TITAN_PEAK_FLOPS");
  return out;
}

}  // namespace titan::metrics
