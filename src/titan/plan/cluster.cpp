#include "titan/plan/cluster.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::plan {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0, kGB = 1e9, kTera = 1e12;

ClusterProfile profile(std::string name, std::string description, double bf16_tflops, double fp8_tflops, double memory_gib,
                       double bandwidth_gbs, double intra_gbs, double inter_gbs, int64_t per_node, double efficiency,
                       int64_t multiprocessors, double launch_us, std::string source) {
  ClusterProfile p;
  p.name = std::move(name);
  p.description = std::move(description);
  p.peak_bf16_flops = bf16_tflops * kTera;
  p.peak_fp8_flops = fp8_tflops * kTera;
  p.memory_bytes = memory_gib * kGiB;
  p.memory_bandwidth = bandwidth_gbs * kGB;
  p.intra_node_bandwidth = intra_gbs * kGB;
  p.inter_node_bandwidth = inter_gbs * kGB;
  p.gpus_per_node = per_node;
  p.matmul_efficiency = efficiency;
  p.multiprocessors = multiprocessors;
  p.gemm_launch_seconds = launch_us * 1e-6;
  p.source = std::move(source);
  p.vendor = p.name.rfind("mi", 0) == 0 ? "amd" : "nvidia";
  return p;
}

}  // namespace

const std::vector<ClusterProfile>& builtin_cluster_profiles() {
  // Peaks, memory and links are the vendors' datasheet figures (dense, no sparsity; "80GB" of HBM is 80 GiB, of
  // which the allocator gets slightly less: the context is a term of its own); inter-node bandwidth is one
  // 400 Gb/s NIC per GPU unless stated. matmul_efficiency is the share of the peak that large bf16 GEMMs sustain
  // in published cuBLAS/hipBLASLt measurements (docs/plan.md lists them); then the SMs or CUs of the datasheets and
  // the fixed time of one matmul launch in microseconds, chosen per architecture on OpenXLA's published GEMM table
  // (Hopper 2, Blackwell 6, CDNA 3 0: its rates show none; Ampere and CDNA 2, which the table lacks, take their
  // successors').
  static const std::vector<ClusterProfile> profiles = {
      profile("h100-sxm", "NVIDIA H100 SXM5 80GB, 700 W, NVLink 4, 8 per node", 989.4, 1978.9, 80, 3350, 450, 50, 8, 0.72, 132, 2,
              "NVIDIA H100 datasheet; GEMM ~710 TFLOP/s bf16"),
      profile("h100-nvl", "NVIDIA H100 NVL 94GB, 400 W, PCIe 5 with NVLink bridges in pairs", 835.5, 1670.5, 94, 3900, 64, 50, 8,
              0.72, 132, 2, "NVIDIA H100 NVL datasheet; links: PCIe 5 x16"),
      profile("h100-pcie", "NVIDIA H100 PCIe 80GB, 350 W", 756.5, 1513, 80, 2000, 64, 50, 8, 0.72, 114, 2,
              "NVIDIA H100 PCIe datasheet; links: PCIe 5 x16"),
      profile("h200", "NVIDIA H200 SXM 141GB, 700 W, NVLink 4, 8 per node", 989.4, 1978.9, 141, 4800, 450, 50, 8, 0.72, 132, 2,
              "NVIDIA H200 datasheet"),
      profile("a100-80gb", "NVIDIA A100 SXM4 80GB, NVLink 3, 8 per node, 200 Gb/s per GPU", 312, 0, 80, 2039, 300, 25, 8, 0.80, 108, 2,
              "NVIDIA A100 datasheet; GEMM ~250 TFLOP/s bf16"),
      profile("mi250x-gcd", "AMD MI250X, one GCD (half a package), Frontier node: 8 GCDs, 4 x 200 Gb/s", 191.5, 0, 64, 1638,
              50, 12.5, 8, 0.62, 110, 0, "AMD MI250X datasheet (383 TFLOP/s and 3.2 TB/s per package); ORNL Frontier guide"),
      profile("mi300x", "AMD MI300X 192GB, Infinity Fabric, 8 per node", 1307.4, 2614.9, 192, 5300, 448, 50, 8, 0.45, 304, 0,
              "AMD MI300X datasheet; GEMM 583 TFLOP/s bf16 at 4096 cubed (OpenXLA's published table)"),
      profile("b200", "NVIDIA B200 180GB (HGX), NVLink 5, 8 per node", 2250, 4500, 180, 8000, 900, 50, 8, 0.60, 148, 6,
              "NVIDIA HGX B200 datasheet"),
      profile("gb200", "NVIDIA GB200 NVL72: one Blackwell GPU, 186GB, NVLink 5 across 72 GPUs", 2500, 5000, 186, 8000, 900, 50,
              72, 0.60, 148, 6, "NVIDIA GB200 NVL72 datasheet (per GPU)"),
  };
  return profiles;
}

