#include "titan/components/metrics/metric_logger.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"

namespace titan::metrics {

namespace fs = std::filesystem;

MetricLogger::MetricLogger(const config::Metrics& config, const std::string& dump_folder, int rank) : rank_(rank) {
  if (!config.save_for_all_ranks && rank != 0) return;
  if (config.enable_tensorboard) {
    const std::time_t now = std::time(nullptr);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M", std::localtime(&now));
    fs::path dir = fs::path(dump_folder) / config.save_tb_folder / stamp;
    if (config.save_for_all_ranks) dir /= "rank_" + std::to_string(rank);
    tensorboard_ = std::make_unique<EventFileWriter>(dir.string());
    log::info("TensorBoard logging enabled. Logs will be saved at ", dir.string());
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

MetricLogger::~MetricLogger() {
  if (jsonl_) std::fclose(jsonl_);
}

void MetricLogger::log(int64_t step, const Scalars& scalars) {
  if (tensorboard_) tensorboard_->add_scalars(step, scalars);
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
