#include "titan/components/metrics/peak_flops.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <ctime>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/cuda_device.h"
#include "titan/nn/matmul.h"

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

// Best rate of an m x k by k x n product in `dtype` over `budget` seconds (at least three repeats after a warm-up).
double best_product_rate(at::ScalarType dtype, int64_t m, int64_t k, int64_t n, double budget) {
  at::Tensor a = at::randn({m, k}).to(dtype), b = at::randn({k, n}).to(dtype), c = at::empty({m, n}, a.options());
  nn::mm_out(c, a, b);  // warm-up: thread pool, kernel selection, page faults
  double best = 0, spent = 0;
  for (int i = 0; i < 50 && (i < 3 || spent < budget); ++i) {
    const auto start = std::chrono::steady_clock::now();
    nn::mm_out(c, a, b);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    spent += seconds;
    best = std::max(best, 2.0 * static_cast<double>(m * k * n) / seconds);
  }
  return best;
}

// The best rate of matmuls in `dtype` on this process's threads (those training uses) over several shapes: one
// shape's figure depends on how its blocking fits the caches, and a single short measurement on a shared machine
// can land in a slow moment. `quick` (several ranks measuring beside each other, nothing cached) measures one shape.
double measure_matmul_flops(at::ScalarType dtype, bool quick, std::string& shapes) {
  at::NoGradGuard no_grad;
  struct Shape {
    int64_t m, k, n;
  };
  const std::vector<Shape> all = {{1024, 1024, 1024}, {2048, 2048, 2048}, {4096, 1024, 2048}};
  const std::vector<Shape> chosen = quick ? std::vector<Shape>{all[0]} : all;
  double best = 0;
  shapes.clear();
  for (const Shape& s : chosen) {
    best = std::max(best, best_product_rate(dtype, s.m, s.k, s.n, quick ? 1.0 : 0.5));
    shapes += cat(shapes.empty() ? "" : ", ", s.m, "x", s.k, "x", s.n);
  }
  return best;
}

}  // namespace

// Each thread spins for 50 ms and compares the CPU time the kernel gave it with the time that passed. After a pause
// of 30 ms first: the worker threads of the last parallel operation spin for some milliseconds before they sleep
// (right after the matmuls the check read 0.80 on an idle 2-core machine without it, 0.96-0.99 with it).
double cpu_share_now(int threads) {
  if (const char* forced = std::getenv("TITAN_TEST_CPU_SHARE")) return std::atof(forced);
  threads = std::max(1, threads);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  std::vector<double> cpu(static_cast<size_t>(threads)), wall(static_cast<size_t>(threads));
  auto spin = [&](size_t i) {
    timespec start_cpu{}, end_cpu{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start_cpu);
    const auto start = std::chrono::steady_clock::now();
    volatile uint64_t x = 0;
    while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(50)) x = x + 1;
    wall[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end_cpu);
    cpu[i] = static_cast<double>(end_cpu.tv_sec - start_cpu.tv_sec) + 1e-9 * static_cast<double>(end_cpu.tv_nsec - start_cpu.tv_nsec);
  };
  std::vector<std::thread> pool;
  for (size_t i = 1; i < cpu.size(); ++i) pool.emplace_back(spin, i);
  spin(0);
  for (auto& t : pool) t.join();
  double cpu_sum = 0, wall_sum = 0;
  for (size_t i = 0; i < cpu.size(); ++i) cpu_sum += cpu[i], wall_sum += wall[i];
  return wall_sum > 0 ? std::min(1.0, cpu_sum / wall_sum) : 1.0;
}

