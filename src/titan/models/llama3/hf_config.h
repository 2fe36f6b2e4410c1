// Hugging Face LlamaConfig (config.json) for Llama 3 model arguments, both ways, and the comparison of two sets of
// arguments on every field that changes what the model computes.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "titan/models/llama3/args.h"

namespace titan::llama3 {

// LlamaConfig fields for `args`; `torch_dtype` is "float32", "bfloat16" or "float16".
nlohmann::json to_hf_config(const ModelArgs& args, const std::string& torch_dtype);

// The arguments a config.json describes. Throws UserError naming `path` and the field for a missing size, a
// value of the wrong type, or a setting titan's Llama 3 cannot compute (another activation, biases, a head_dim
// that is not hidden_size / num_attention_heads, a RoPE scaling type other than llama3).
ModelArgs from_hf_config(const nlohmann::json& config, const std::string& path);
ModelArgs read_hf_config(const std::string& config_json_path);

// One line per field where `a` and `b` would compute differently ("rope_theta: 10000 vs 500000"); the
// sequence-length cap (max_seq_len) is not one of them. Empty when they compute the same model.
std::vector<std::string> computation_differences(const ModelArgs& a, const ModelArgs& b);

// The arguments as JSON (in checkpoint metadata) and back; `where` names the source in errors.
nlohmann::json args_to_json(const ModelArgs& args);
ModelArgs args_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace titan::llama3
