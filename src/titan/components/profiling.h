// torchtitan's [profiling] section: LibTorch's profiler (Kineto) on a step schedule -- in every profile_freq steps,
// profiler_warmup steps warming up and then profiler_active steps recorded -- writing a Chrome trace per rank to
// {dump_folder}/{save_traces_folder}/iteration_{step}/rank{R}_trace.json (loadable in Perfetto or
// chrome://tracing); and enable_memory_snapshot: the CUDA caching allocator's history as PyTorch's memory
// visualiser reads it (rank{R}_memory_snapshot.pickle), or on a CPU the counted allocator figures instead.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "titan/config/job_config.h"

namespace titan {

class Profiler {
 public:
  // Throws UserError naming the keys when warmup + active steps do not fit in profile_freq.
  Profiler(const config::Profiling& config, const std::string& dump_folder, int rank, bool cuda);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void step_begin(int64_t step);  // `step` counts from 1, as the log line does
  void step_end(int64_t step);

 private:
  enum class Phase { wait, warmup, active };
  Phase phase(int64_t step) const;
  void save_memory_snapshot(int64_t step);

  config::Profiling config_;
  std::string dump_folder_;
  int rank_;
  bool cuda_;
  bool prepared_ = false, recording_ = false;
};

}  // namespace titan
