#include "titan/models/common/decoder_spec.h"

#include "titan/models/common/decoder.h"
#include "titan/models/common/decoder_hf.h"
#include "titan/models/common/decoder_memory.h"
#include "titan/models/common/decoder_parallelize.h"

namespace titan::models {
namespace {

class DecoderAdapter : public protocols::StateDictAdapter {
 public:
  DecoderAdapter(DecoderArgs args, DecoderFamily family,
                 std::function<nlohmann::json(const DecoderArgs&, const std::string&)> to_hf_config)
      : args_(std::move(args)), family_(std::move(family)), to_hf_config_(std::move(to_hf_config)) {}
  std::optional<std::string> to_hf_name(const std::string& name) const override { return models::to_hf_name(name, args_); }
  std::optional<std::string> from_hf_name(const std::string& name) const override { return models::from_hf_name(name, args_); }
  at::Tensor to_hf_tensor(const std::string& name, const at::Tensor& t) const override { return models::to_hf_tensor(name, t, args_); }
  at::Tensor from_hf_tensor(const std::string& name, const at::Tensor& t) const override {
    return models::from_hf_tensor(name, t, args_);
  }
  int64_t permuted_rows_per_head(const std::string& name) const override { return models::permuted_rows_per_head(name, args_); }
  int64_t hf_slices(const std::string& name) const override { return models::hf_slices(name, args_); }
  std::string hf_slice_name(const std::string& name, int64_t index) const override { return models::hf_slice_name(name, index); }
  std::optional<std::pair<std::string, int64_t>> from_hf_slice_name(const std::string& name) const override {
    return models::from_hf_slice_name(name);
  }
  std::optional<std::string> skipped_hf_tensor(const std::string& name) const override { return models::skipped_hf_tensor(name, args_); }
  at::Tensor from_hf_head_rows(const at::Tensor& rows, int64_t rows_per_head) const override {
    return models::from_hf_head_rows(rows, rows_per_head);
  }
  nlohmann::json hf_config(const std::string& torch_dtype) const override { return to_hf_config_(args_, torch_dtype); }
  std::vector<std::string> hf_config_differences(const std::string& path) const override {
    return family_.read_hf_config(path).computation_differences(args_);
  }

 private:
  DecoderArgs args_;
  DecoderFamily family_;
  std::function<nlohmann::json(const DecoderArgs&, const std::string&)> to_hf_config_;
};

}  // namespace

protocols::ModelSpec decoder_spec(const DecoderFamilySpec& f) {
  protocols::ModelSpec s;
  s.name = f.name;
  s.hf_model_types = f.hf_model_types;
  s.flavor_names = f.flavor_names;
  const DecoderFamily family = f.family;
  s.flavor = [family](const std::string& name) -> std::shared_ptr<const protocols::ModelArgs> {
    return std::make_shared<DecoderArgs>(family.flavor(name));
  };
  s.job_model = [family](const config::LoadedConfig& loaded) {
    DecoderJobModel job = job_model(loaded, family);
    return protocols::JobModel{std::make_shared<DecoderArgs>(job.args), job.name};
  };
  s.recorded_job_model = [family, counts = f.counts_tied_output](const config::LoadedConfig& loaded,
                                                                 const protocols::RecordedModel& recorded) {
    DecoderJobModel job = job_model(loaded, family, &recorded);
    job.args.counts_tied_output = counts;
    return protocols::JobModel{std::make_shared<DecoderArgs>(job.args), job.name};
  };
  s.args_from_json = [name = f.name, counts = f.counts_tied_output](const nlohmann::json& j, const std::string& where)
      -> std::shared_ptr<const protocols::ModelArgs> {
    auto args = std::make_shared<DecoderArgs>(decoder_args_from_json(j, where, name));
    args->counts_tied_output = counts;
    return args;
  };
  s.read_hf_config = [family](const std::string& path) -> std::shared_ptr<const protocols::ModelArgs> {
    return std::make_shared<DecoderArgs>(family.read_hf_config(path));
  };
  s.build = [](const protocols::ModelArgs& args, const nn::ParameterOptions& options) -> std::shared_ptr<nn::Model> {
    return std::make_shared<Decoder>(as_decoder(args, "building the model"), options);
  };
  s.check_parallelism = [](const protocols::ModelArgs& args, const distributed::ParallelDims& dims, const config::JobConfig& config) {
    check_parallelism(as_decoder(args, "the parallelism checks"), dims, config);
  };
  s.parallelize = [](nn::Model& model, const distributed::DeviceMesh& mesh, const config::JobConfig& config,
                     const distributed::FsdpOptions& fsdp, const distributed::ModuleRange& part, bool split_backward,
                     const std::shared_ptr<distributed::ContextParallel>& cp) {
    auto* decoder = dynamic_cast<Decoder*>(&model);
    TORCH_CHECK(decoder, "internal: the decoder plan was given another model");
    return parallelize(*decoder, mesh, config, fsdp, part, split_backward, cp);
  };
  s.tied_embeddings = [](const protocols::ModelArgs& args) { return as_decoder(args, "pipeline stages").tie_word_embeddings; };
  s.estimate_memory = [](const protocols::ModelArgs& args, const config::JobConfig& config, const distributed::ParallelDims& dims,
                         bool autocast, double runtime_bytes, protocols::Execution execution, int64_t pipeline_rank,
                         protocols::FusedKernels kernels, protocols::Allocator allocator) {
    return estimate_training_memory(as_decoder(args, "the memory estimate"), config, dims, autocast, runtime_bytes, execution,
                                    pipeline_rank, kernels, allocator);
  };
  auto to_hf_config = f.to_hf_config;
  s.state_dict_adapter = [family, to_hf_config](const protocols::ModelArgs& args) -> std::unique_ptr<protocols::StateDictAdapter> {
    return std::make_unique<DecoderAdapter>(as_decoder(args, "Hugging Face conversion"), family, to_hf_config);
  };
  return s;
}

}  // namespace titan::models
