// The model a job trains: its flavor, then the [model] shape keys that are set, then (when the job starts from
// Hugging Face weights) that directory's config.json, which supplies the shape under model.flavor "hf" (or no
// flavor set) and is checked field by field against any other flavor.
#pragma once
#include <functional>
#include <string>

#include "titan/config/loader.h"
#include "titan/models/common/decoder_args.h"
#include "titan/protocols/model_spec.h"

namespace titan::models {

// model.flavor "hf": the shape of the Hugging Face config.json the job loads (checkpoint.initial_load_in_hf).
inline constexpr const char* kHfFlavor = "hf";

// What a decoder family gives the job's model: its flavors and its Hugging Face config.json reader.
struct DecoderFamily {
  std::function<DecoderArgs(const std::string& flavor)> flavor;
  std::function<DecoderArgs(const std::string& config_json_path)> read_hf_config;
};

struct DecoderJobModel {
  DecoderArgs args;
  std::string name;  // for logs and checkpoint metadata: the flavor, "custom" or the config.json it came from
};

// Throws UserError naming the key (and where it was set) or the config.json field for shapes that do not fit
// together or disagree with the Hugging Face weights the job loads. max_seq_len is model.max_seq_len when set
// (at least training.seq_len), else training.seq_len, as torchtitan sets it; a shape taken from config.json keeps
// its max_position_embeddings when that is longer.
// `recorded`: what the checkpoint that decides the model records (protocols::ModelSpec::recorded_job_model).
DecoderJobModel job_model(const config::LoadedConfig& loaded, const DecoderFamily& family,
                          const protocols::RecordedModel* recorded = nullptr);

// The flavor with the [model] shape keys that are set applied (no Hugging Face config, max_seq_len as above).
DecoderArgs apply_shape_keys(DecoderArgs base, const config::LoadedConfig& loaded);

}  // namespace titan::models