ClusterProfile load_cluster_profile(const std::string& spec) {
  for (const auto& p : builtin_cluster_profiles())
    if (p.name == spec) return p;
  std::vector<std::string> names;
  for (const auto& p : builtin_cluster_profiles()) names.push_back(p.name);
  if (!std::filesystem::exists(spec) || std::filesystem::is_directory(spec))
    fail("--cluster ", quote(spec), ": neither a built-in profile (", join(names, ", "), ") nor a TOML file");
  toml::table table;
  try {
    table = toml::parse_file(spec);
  } catch (const toml::parse_error& e) {
    fail(spec, ":", e.source().begin.line, ": not valid TOML: ", e.description());
  }
  ClusterProfile p;
  if (auto base = table["base"]) {
    auto name = base.value<std::string>();
    if (!name) fail(spec, ": base must be a string naming a built-in profile (", join(names, ", "), ")");
    bool found = false;
    for (const auto& b : builtin_cluster_profiles())
      if (b.name == *name) p = b, found = true;
    if (!found) fail(spec, ": base = ", quote(*name), " is not a built-in profile (", join(names, ", "), ")");
  }
  p.name = std::filesystem::path(spec).stem().string();
  p.source = spec;
  struct Number {
    double* target;
    double scale;
  };
  const std::map<std::string, Number> numbers = {
      {"peak_bf16_tflops", {&p.peak_bf16_flops, kTera}},      {"peak_fp8_tflops", {&p.peak_fp8_flops, kTera}},
      {"memory_gib", {&p.memory_bytes, kGiB}},                  {"memory_bandwidth_gbs", {&p.memory_bandwidth, kGB}},
      {"intra_node_bandwidth_gbs", {&p.intra_node_bandwidth, kGB}}, {"inter_node_bandwidth_gbs", {&p.inter_node_bandwidth, kGB}},
      {"matmul_efficiency", {&p.matmul_efficiency, 1.0}},
      {"compile_memory_share", {&p.calibration.compile_memory_share, 1.0}},
      {"float8_relative_efficiency", {&p.calibration.float8_relative_efficiency, 1.0}},
      {"ring_attention_overhead_per_rank", {&p.calibration.ring_attention_overhead_per_rank, 1.0}},
      {"allocator_overhead", {&p.calibration.allocator_overhead, 1.0}},
      {"gemm_launch_us", {&p.gemm_launch_seconds, 1e-6}}};
  // The calibration keys have defaults (Calibration); overheads may be 0.
  const std::vector<std::string> optional = {"peak_fp8_tflops", "compile_memory_share", "float8_relative_efficiency",
                                             "ring_attention_overhead_per_rank", "allocator_overhead", "gemm_launch_us"};
  const std::vector<std::string> zero_allowed = {"peak_fp8_tflops", "ring_attention_overhead_per_rank", "allocator_overhead",
                                                 "gemm_launch_us"};
  std::vector<std::string> present;
  for (const auto& [key, node] : table) {
    const std::string k(key.str());
    const int line = static_cast<int>(node.source().begin.line);
    if (k == "base") continue;
    if (k == "name" || k == "description" || k == "source") {
      auto s = node.value<std::string>();
      if (!s) fail(spec, ":", line, ": ", k, " must be a string");
      (k == "name" ? p.name : k == "description" ? p.description : p.source) = *s;
    } else if (k == "vendor") {
      auto s = node.value<std::string>();
      if (!s || (*s != "nvidia" && *s != "amd")) fail(spec, ":", line, ": vendor must be \"nvidia\" or \"amd\"");
      p.vendor = *s;
    } else if (k == "gpus_per_node" || k == "multiprocessors") {
      auto v = node.value<int64_t>();
      // multiprocessors may be 0: matmul shapes not modelled (every matmul at matmul_efficiency).
      const int64_t least = k == "gpus_per_node" ? 1 : 0;
      if (!node.is_integer() || !v || *v < least)
        fail(spec, ":", line, ": ", k, least == 1 ? " must be a positive integer" : " must be an integer, 0 or more");
      (k == "gpus_per_node" ? p.gpus_per_node : p.multiprocessors) = *v;
    } else if (auto it = numbers.find(k); it != numbers.end()) {
      auto v = node.value<double>();
      // peak_fp8_tflops may be 0 (no float8 matmuls), and the overheads; every other figure must be positive.
      const bool zero_ok = std::find(zero_allowed.begin(), zero_allowed.end(), k) != zero_allowed.end();
      if (!(node.is_integer() || node.is_floating_point()) || !v || !std::isfinite(*v) || *v < 0 || (*v == 0 && !zero_ok))
        fail(spec, ":", line, ": ", k, zero_ok ? " must be a finite number, 0 or more" : " must be a finite positive number");
      *it->second.target = *v * it->second.scale;
      present.push_back(k);
    } else {
      std::vector<std::string> keys = {"base", "name", "description", "source", "vendor", "gpus_per_node", "multiprocessors"};
      for (const auto& [n, _] : numbers) keys.push_back(n);
      fail(spec, ":", line, ": unknown key ", quote(k), "; known keys: ", join(keys, ", "));
    }
  }
  if (!table["base"]) {
    std::vector<std::string> missing;
    for (const auto& [k, n] : numbers)
      if (std::find(optional.begin(), optional.end(), k) == optional.end() &&
          std::find(present.begin(), present.end(), k) == present.end())
        missing.push_back(k);
    if (!table["gpus_per_node"]) missing.push_back("gpus_per_node");
    if (!missing.empty()) fail(spec, ": ", join(missing, ", "), " missing (and no base profile gives them)");
  }
  if (p.matmul_efficiency > 1) fail(spec, ": matmul_efficiency must be a fraction of the peak (0 to 1), got ", p.matmul_efficiency);
  if (p.calibration.compile_memory_share > 1)
    fail(spec, ": compile_memory_share must be a fraction of the eager bytes (0 to 1), got ", p.calibration.compile_memory_share);
  return p;
}

}  // namespace titan::plan
