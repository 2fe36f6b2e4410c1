// `titan estimate`: model size, training FLOPs per token and the memory that weights, gradients and AdamW state
// need, computed from shapes alone (nothing is allocated), for any flavor and job config.
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/cli/commands.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/config/dtypes.h"
#include "titan/config/loader.h"
#include "titan/models/registry.h"
#include "titan/trainer/job_model.h"

namespace titan::cli {

int run_estimate(const std::vector<std::string>& raw_args) {
  bool as_json = false;
  std::vector<std::string> args;
  for (const auto& a : raw_args) {
    if (a == "--json") as_json = true;
    else args.push_back(a);
  }
  auto loaded = config::load_job_config(args);
  if (loaded.help_requested) {
    std::cout << "usage: titan estimate [--json] [--job.config_file FILE] [--model.flavor F] [--training.seq_len N] ...\n"
                 "Parameters, FLOPs per token and training-state memory of a job's model, from shapes alone.\n";
    return 0;
  }
  const auto& c = loaded.config;
  const JobChoice choice = choose_job_model(loaded);
  const protocols::ModelSpec& spec = *choice.spec;
  const protocols::JobModel& job = choice.model;
  const protocols::ModelArgs& args_model = *job.args;
  // As torchtitan reports them (for tied Qwen3 flavors its count leaves the embedding out).
  const int64_t params = args_model.reported_parameters();
  const int64_t embedding = args_model.embedding_parameters();
  const double flops = args_model.flops_per_token(c.training.seq_len);
  // Parameters and gradients in training.dtype; AdamW keeps two moments of the same dtype per parameter.
  const double bytes_per_value = titan::config::dtype_bytes(c.training.dtype);
  const double state_bytes = static_cast<double>(args_model.stored_parameters()) * bytes_per_value * 4.0;
  if (as_json) {
    nlohmann::ordered_json j = {{"name", spec.name},
                                {"flavor", c.model.flavor},
                                {"model", job.name},
                                {"parameters", params},
                                {"embedding_parameters", embedding},
                                {"active_parameters", args_model.active_parameters()},
                                {"seq_len", c.training.seq_len},
                                {"flops_per_token", flops},
                                {"training_state_bytes", state_bytes}};
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "model " << spec.name << " " << job.name << ": " << with_thousands(params) << " parameters ("
            << with_thousands(embedding) << " in the embedding"
            << (args_model.active_parameters() != params ? cat("; ", with_thousands(args_model.active_parameters()), " active per token")
                                                         : std::string())
            << ")\n"
            << "training FLOPs per token at seq_len " << c.training.seq_len << ": " << strprintf("%.4g", flops) << "\n"
            << "weights + gradients + AdamW state in " << c.training.dtype << ": "
            << strprintf("%.2f", state_bytes / (1024.0 * 1024.0 * 1024.0)) << " GiB (unsharded)\n";
  return 0;
}

}  // namespace titan::cli
