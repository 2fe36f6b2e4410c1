#include "titan/components/metrics/metric_logger.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/config/loader.h"

namespace titan::metrics {

namespace fs = std::filesystem;

MetricLogger::MetricLogger(const config::JobConfig& job, int rank) : rank_(rank) {
  const config::Metrics& config = job.metrics;
  const std::string& dump_folder = job.job.dump_folder;
  if (!config.save_for_all_ranks && rank != 0) return;
  // TensorBoard's and W&B's folder, as torchtitan's: {dump_folder}/{save_tb_folder}/{YYYYmmdd-HHMM}[/rank_R].
  const std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M", std::localtime(&now));
  fs::path dir = fs::path(dump_folder) / config.save_tb_folder / stamp;
  if (config.save_for_all_ranks) dir /= "rank_" + std::to_string(rank);
  if (config.enable_tensorboard) {
    tensorboard_ = std::make_unique<EventFileWriter>(dir.string());
    log::info("TensorBoard logging enabled. Logs will be saved at ", dir.string());
  }
  if (config.enable_wandb && wandb_disabled_by_environment()) {
    log::info("Weights & Biases logging is off: WANDB_MODE=disabled (metrics.enable_wandb)");
  } else if (config.enable_wandb) {
    WandbRunOptions options = wandb_options_from_environment();
    if (config.save_for_all_ranks && !options.id.empty()) options.id += "-rank" + std::to_string(rank);
    if (config.save_for_all_ranks && !options.name.empty()) options.name += " rank " + std::to_string(rank);
    const std::string project = options.project;
    wandb_ = std::make_unique<WandbOfflineRun>(dir.string(), std::move(options), config::to_json(job));
    const char* mode = std::getenv("WANDB_MODE");
    log::info("Weights & Biases: offline run ", wandb_->id(), " (project ", quote(project), ") in ", wandb_->run_directory(),
              "; upload it with `wandb sync ", wandb_->run_directory(), "`",
              mode && std::string(mode) != "offline" ? cat(" (titan.cpp writes offline runs; WANDB_MODE=", mode, " is not used)") : "");
  }
  if (config.enable_jsonl) {
    jsonl_path_ = (fs::path(dump_folder) / (config.save_for_all_ranks ? "metrics_rank_" + std::to_string(rank) + ".jsonl"
                                                                     : std::string("metrics.jsonl"))).string();
    fs::create_directories(fs::path(jsonl_path_).parent_path());
    jsonl_ = std::fopen(jsonl_path_.c_str(), "a");  // a resumed run goes on appending
    if (!jsonl_) fail("cannot open the metrics file ", quote(jsonl_path_), ": ", std::strerror(errno), " (metrics.enable_jsonl)");
    log::info("Metrics are appended to ", jsonl_path_, " (one JSON record per logged step)");
  }
}

void MetricLogger::end_step() {
  if (wandb_) wandb_->end_step();
}

void MetricLogger::finish(int exit_code) {
  if (wandb_) wandb_->finish(exit_code);
}

MetricLogger::~MetricLogger() {
  if (jsonl_) std::fclose(jsonl_);
}

void MetricLogger::log(int64_t step, const Scalars& scalars) {
  if (tensorboard_) tensorboard_->add_scalars(step, scalars);
  if (wandb_) wandb_->log(step, scalars);
  if (jsonl_) {
    nlohmann::ordered_json record = {
        {"step", step},
        {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()},
        {"rank", rank_}};
    for (const auto& [key, value] : scalars) record[key] = std::isfinite(value) ? nlohmann::ordered_json(value) : nullptr;
    const std::string line = record.dump() + "\n";
    if (std::fwrite(line.data(), 1, line.size(), jsonl_) != line.size() || std::fflush(jsonl_) != 0)
      fail("cannot write the metrics file ", quote(jsonl_path_), ": ", std::strerror(errno), errno == ENOSPC ? " (disk full)" : "");
  }
}

}  // namespace titan::metrics
