// Hugging Face DeepseekV3Config (config.json, model_type "deepseek_v3") for DeepSeek-V3 model arguments, both ways.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "titan/models/deepseek_v3/args.h"

namespace titan::deepseek_v3 {

// DeepseekV3Config fields for `args`; `torch_dtype` is "float32", "bfloat16" or "float16". UserError for what
// DeepseekV3ForCausalLM cannot compute: softmax routing (torchtitan's debugmodel, 16B and 236B flavors), scores
// applied before the experts.
nlohmann::json to_hf_config(const DecoderArgs& args, const std::string& torch_dtype);

// The arguments a config.json describes. Throws UserError naming `path` and the field for a missing size, a value of
// the wrong type, or a setting titan cannot compute (biases, another activation, non-interleaved RoPE, RoPE scaling
// other than YaRN, YaRN whose mscale and mscale_all_dim differ).
DecoderArgs from_hf_config(const nlohmann::json& config, const std::string& path);
DecoderArgs read_hf_config(const std::string& config_json_path);

}  // namespace titan::deepseek_v3
