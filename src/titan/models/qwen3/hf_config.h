// Hugging Face Qwen3Config (config.json, model_type "qwen3") for Qwen3 model arguments, both ways.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "titan/models/qwen3/args.h"

namespace titan::qwen3 {

// Qwen3Config fields for `args`; `torch_dtype` is "float32", "bfloat16" or "float16".
nlohmann::json to_hf_config(const DecoderArgs& args, const std::string& torch_dtype);

// The arguments a config.json describes. Throws UserError naming `path` and the field for a missing size, a value of
// the wrong type, or a setting titan's Qwen3 cannot compute (biases, sliding-window attention, RoPE scaling,
// another activation).
DecoderArgs from_hf_config(const nlohmann::json& config, const std::string& path);
DecoderArgs read_hf_config(const std::string& config_json_path);

}  // namespace titan::qwen3
