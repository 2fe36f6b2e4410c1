// The step and validation log lines, TensorBoard and JSONL scalars (torchtitan's keys and formula: tokens/s per
// device, TFLOP/s, MFU against the device's peak, memory, data-loading time), over each logging interval.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "titan/components/metrics/memory.h"
#include "titan/components/metrics/metric_logger.h"
#include "titan/components/metrics/peak_flops.h"
#include "titan/config/job_config.h"

namespace titan {

struct StepResult {
  double loss = 0;       // global average loss over valid tokens
  double grad_norm = 0;  // total L2 norm before clipping
  double lr = 0;         // learning rate used by this step
  int64_t tokens = 0;    // tokens processed (all label positions)
  bool skipped = false;  // the loss or gradient norm was not finite: no update was applied
  // The model's own figures for the step (MoE routing health): TensorBoard scalars, and words for the log line.
  std::vector<std::pair<std::string, double>> scalars;
  std::string summary;
};

struct ValidationResult {
  double loss = 0;  // torchtitan's: the mean over batches of each batch's loss sum over its global valid tokens; a full pass: over all its tokens
  int64_t tokens = 0, batches = 0;
  double seconds = 0;
  int interrupted = 0;  // the stop signal that ended it early, or 0
};

class MetricsProcessor {
 public:
  // `replica_size`: the ranks of one data-parallel replica (TP x CP x PP), which share their tokens per device.
  MetricsProcessor(const config::JobConfig& config, int rank, const at::Device& device, int64_t replica_size);

  metrics::MemoryMonitor& memory() { return memory_; }
  // The model's training FLOPs per token and the device's peak, for TFLOP/s and MFU.
  void set_flops(double flops_per_token, metrics::PeakFlops peak);
  const metrics::PeakFlops& peak() const { return peak_; }

  // A new interval starts now (the loop's start; after a checkpoint save or validation, whose time is not training's).
  void restart_clock();
  // One training step of the interval: its tokens on this rank and the time it waited for batches.
  void count_step(int64_t tokens, double data_seconds);
  void log_step(int64_t step, const StepResult& result, int64_t tokens_seen);
  void log_validation(int64_t step, const ValidationResult& result);
  // The highest of the step lines' memory peaks so far (GiB).
  double highest_peak_gib() const { return highest_peak_gib_; }
  // Everything of the step is logged (training, validation).
  void end_step() { logger_->end_step(); }
  // The run's exit code, for the metric files that record one (W&B's exit record).
  void finish(int exit_code) { logger_->finish(exit_code); }

 private:
  int64_t replica_size_;
  metrics::MemoryMonitor memory_;
  double highest_peak_gib_ = 0;
  std::unique_ptr<metrics::MetricLogger> logger_;
  metrics::PeakFlops peak_;
  bool peak_remeasured_ = false;  // at most once per run
  double flops_per_token_ = 0;
  int64_t steps_ = 0, tokens_ = 0;
  double data_seconds_ = 0, interval_start_ = 0;
};

}  // namespace titan
