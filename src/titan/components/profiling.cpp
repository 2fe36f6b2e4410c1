#include "titan/components/profiling.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#ifdef TITAN_WITH_CUDA
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/allocation_tracker.h"
#include "titan/components/metrics/host_block_cache.h"
#include "titan/components/metrics/memory.h"

namespace titan {

namespace fs = std::filesystem;
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

namespace {

ProfilerConfig kineto_config() {
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false);
}

}  // namespace

Profiler::Profiler(const config::Profiling& config, const std::string& dump_folder, int rank, bool cuda)
    : config_(config), dump_folder_(dump_folder), rank_(rank), cuda_(cuda) {
  if (config_.enable_profiling && config_.profiler_warmup + config_.profiler_active > config_.profile_freq)
    fail("profiling.profiler_warmup (", config_.profiler_warmup, ") + profiling.profiler_active (", config_.profiler_active,
         ") must not exceed profiling.profile_freq (", config_.profile_freq, "): each cycle of profile_freq steps waits, "
         "warms up, then records");
  if (config_.enable_profiling)
    log::info("Profiling: steps ", config_.profile_freq - config_.profiler_active + 1, " to ", config_.profile_freq,
              " of every ", config_.profile_freq, " are traced into ", (fs::path(dump_folder_) / config_.save_traces_folder).string());
  if (config_.enable_memory_snapshot) {
#ifdef TITAN_WITH_CUDA
    if (cuda_) {
      torch::cuda::_record_memory_history(std::string("all"), std::string("all"), "all", 100000);
      log::info("Memory snapshots: the CUDA caching allocator's history, every ", config_.profile_freq, " steps");
    }
#endif
    if (!cuda_) {
      metrics::install_cpu_allocation_tracker();
      log::warn("profiling.enable_memory_snapshot on a CPU: there is no caching-allocator history to snapshot (that is "
                "CUDA's); every ", config_.profile_freq, " steps titan writes rank{R}_memory.json with the bytes LibTorch "
                "holds on the CPU now and at peak, and the process's peak resident memory, instead");
    }
  }
}

Profiler::~Profiler() {
  if (recording_) kineto::disableProfiler();
}

Profiler::Phase Profiler::phase(int64_t step) const {
  const int64_t position = (step - 1) % config_.profile_freq;  // 0 .. profile_freq - 1
  if (position >= config_.profile_freq - config_.profiler_active) return Phase::active;
  if (position >= config_.profile_freq - config_.profiler_active - config_.profiler_warmup) return Phase::warmup;
  return Phase::wait;
}

void Profiler::step_begin(int64_t step) {
  if (!config_.enable_profiling) return;
  std::set<ActivityType> activities = {ActivityType::CPU};
  if (cuda_) activities.insert(ActivityType::CUDA);
  const Phase p = phase(step);
  if (p != Phase::wait && !prepared_) {
    kineto::prepareProfiler(kineto_config(), activities);  // warm-up: Kineto (CUPTI on GPUs) set up before recording
    prepared_ = true;
  }
  if (p == Phase::active && !recording_) {
    kineto::enableProfiler(kineto_config(), activities);
    recording_ = true;
  }
}

void Profiler::step_end(int64_t step) {
  const bool cycle_end = step % config_.profile_freq == 0;
  if (config_.enable_memory_snapshot && cycle_end) save_memory_snapshot(step);
  if (!recording_ || !cycle_end) return;
  auto result = kineto::disableProfiler();
  recording_ = prepared_ = false;
  const fs::path dir = fs::path(dump_folder_) / config_.save_traces_folder / ("iteration_" + std::to_string(step));
  fs::create_directories(dir);
  const std::string path = (dir / ("rank" + std::to_string(rank_) + "_trace.json")).string();
  result->save(path);
  if (!fs::exists(path)) fail("the profiler did not write its trace ", quote(path));
  log::info("Profiler trace of steps ", step - config_.profiler_active + 1, "-", step, " saved to ", path);
}

void Profiler::save_memory_snapshot(int64_t step) {
  const fs::path dir = fs::path(dump_folder_) / config_.save_memory_snapshot_folder / ("iteration_" + std::to_string(step));
  fs::create_directories(dir);
#ifdef TITAN_WITH_CUDA
  if (cuda_) {
    const std::string path = (dir / ("rank" + std::to_string(rank_) + "_memory_snapshot.pickle")).string();
    write_file(path, torch::cuda::_memory_snapshot_pickled());
    log::info("Memory snapshot saved to ", path, " (open it in https://pytorch.org/memory_viz)");
    return;
  }
#endif
  const std::string path = (dir / ("rank" + std::to_string(rank_) + "_memory.json")).string();
  nlohmann::ordered_json j = {{"step", step},
                              {"device", "cpu"},
                              {"what", "bytes LibTorch holds on the CPU (counted by titan's allocator wrapper) and the "
                                       "process's peak resident set; CPUs have no caching-allocator history"},
                              {"bytes_in_use", metrics::cpu_bytes_in_use()},
                              {"peak_bytes_in_use", metrics::cpu_peak_bytes()},
                              {"peak_rss_bytes", metrics::peak_rss_bytes()}};
  const auto cache = metrics::host_block_cache_stats();
  if (cache.maps > 0)
    j["host_block_cache"] = {{"what", "LibTorch's blocks of 1 MiB and more (titan's host block cache)"},
                             {"live_bytes", cache.live_bytes},
                             {"cached_bytes", cache.cached_bytes},
                             {"peak_live_bytes", cache.peak_live_bytes},
                             {"maps", cache.maps},
                             {"reuses", cache.reuses},
                             {"splits", cache.splits},
                             {"unmaps", cache.unmaps}};
  write_file(path, j.dump(2) + "\n");
  log::info("Memory figures saved to ", path);
}

}  // namespace titan
