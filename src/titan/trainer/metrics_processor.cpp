#include "titan/trainer/metrics_processor.h"

#include <algorithm>
#include <cmath>

#include "titan/common/clock.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"

namespace titan {

MetricsProcessor::MetricsProcessor(const config::JobConfig& config, int rank, const at::Device& device, int64_t replica_size)
    : replica_size_(replica_size),
      memory_(device),
      logger_(std::make_unique<metrics::MetricLogger>(config, rank)) {}

void MetricsProcessor::set_flops(double flops_per_token, metrics::PeakFlops peak) {
  flops_per_token_ = flops_per_token;
  peak_ = std::move(peak);
}

void MetricsProcessor::restart_clock() { interval_start_ = now_seconds(); }

void MetricsProcessor::count_step(int64_t tokens, double data_seconds) {
  ++steps_;
  tokens_ += tokens;
  data_seconds_ += data_seconds;
}

void MetricsProcessor::log_step(int64_t step, const StepResult& r, int64_t tokens_seen) {
  const double elapsed = std::max(1e-9, now_seconds() - interval_start_);
  // Per device as torchtitan: the ranks of one TP/CP/PP group share their tokens.
  const double tps = static_cast<double>(tokens_) / elapsed / static_cast<double>(replica_size_);
  const double tflops = flops_per_token_ * tps / 1e12;
  if (peak_.measured && flops_per_token_ * tps > peak_.flops) {
    // A measured CPU peak a step beat is wrong (measured in a slow moment, or cached on another machine state):
    // measured again once per run; after that the fastest step's rate is the peak (the model's FLOPs formula counts
    // the whole attention square where causal kernels compute half, so a step can outrun any matmul).
    if (!peak_remeasured_) {
      peak_ = metrics::remeasured_peak_flops(peak_, flops_per_token_ * tps);
      peak_remeasured_ = true;
      log::warn("MFU peak: ", peak_.derivation);
    } else {
      peak_.flops = flops_per_token_ * tps;
    }
  }
  const double mfu = peak_.flops > 0 ? 100.0 * flops_per_token_ * tps / peak_.flops : 0.0;
  auto mem = memory_.peak();
  highest_peak_gib_ = std::max(highest_peak_gib_, mem.peak_gib);
  const auto& k = log::colors();
  // data: time blocked waiting for batches, per step over the logging interval, and its share of the time
  // (torchtitan's time_metrics/data_loading(s) and data_loading(%)).
  const double steps = static_cast<double>(std::max<int64_t>(1, steps_));
  const double data_per_step = data_seconds_ / steps;
  log::info(strprintf("%sstep: %2lld  %sloss: %8.5f  %sgrad_norm: %7.4f  %smemory: %5.2fGiB(%.2f%%)  %stps: %s  %stflops: %s  %smfu: %.2f%%  %sdata: %.3fs(%.1f%%)%s%s",
                      k.red, static_cast<long long>(step), k.green, r.loss, k.orange, r.grad_norm, k.turquoise, mem.peak_gib,
                      mem.peak_pct, k.blue, with_thousands(static_cast<long long>(std::nearbyint(tps))).c_str(), k.cyan,
                      with_thousands(tflops, 2).c_str(), k.magenta, mfu, k.yellow, data_per_step, 100.0 * data_seconds_ / elapsed,
                      r.summary.empty() ? "" : ("  " + r.summary).c_str(), k.reset));
  // torchtitan's TensorBoard keys (its global_max_loss, the largest data-parallel rank's loss, is not computed here),
  // then the model's own (MoE routing health).
  std::vector<std::pair<std::string, double>> scalars = {{"loss_metrics/global_avg_loss", r.loss},
                      {"grad_norm", r.grad_norm},
                      {"throughput(tps)", tps},
                      {"tflops", tflops},
                      {"mfu(%)", mfu},
                      {"time_metrics/end_to_end(s)", elapsed / steps},
                      {"time_metrics/data_loading(s)", data_per_step},
                      {"time_metrics/data_loading(%)", 100.0 * data_seconds_ / elapsed},
                      {"memory/max_active(GiB)", mem.peak_gib},
                      {"memory/max_active(%)", mem.peak_pct},
                      {"n_tokens_seen", static_cast<double>(tokens_seen)},
                      {"lr", r.lr}};
  scalars.insert(scalars.end(), r.scalars.begin(), r.scalars.end());
  logger_->log(step, scalars);
  steps_ = 0;
  tokens_ = 0;
  data_seconds_ = 0;
  restart_clock();
  memory_.reset_peak();
}

void MetricsProcessor::log_validation(int64_t step, const ValidationResult& v) {
  const double elapsed = std::max(1e-9, v.seconds);
  const double tps = static_cast<double>(v.tokens) / elapsed / static_cast<double>(replica_size_);
  auto mem = memory_.peak();
  const auto& k = log::colors();
  log::info(strprintf("%svalidate step: %2lld  %sloss: %7.4f  %smemory: %5.2fGiB(%.2f%%)  %stps: %s  (%lld batches)%s", k.yellow,
                      static_cast<long long>(step), k.green, v.loss, k.turquoise, mem.peak_gib, mem.peak_pct, k.blue,
                      with_thousands(static_cast<long long>(std::nearbyint(tps))).c_str(), static_cast<long long>(v.batches), k.reset));
  logger_->log(step, {{"validation_metrics/loss", v.loss},
                      {"validation_metrics/throughput(tps)", tps},
                      {"validation_metrics/memory/max_active(GiB)", mem.peak_gib},
                      {"validation_metrics/memory/max_active(%)", mem.peak_pct}});
}

}  // namespace titan
