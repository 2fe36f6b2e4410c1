// Validation (torchtitan's validator): the configured validation data, in file order without shuffling, through
// the step schedule's forward without gradients, averaged as torchtitan does over the data-parallel ranks.
#pragma once
#include <functional>
#include <vector>

#include "titan/components/data/dataloader.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/trainer/metrics_processor.h"
#include "titan/trainer/step_schedule.h"

namespace titan {

class Validator {
 public:
  // The sources are resolved before training starts, so that a bad validation path fails at once.
  Validator(const config::JobConfig& config, const tokenizer::Tokenizer& tokenizer, const distributed::DeviceMesh& mesh,
            const at::Device& device);
  // validation.steps batches (or one pass when -1) from a fresh loader. Collective over the data-parallel ranks.
  // `stop` (when given; collective over every rank) is asked before each batch for a stop signal that reached any
  // rank: a non-zero answer ends the validation there (result.interrupted), so that a preempted job saves in time.
  ValidationResult run(StepSchedule& schedule, const std::function<int()>& stop = {}) const;

 private:
  const config::JobConfig& config_;
  const tokenizer::Tokenizer& tokenizer_;
  const distributed::DeviceMesh& mesh_;
  at::Device device_;
  std::vector<data::SourceSpec> sources_;
};

}  // namespace titan
