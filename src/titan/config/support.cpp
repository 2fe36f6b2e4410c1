#include "titan/config/support.h"

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"

namespace titan::config {

SupportReport check_supported(const LoadedConfig& loaded) {
  const JobConfig& c = loaded.config;
  SupportReport r;
  auto not_yet = [&](const std::string& key, const std::string& value, const std::string& what) {
    r.errors.push_back(cat(key, " = ", value, " ", loaded.where(key), ": ", what, " is not supported yet"));
  };
  const auto& p = c.parallelism;
  // Expert parallelism and its tensor-parallel degree are checked against the mesh (distributed/parallel_dims.cpp)
  // and the model (models/common/decoder_parallelize.cpp).
  if (p.expert_parallel_degree > 1 && p.expert_parallel_comm_backend != "standard")
    not_yet("parallelism.expert_parallel_comm_backend", quote(p.expert_parallel_comm_backend),
            "an expert-parallel backend other than \"standard\" (all-to-all through the communicator)");
  if (c.fault_tolerance.enable) not_yet("fault_tolerance.enable", "true", "fault-tolerant training");
  if (c.training.enable_cpu_offload) not_yet("training.enable_cpu_offload", "true", "CPU offload");
  if (c.optimizer.early_step_in_backward) {
    const std::string where = loaded.where("optimizer.early_step_in_backward");
    // As torchtitan, no pipeline: a stage's gradients are final only after the schedule's last backward.
    if (p.pipeline_parallel_degree > 1)
      r.errors.push_back(cat("optimizer.early_step_in_backward = true ", where, " with parallelism.pipeline_parallel_degree = ",
                             p.pipeline_parallel_degree, ": a pipeline stage's gradients are final only after its last "
                             "micro-batch's backward, so there is nothing to step early; set one of them off"));
    if (c.training.skip_nonfinite_steps > 0)
      r.errors.push_back(cat("optimizer.early_step_in_backward = true ", where, " with training.skip_nonfinite_steps = ",
                             c.training.skip_nonfinite_steps, " ", loaded.where("training.skip_nonfinite_steps"),
                             ": a step is applied during backward, before its loss and gradient norm are known to be "
                             "finite, so it cannot be skipped; set training.skip_nonfinite_steps = 0 (a non-finite step then "
                             "stops the run, the last checkpoint untouched)"));
    r.warnings.push_back(cat("optimizer.early_step_in_backward = true ", where, ": gradients are not clipped (training.max_norm = ",
                             c.training.max_norm, " does not apply): each parameter is updated as soon as its gradient is "
                             "final, before the norm of all of them is known (torchtitan does not clip either); the logged "
                             "grad_norm is that of the unclipped gradients"));
  }
  // One background thread packs about 2.6 million tokens/s (bench/bench_data.py), far above what a GPU trains per rank,
  // so worker processes would add nothing; torchtitan's would each read the same rows (it splits data by rank only).
  if (c.training.dataloader.num_workers > 0)
    r.warnings.push_back(cat("training.dataloader.num_workers = ", c.training.dataloader.num_workers, " ",
                             loaded.where("training.dataloader.num_workers"),
                             ": titan.cpp prepares batches on one background thread per rank (training.prefetch_batches "
                             "ahead), which outpaces training; no worker processes are started"));
  if (c.comm.mode == "fake_backend") {
    // torchtitan's dry run: one process plays one rank of the job (distributed/communicator.h, make_fake_world).
    r.warnings.push_back(cat("comm.mode = \"fake_backend\" ", loaded.where("comm.mode"),
                             ": a dry run of one rank; its collectives communicate with no one and return what they would if every "
                             "rank were a copy of this one, so the shapes, memory and code paths are this rank's in the full job but "
                             "the loss and gradient norm are not the job's"
                             + std::string(p.pipeline_parallel_degree > 1
                                               ? " (what a pipeline stage receives from its neighbours is stand-in values of "
                                                 "the right shape)"
                                               : "")
                             + std::string(c.checkpoint.enable || c.checkpoint.initial_load_path
                                               ? "; checkpoints are neither loaded nor saved (a starting checkpoint or Hugging Face "
                                                 "folder still gives the model's shape and tokenizer)"
                                               : "")));
  } else if (c.comm.mode != "default") {
    not_yet("comm.mode", quote(c.comm.mode),
            "a simulated communication mode other than \"fake_backend\" (one process simulating every rank in turn)");
  }
  if (c.activation_checkpoint.mode == "memory_budget")
    r.errors.push_back(cat("activation_checkpoint.mode = \"memory_budget\" ", loaded.where("activation_checkpoint.mode"),
                           ": needs a graph compiler (torch.compile), which titan.cpp does not have; use full or selective"));
  if (c.compile.enable)
    r.warnings.push_back(cat("compile.enable = true ", loaded.where("compile.enable"),
                             ": titan.cpp runs eager LibTorch kernels and has no torch.compile; continuing uncompiled"));
  return r;
}

void require_supported(const LoadedConfig& loaded) {
  auto report = check_supported(loaded);
  for (const auto& w : report.warnings) log::warn(w);
  if (report.errors.empty()) return;
  std::string message = "this configuration asks for features titan.cpp cannot run yet:";
  for (const auto& e : report.errors) message += "\n  - " + e;
  fail(message);
}

}  // namespace titan::config
