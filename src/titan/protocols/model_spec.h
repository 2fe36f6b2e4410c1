// What a model family registers (torchtitan's TrainSpec): its arguments and flavors, how the job's configuration
// picks its shape, how to build it without storage, how it is parallelized and split into pipeline stages, its
// memory estimate, and its Hugging Face state-dict adapter and config.json. The trainer, the checkpointer, `titan
// plan`/`estimate`/`convert` and the CLI reach a family only through its spec (models/registry.h).
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "titan/config/loader.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/model_part.h"
#include "titan/nn/model.h"
#include "titan/nn/storage.h"
#include "titan/protocols/memory_estimate.h"
#include "titan/protocols/model_args.h"
#include "titan/protocols/state_dict_adapter.h"

namespace titan::protocols {

// The model a job trains: its arguments and a name for logs and checkpoint metadata (the flavor, "<flavor> with
// <keys> set", or the config.json it came from).
struct JobModel {
  std::shared_ptr<const ModelArgs> args;
  std::string name;
};

// What a titan checkpoint records of its model (metadata.json's "model" and "flavor").
struct RecordedModel {
  nlohmann::json model;
  std::string flavor;
  std::string where;  // the metadata file, for errors
};

struct ModelSpec {
  std::string name;                          // model.name
  std::vector<std::string> hf_model_types;   // config.json model_type values this family reads ("llama", "qwen3")
  std::function<std::vector<std::string>()> flavor_names;
  // Throws UserError naming the known flavors for an unknown one.
  std::function<std::shared_ptr<const ModelArgs>(const std::string& flavor)> flavor;
  // The job's model: model.flavor ("hf": config.json's shape), the [model] shape keys, checked against the HF
  // weights the job starts from.
  std::function<JobModel(const config::LoadedConfig& loaded)> job_model;
  // The same where a checkpoint's record decides the model: a job that started from Hugging Face weights and resumes
  // takes config.json's part from its checkpoint instead (the folder it started from may have changed or gone
  // since; with a named flavor it is not compared with that folder again), and a job that starts from a titan
  // checkpoint with no flavor named trains the model that checkpoint holds.
  std::function<JobModel(const config::LoadedConfig& loaded, const RecordedModel& resumed)> recorded_job_model;
  // Arguments from checkpoint metadata (ModelArgs::to_json); `where` names the source in errors.
  std::function<std::shared_ptr<const ModelArgs>(const nlohmann::json& j, const std::string& where)> args_from_json;
  // The arguments a Hugging Face config.json describes (UserError naming the file and field otherwise).
  std::function<std::shared_ptr<const ModelArgs>(const std::string& config_json_path)> read_hf_config;
  // The arguments Meta's params.json describes (beside consolidated.NN.pth), for families Meta publishes in that
  // form (Llama 3; null otherwise). `tied`: whether the weights share the embedding's table with the output.
  std::function<std::shared_ptr<const ModelArgs>(const std::string& params_json_path, bool tied)> read_meta_params;
  // The model, its parameters created with `options` (without storage when options.allocate is false).
  std::function<std::shared_ptr<nn::Model>(const ModelArgs& args, const nn::ParameterOptions& options)> build;
  // Every check of the layout against the model, before anything is built or communicated.
  std::function<void(const ModelArgs& args, const distributed::ParallelDims& dims, const config::JobConfig& config)>
      check_parallelism;
  // The family's plan for one part of the model (torchtitan's parallelize_fn); `cp` is the job's one
  // ContextParallel under context parallelism (null otherwise).
  std::function<distributed::ModelPart(nn::Model& model, const distributed::DeviceMesh& mesh, const config::JobConfig& config,
                                       const distributed::FsdpOptions& fsdp, const distributed::ModuleRange& part,
                                       bool split_backward, const std::shared_ptr<distributed::ContextParallel>& cp)>
      parallelize;
  // Whether the output reads the embedding's table (the two then share a pipeline stage and an FSDP unit).
  std::function<bool(const ModelArgs& args)> tied_embeddings;
  // Bytes one rank needs to train (docs/metrics.md): see models/common/decoder_memory.h for the arguments.
  std::function<MemoryEstimate(const ModelArgs& args, const config::JobConfig& config, const distributed::ParallelDims& dims,
                               bool autocast, double runtime_bytes, Execution execution, int64_t pipeline_rank,
                               FusedKernels kernels, Allocator allocator)>
      estimate_memory;
  std::function<std::unique_ptr<StateDictAdapter>(const ModelArgs& args)> state_dict_adapter;
};

}  // namespace titan::protocols