namespace {

// Below this share the machine was busy during a measurement: the rate it gave is kept for later runs only until a
// quieter moment.
constexpr double kQuietShare = 0.85;

// A measurement with the CPU share around it (the smaller of before and after). `quick` (several ranks beside each
// other, nothing cached) skips the check: nothing would be kept for a quieter start.
struct Measured {
  double flops = 0, share = 1;
  std::string shapes;
};

Measured measure_with_share(at::ScalarType dtype, bool quick) {
  Measured out;
  const double before = quick ? 1.0 : cpu_share_now(at::get_num_threads());
  out.flops = measure_matmul_flops(dtype, quick, out.shapes);
  if (!quick) out.share = std::min(before, cpu_share_now(at::get_num_threads()));
  return out;
}

std::string busy_note(double share) {
  return cat(" while other work held the CPUs (its threads had ", strprintf("%.0f", 100 * share),
             "% of their time; measured again at a quieter start)");
}

// Which machine this is: systemd's machine id, else the host name.
std::string machine_identity() {
  std::ifstream id("/etc/machine-id");
  std::string line;
  if (std::getline(id, line) && !trim(line).empty()) return "machine " + trim(line);
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) == 0) return cat("host ", host);
  return "unknown machine";
}

std::filesystem::path cache_file() {
  const std::filesystem::path dir = user_cache_dir();
  return dir.empty() ? dir : dir / "peak_flops.json";
}

// The instruction-rate bound: vector width x FMA units x clock x cores (what a vendor's datasheet would quote).
double instruction_rate_bound(at::ScalarType compute_dtype, std::string& how) {
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
  how = cat(cores, " cores x ", strprintf("%.2f", hz / 1e9), " GHz (", clock_how, ") x ", per_cycle, " FLOP/cycle (",
            vector_bits, "-bit vectors, ", fma ? "FMA" : "no FMA", ", ", fma_units, " units, ", precision, ")");
  return cores * hz * per_cycle;
}

std::string cpu_dtype_name(at::ScalarType dtype) {
  // bf16 on CPUs without AVX512_BF16 multiplies in float32 (nn/matmul.h): that rate is the peak, under its own key.
  if (dtype == at::kBFloat16) return nn::emulates_bf16_gemm() ? "bf16 (products in float32)" : "bf16";
  return dtype == at::kHalf ? "fp16" : "fp32";
}

// Everything that changes the answer: the machine and its CPU model, the threads, the dtype, LibTorch and titan.
std::string cpu_cache_key(at::ScalarType dtype) {
  return cat(cpuinfo_field("model name"), " | ", machine_identity(), " | ", at::get_num_threads(), " threads | ",
             cpu_dtype_name(dtype), " | LibTorch ", TORCH_VERSION, " | ", binary_identity());
}

nlohmann::json read_cache(const std::filesystem::path& path) {
  std::error_code exists_error;
  if (path.empty() || !std::filesystem::exists(path, exists_error)) return nlohmann::json::object();
  try {
    std::ifstream in(path);
    nlohmann::json cache = nlohmann::json::parse(in);
    if (cache.is_object()) return cache;
  } catch (const std::exception&) {
  }
  return nlohmann::json::object();  // a damaged cache is measured again and rewritten
}

// Stores `flops` under `key` and returns what to add to the derivation.
std::string write_cache_entry(const std::filesystem::path& path, nlohmann::json& cache, const std::string& key, double flops,
                              const std::string& shapes, double share) {
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  try {
    cache[key] = {{"flops", flops}, {"measured", std::string(when)}, {"shapes", shapes}, {"cpu_share", share}};
    std::filesystem::create_directories(path.parent_path());
    write_file(path.string(), cache.dump(1) + "\n");  // through a temporary and a rename: concurrent runs never see half a file
    return cat(", cached in ", path.string());
  } catch (const std::exception& e) {
    return cat(" (not cached: ", e.what(), ")");
  }
}

