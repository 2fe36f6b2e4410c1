#include "titan/components/optimizer_state.h"

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/config/dtypes.h"

namespace titan {

using json = nlohmann::json;

namespace {
std::string moment_key(const char* moment, const std::string& parameter) { return cat("optimizer.", moment, ".", parameter); }
}  // namespace

OptimizerState::OptimizerState(Adam& optimizer, const std::vector<distributed::ShardedParameter>& parameters,
                               const config::Optimizer& config)
    : optimizer_(optimizer), parameters_(parameters), config_(config) {}

protocols::SavedState OptimizerState::state_dict(const protocols::SaveOptions&) const {
  protocols::SavedState saved;
  const auto& state = optimizer_.state();
  std::vector<size_t> with_state;
  std::vector<at::Tensor> steps;
  for (size_t i = 0; i < parameters_.size() && i < state.size(); ++i) {
    if (!parameters_[i].layout.owner() || !state[i].exp_avg.defined()) continue;
    with_state.push_back(i);
    const at::Tensor count = state[i].step.detach().reshape({}).to(at::kDouble);
    steps.push_back(steps.empty() ? count : count.to(steps.front().device()));
  }
  json counts = json::object();
  if (!steps.empty()) {
    // One read of every step count (on a GPU one transfer, not one per parameter).
    const at::Tensor host = at::stack(steps).cpu();
    for (size_t k = 0; k < with_state.size(); ++k) {
      const double count = host[static_cast<int64_t>(k)].item<double>();
      // A parameter no update has reached yet holds the zero moments a load would start from: none saved (as before
      // the trainer allocated them ahead of the first step; a seed checkpoint holds no optimizer state).
      if (count == 0) continue;
      const size_t i = with_state[k];
      const auto& p = parameters_[i];
      const auto offsets = p.layout.local_box().offsets;
      saved.tensors.push_back({moment_key("exp_avg", p.name), distributed::unpadded(state[i].exp_avg, p.layout), offsets,
                               p.layout.global_shape()});
      saved.tensors.push_back({moment_key("exp_avg_sq", p.name), distributed::unpadded(state[i].exp_avg_sq, p.layout),
                               offsets, p.layout.global_shape()});
      counts[p.name] = count;
    }
  }
  saved.gathered = {{"optimizer", {{"steps", counts}}}};
  // What an export to torchtitan's layout needs for its optimizer's param_groups (titan convert --format dcp).
  saved.global = {{"optimizer_settings",
                   {{"name", config_.name}, {"lr", optimizer_.lr()}, {"initial_lr", config_.lr}, {"beta1", config_.beta1},
                    {"beta2", config_.beta2}, {"eps", config_.eps}, {"weight_decay", config_.weight_decay},
                    {"implementation", config_.implementation}}}};
  return saved;
}

void OptimizerState::load_state_dict(protocols::StateSource& source) {
  const json& meta = source.metadata();
  if (!meta.contains("optimizer") || !meta["optimizer"].contains("steps"))
    fail(source.name(), " holds no optimizer state; load its weights only (checkpoint.initial_load_model_only = true) or "
         "add \"optimizer\" to checkpoint.exclude_from_loading");
  const json& steps = meta["optimizer"]["steps"];
  optimizer_.init_state();
  auto& state = optimizer_.mutable_state();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    if (!steps.contains(p.name)) continue;  // saved before the first optimizer step
    for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
      const std::string key = moment_key(moment, p.name);
      const auto entry = source.entry(key);
      if (!entry) fail(source.name(), " has no tensor ", quote(source.key_name(key)));
      at::Tensor& buffer = std::string(moment) == "exp_avg" ? state[i].exp_avg : state[i].exp_avg_sq;
      if (entry->shape != p.layout.global_shape() || (source.exact_dtypes() && entry->dtype != buffer.scalar_type()))
        fail(source.name(), ": tensor ", quote(source.key_name(key)), " is ", titan::config::dtype_name(entry->dtype), " [",
             join_ints(entry->shape), "]; the optimizer keeps ", titan::config::dtype_name(buffer.scalar_type()), " [",
             join_ints(p.layout.global_shape()), "]");
      source.read_box(key, p.layout.local_box().offsets, distributed::unpadded(buffer, p.layout));
    }
    state[i].step.fill_(steps[p.name].get<double>());
  }
}

}  // namespace titan
