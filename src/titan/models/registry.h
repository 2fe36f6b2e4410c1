// The registered model families, by model.name (torchtitan's train-spec registry), and the family a job trains.
#pragma once
#include <string>
#include <vector>

#include "titan/config/loader.h"
#include "titan/protocols/model_spec.h"

namespace titan::models {

std::vector<std::string> model_names();
// The family of weights that do not record one (torch DCP directories, .pth files, titan checkpoints written before
// families were recorded): the first registered, Llama 3, as model.name's default.
const protocols::ModelSpec& default_model_spec();
// Throws UserError naming the registered families (and the closest) for an unknown name.
const protocols::ModelSpec& model_spec(const std::string& name);
// The family whose Hugging Face config.json has this model_type, or null.
const protocols::ModelSpec* spec_for_hf_model_type(const std::string& model_type);
// The family of a Hugging Face directory's config.json (UserError naming the file when none is registered for it).
const protocols::ModelSpec& spec_for_hf_directory(const std::string& directory);

// The family a job trains: model.name; when the job starts from Hugging Face weights, their config.json's model_type
// picks it if model.name is not set, and must name the same family if it is.
const protocols::ModelSpec& job_spec(const config::LoadedConfig& loaded);
// model.attn_mask_type from the flavor (`args`) where the job does not set it; whether it changed the job's.
bool take_flavor_mask(config::LoadedConfig& loaded, const protocols::ModelArgs& args);

}  // namespace titan::models
