// The model spec of a dense decoder family (Llama 3, Qwen3): the shared model, plan, stage split, memory estimate
// and Hugging Face adapter, with the family's flavors and config.json mapping.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "titan/models/common/decoder_job.h"
#include "titan/protocols/model_spec.h"

namespace titan::models {

struct DecoderFamilySpec {
  std::string name;
  std::vector<std::string> hf_model_types;
  std::function<std::vector<std::string>()> flavor_names;
  DecoderFamily family;  // flavors and config.json reader
  std::function<nlohmann::json(const DecoderArgs& args, const std::string& torch_dtype)> to_hf_config;
  bool counts_tied_output = true;  // DecoderArgs::counts_tied_output of the family's models
};

protocols::ModelSpec decoder_spec(const DecoderFamilySpec& family);

}  // namespace titan::models
