// The optimizer's part of a checkpoint (torchtitan's OptimizersContainer state dict): each parameter's Adam moments
// under "optimizer.exp_avg.<name>" / "optimizer.exp_avg_sq.<name>", laid out as the parameter is (the rank that
// writes a parameter's piece writes its moments' pieces), the step counts in the metadata's optimizer.steps, and
// the settings an export to torchtitan's layout needs in optimizer_settings.
#pragma once
#include <vector>

#include "titan/components/optimizer.h"
#include "titan/config/job_config.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/protocols/stateful.h"

namespace titan {

class OptimizerState : public protocols::Stateful {
 public:
  // The optimizer's state i belongs to parameters[i].
  OptimizerState(Adam& optimizer, const std::vector<distributed::ShardedParameter>& parameters, const config::Optimizer& config);
  protocols::SavedState state_dict(const protocols::SaveOptions& options) const override;
  void load_state_dict(protocols::StateSource& source) override;

 private:
  Adam& optimizer_;
  const std::vector<distributed::ShardedParameter>& parameters_;
  const config::Optimizer& config_;
};

}  // namespace titan
