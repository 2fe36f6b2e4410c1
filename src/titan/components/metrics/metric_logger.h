// Where the step metrics go besides the log line: TensorBoard event files (metrics.enable_tensorboard, under
// {dump_folder}/{save_tb_folder}/{YYYYmmdd-HHMM}), a Weights & Biases offline run in that folder's wandb/ (metrics.
// enable_wandb; `wandb sync` uploads it) and a JSONL file (metrics.enable_jsonl, {dump_folder}/metrics.jsonl), from
// rank 0, or from every rank into its own rank_R folder / metrics_rank_R.jsonl with metrics.save_for_all_ranks. Keys
// are torchtitan's ("loss_metrics/global_avg_loss", "throughput(tps)", ...).
#pragma once
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "titan/components/metrics/tensorboard.h"
#include "titan/components/metrics/wandb.h"
#include "titan/config/job_config.h"

namespace titan::metrics {

using Scalars = std::vector<std::pair<std::string, double>>;

class MetricLogger {
 public:
  MetricLogger(const config::JobConfig& config, int rank);
  ~MetricLogger();
  MetricLogger(const MetricLogger&) = delete;
  MetricLogger& operator=(const MetricLogger&) = delete;

  void log(int64_t step, const Scalars& scalars);
  // Everything of this step is logged (training and validation): W&B's row for it is written.
  void end_step();
  // The run's end with the process's exit code (the W&B run's exit record); without it, W&B's run records 1 if an
  // exception is unwinding and 0 if not.
  void finish(int exit_code);

 private:
  int rank_;
  std::unique_ptr<EventFileWriter> tensorboard_;
  std::unique_ptr<WandbOfflineRun> wandb_;
  std::FILE* jsonl_ = nullptr;
  std::string jsonl_path_;
};

}  // namespace titan::metrics
