// torchtitan's learning-rate schedule: linear warm-up ((step+1)/warmup), an optional stable phase (decay_ratio,
// "warmup-stable-decay"), then linear, sqrt or cosine decay down to lr x min_lr_factor. Step s of training (1-based)
// uses factor(s - 1), as LambdaLR does after its construction-time step.
#pragma once
#include <cstdint>
#include <string>

#include "titan/config/job_config.h"
#include "titan/protocols/stateful.h"

namespace titan {

// Checkpointed as the metadata field lr_scheduler.completed (the scheduler steps taken).
class LRScheduler : public protocols::Stateful {
 public:
  LRScheduler(const config::LRScheduler& config, double base_lr, int64_t training_steps);

  // Multiplier of the base learning rate after `completed` scheduler steps.
  double factor(int64_t completed) const;
  double current_lr() const { return base_lr_ * factor(completed_); }
  void step() { ++completed_; }
  int64_t completed() const { return completed_; }
  void set_completed(int64_t completed) { completed_ = completed; }

  protocols::SavedState state_dict(const protocols::SaveOptions& options) const override;
  void load_state_dict(protocols::StateSource& source) override;

  int64_t warmup_steps() const { return warmup_; }
  int64_t stable_steps() const { return stable_; }
  int64_t decay_steps() const { return decay_; }

 private:
  double base_lr_;
  int64_t warmup_, stable_, decay_;
  std::string decay_type_;
  double min_lr_factor_;
  int64_t completed_ = 0;
};

}  // namespace titan
