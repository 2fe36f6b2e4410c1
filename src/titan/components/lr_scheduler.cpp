#include "titan/components/lr_scheduler.h"

#include <cmath>

#include "titan/common/logging.h"

namespace titan {

LRScheduler::LRScheduler(const config::LRScheduler& c, double base_lr, int64_t training_steps)
    : base_lr_(base_lr), decay_type_(c.decay_type), min_lr_factor_(c.min_lr_factor) {
  const int64_t total = c.total_steps.value_or(training_steps);
  warmup_ = c.warmup_steps;
  if (warmup_ > total) {
    log::warn("lr_scheduler.warmup_steps (", warmup_, ") exceeds the total steps (", total, "); using ", total);
    warmup_ = total;
  }
  if (c.decay_ratio) {
    decay_ = static_cast<int64_t>(std::nearbyint(static_cast<double>(total) * *c.decay_ratio));
    if (warmup_ + decay_ > total) {
      log::warn("lr_scheduler warm-up (", warmup_, ") + decay (", decay_, ") steps exceed the total steps (", total,
                "); decaying over ", total - warmup_, " steps");
      decay_ = total - warmup_;
    }
  } else {
    decay_ = total - warmup_;
  }
  stable_ = total + 1 - warmup_ - decay_;
}

double LRScheduler::factor(int64_t step) const {
  if (step < warmup_) return static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (step < warmup_ + stable_ || decay_ <= 0) return 1.0;
  const double progress = static_cast<double>(step + 1 - (warmup_ + stable_)) / static_cast<double>(decay_);
  double f;
  if (decay_type_ == "linear") f = 1.0 - progress;
  else if (decay_type_ == "sqrt") f = 1.0 - std::sqrt(progress);
  else f = 0.5 * (1.0 + std::cos(M_PI * progress));
  return min_lr_factor_ + (1.0 - min_lr_factor_) * f;
}

protocols::SavedState LRScheduler::state_dict(const protocols::SaveOptions&) const {
  protocols::SavedState saved;
  saved.global = {{"lr_scheduler", {{"completed", completed_}}}};
  return saved;
}

void LRScheduler::load_state_dict(protocols::StateSource& source) {
  const auto& meta = source.metadata();
  // A checkpoint without a schedule (torchtitan's saved without one) leaves it where training starts.
  if (meta.contains("lr_scheduler") && meta["lr_scheduler"].contains("completed"))
    completed_ = meta["lr_scheduler"]["completed"].get<int64_t>();
}

}  // namespace titan
