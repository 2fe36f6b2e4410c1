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

// The arguments Meta's params.json (beside consolidated.NN.pth) describes: dim, n_layers, n_heads, n_kv_heads,
// vocab_size, multiple_of, ffn_dim_multiplier, norm_eps, rope_theta, use_scaled_rope (Llama 3.1 scaling, factor
// rope_scaling_factor or 8). The file does not say whether the output shares the embedding's table: `tied` does
// (the caller knows from the weights). UserError naming the file and field for a missing size, a value of the
// wrong type, or a setting titan's Llama 3 cannot compute (a vision model's fields, quantization, LoRA).
DecoderArgs from_meta_params(const nlohmann::json& params, const std::string& path, bool tied);

}  // namespace titan::llama3
