// The model a job trains: its flavor, then the [model] shape keys that are set, then (when the job starts from
// Hugging Face weights) that directory's config.json, which supplies the shape under model.flavor "hf" (or no
// flavor set) and is checked field by field against any other flavor.
#pragma once
#include <string>

#include "titan/config/loader.h"
#include "titan/models/llama3/args.h"

namespace titan::llama3 {

// model.flavor "hf": the shape of the Hugging Face config.json the job loads (checkpoint.initial_load_in_hf).
inline constexpr const char* kHfFlavor = "hf";

struct JobModel {
  ModelArgs args;
  std::string name;  // for logs and checkpoint metadata: the flavor, "custom" or the config.json it came from
};

// Throws UserError naming the key (and where it was set) or the config.json field for shapes that do not fit
// together or disagree with the Hugging Face weights the job loads. max_seq_len is model.max_seq_len when set
// (at least training.seq_len), else training.seq_len, as torchtitan sets it; a shape taken from config.json keeps
// its max_position_embeddings when that is longer.
JobModel job_model(const config::LoadedConfig& loaded);

// The flavor with the [model] shape keys that are set applied (no Hugging Face config, max_seq_len as above).
ModelArgs apply_shape_keys(ModelArgs base, const config::LoadedConfig& loaded);

}  // namespace titan::llama3