std::string cpu_derivation(at::ScalarType dtype, double flops, const std::string& how) {
  std::string bound_how;
  const double bound = instruction_rate_bound(dtype, bound_how);
  return cat("CPU peak ", strprintf("%.1f", flops / 1e9), " GFLOP/s (", cpu_dtype_name(dtype), " matmul rate, ", how,
             "); instruction-rate bound ", strprintf("%.1f", bound / 1e9), " GFLOP/s = ", bound_how,
             "; override with TITAN_PEAK_FLOPS");
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

PeakFlops peak_flops(const at::Device& device, at::ScalarType compute_dtype, bool may_cache) {
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
  // CPU: the best measured matmul rate in the compute dtype (about two seconds), cached per machine, CPU model,
  // thread count, dtype, LibTorch version and titan build, as the attainable peak; the instruction-rate bound is
  // printed beside it.
  out.measured = true;
  out.dtype = compute_dtype;
  out.may_cache = may_cache;
  const std::string dtype_name = cpu_dtype_name(compute_dtype);
  const std::string key = cpu_cache_key(compute_dtype);
  const std::filesystem::path path = may_cache ? cache_file() : std::filesystem::path();
  nlohmann::json cache = read_cache(path);
  // An entry with fields of the wrong type counts as absent (measured again and rewritten).
  const auto it = cache.find(key);
  bool cached = it != cache.end() && it->is_object() && it->contains("flops") && (*it)["flops"].is_number() &&
                (*it)["flops"].get<double>() > 0;
  // A figure measured while the machine was busy is used only while it still is: at a quieter start it is measured
  // again (a 50 ms check; entries written before this check count as quiet).
  double cached_share = 1;
  if (cached && it->contains("cpu_share") && (*it)["cpu_share"].is_number()) cached_share = (*it)["cpu_share"].get<double>();
  const bool replaces_busy = cached && cached_share < kQuietShare && cpu_share_now(at::get_num_threads()) >= kQuietShare;
  if (replaces_busy) cached = false;
  std::string how;
  if (cached) {
    out.flops = (*it)["flops"].get<double>();
    const std::string when = it->contains("measured") && (*it)["measured"].is_string() ? (*it)["measured"].get<std::string>() : "earlier";
    how = cat("measured ", when, cached_share < kQuietShare ? busy_note(cached_share) : "", ", cached in ", path.string(),
              "; delete it to measure again");
  } else {
    const Measured m = measure_with_share(compute_dtype, !may_cache);
    out.flops = m.flops;
    how = cat("measured now: best of ", dtype_name, " matmuls of ", m.shapes, " on ", at::get_num_threads(), " threads",
              may_cache ? "" : " beside the other ranks on this machine, not cached", m.share < kQuietShare ? busy_note(m.share) : "",
              replaces_busy ? " (the cached figure had been measured while the CPUs were busy)" : "");
    if (!path.empty()) how += write_cache_entry(path, cache, key, out.flops, m.shapes, m.share);
  }
  out.derivation = cpu_derivation(compute_dtype, out.flops, how);
  return out;
}

PeakFlops remeasured_peak_flops(const PeakFlops& peak, double achieved) {
  if (!peak.measured) return peak;
  PeakFlops out = peak;
  const Measured m = measure_with_share(peak.dtype, !peak.may_cache);
  out.flops = std::max(m.flops, achieved);
  std::string how = cat("measured again (best of ", cpu_dtype_name(peak.dtype), " matmuls of ", m.shapes, ": ",
                        strprintf("%.1f", m.flops / 1e9), " GFLOP/s", m.share < kQuietShare ? busy_note(m.share) : "",
                        ") because a step reached ", strprintf("%.1f", achieved / 1e9), " GFLOP/s, above the peak of ",
                        strprintf("%.1f", peak.flops / 1e9), " GFLOP/s used until then",
                        achieved > m.flops ? "; the step's own rate is the peak now" : "");
  if (peak.may_cache) {
    const std::filesystem::path path = cache_file();
    if (!path.empty()) {
      nlohmann::json cache = read_cache(path);
      // The step's rate is a lower bound on the quiet rate: a busy measurement raised to it is still marked busy.
      how += write_cache_entry(path, cache, cpu_cache_key(peak.dtype), out.flops, m.shapes, m.share);
    }
  }
  out.derivation = cpu_derivation(peak.dtype, out.flops, how);
  return out;
}

}  // namespace titan::metrics
