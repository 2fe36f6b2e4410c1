// Hugging Face LlamaConfig (config.json) for Llama 3 model arguments, both ways.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "titan/models/llama3/args.h"

namespace titan::llama3 {

// LlamaConfig fields for `args`; `torch_dtype` is "float32", "bfloat16" or "float16".
nlohmann::json to_hf_config(const DecoderArgs& args, const std::string& torch_dtype);

// The arguments a config.json describes. Throws UserError naming `path` and the field for a missing size, a
// value of the wrong type, or a setting titan's Llama 3 cannot compute (another activation, biases, a head_dim
// that is not hidden_size / num_attention_heads, a RoPE scaling type other than llama3).
DecoderArgs from_hf_config(const nlohmann::json& config, const std::string& path);
DecoderArgs read_hf_config(const std::string& config_json_path);

}  // namespace titan::llama3
