#include "titan/models/llama3/hf_config.h"

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/models/common/json_fields.h"

namespace titan::llama3 {

using json = nlohmann::json;

namespace {

// Llama 3.1 RoPE scaling's four parameters under LlamaConfig's names, or null when scaling is off.
json rope_scaling_json(const models::RopeScaling& r) {
  if (!r.enabled) return nullptr;
  return {{"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position_embeddings", r.original_max_position_embeddings}};
}

}  // namespace

json to_hf_config(const DecoderArgs& args, const std::string& torch_dtype) {
  json c;
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  c["hidden_size"] = args.dim;
  c["intermediate_size"] = args.ffn_hidden_dim();
  c["num_hidden_layers"] = args.n_layers;
  c["num_attention_heads"] = args.n_heads;
  c["num_key_value_heads"] = args.kv_heads();
  c["head_dim"] = args.head_dim();
  c["vocab_size"] = args.vocab_size;
  c["rms_norm_eps"] = args.norm_eps;
  c["rope_theta"] = args.rope_theta;
  c["max_position_embeddings"] = args.max_seq_len;
  c["tie_word_embeddings"] = args.tie_word_embeddings;
  c["hidden_act"] = "silu";
  c["attention_bias"] = false;
  c["mlp_bias"] = false;
  c["torch_dtype"] = torch_dtype;
  c["rope_scaling"] = rope_scaling_json(args.rope_scaling);
  if (args.rope_scaling.enabled) c["rope_scaling"]["rope_type"] = "llama3";
  return c;
}


DecoderArgs from_hf_config(const json& config, const std::string& path) {
  if (!config.is_object()) fail(path, ": expected a JSON object (a Hugging Face config.json)");
  models::JsonFields f{config, path, "a Llama config.json"};
  if (const json* type = f.find("model_type"); type && *type != "llama")
    fail(path, ": model_type = ", type->dump(), "; titan trains Llama models (model_type \"llama\")");
  DecoderArgs a;
  a.dim = f.integer("hidden_size");
  a.n_layers = f.integer("num_hidden_layers");
  a.n_heads = f.integer("num_attention_heads");
  a.n_kv_heads = f.find("num_key_value_heads") ? f.integer("num_key_value_heads") : a.n_heads;
  a.vocab_size = f.integer("vocab_size");
  a.hidden_dim = f.integer("intermediate_size");
  a.multiple_of = 1;
  // LlamaConfig's own defaults where a field is absent: rms_norm_eps 1e-6, rope_theta 10000, untied, no scaling.
  a.norm_eps = f.number("rms_norm_eps", 1e-6);
  a.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  a.max_seq_len = f.find("max_position_embeddings") ? f.integer("max_position_embeddings") : 2048;
  if (const json* act = f.find("hidden_act"); act && *act != "silu")
    fail(path, ": hidden_act = ", act->dump(), "; Llama 3's feed-forward uses \"silu\" (SwiGLU)");
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (f.boolean(bias, false)) fail(path, ": ", bias, " = true; Llama 3 has no biases");
  if (a.n_heads > 0 && a.dim % a.n_heads == 0 && f.find("head_dim") && f.integer("head_dim") != a.dim / a.n_heads)
    fail(path, ": head_dim = ", f.integer("head_dim"), ", but titan's attention uses hidden_size / num_attention_heads = ",
         a.dim / a.n_heads);

  // transformers 5 nests theta and scaling in rope_parameters; earlier versions use rope_theta + rope_scaling.
  const json* rope = f.find("rope_parameters");
  if (rope && !rope->is_object()) fail(path, ": rope_parameters must be an object, got ", rope->dump());
  if (!rope) rope = f.find("rope_scaling");
  if (rope && !rope->is_object()) fail(path, ": rope_scaling must be an object or null, got ", rope->dump());
  a.rope_theta = f.number("rope_theta", 10000.0);
  a.rope_scaling.enabled = false;
  if (rope) {
    const std::string field = f.find("rope_parameters") ? "rope_parameters" : "rope_scaling";
    models::JsonFields r{*rope, cat(path, ": ", field), ""};
    if (r.find("rope_theta")) a.rope_theta = r.number("rope_theta", a.rope_theta);
    const json* type = r.find("rope_type");
    if (!type) type = r.find("type");
    const std::string kind = type && type->is_string() ? type->get<std::string>() : "default";
    if (kind == "llama3") {
      a.rope_scaling.enabled = true;
      for (const char* key : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        if (!r.find(key)) fail(path, ": ", field, " of type llama3 has no ", key);
      a.rope_scaling.factor = r.number("factor", 0);
      a.rope_scaling.low_freq_factor = r.number("low_freq_factor", 0);
      a.rope_scaling.high_freq_factor = r.number("high_freq_factor", 0);
      a.rope_scaling.original_max_position_embeddings = r.integer("original_max_position_embeddings");
    } else if (kind != "default") {
      fail(path, ": ", field, " type ", quote(kind), " is not supported; titan's RoPE has Llama 3.1 scaling (\"llama3\") or none");
    }
  }
  if (!(a.rope_theta > 0)) fail(path, ": rope_theta must be positive, got ", a.rope_theta);
  try {
    a.check();
  } catch (const UserError& e) {
    fail(path, ": ", e.what());
  }
  return a;
}

DecoderArgs from_meta_params(const json& params, const std::string& path, bool tied) {
  if (!params.is_object()) fail(path, ": expected a JSON object (Meta's params.json)");
  models::JsonFields f{params, path, "Meta's params.json"};
  for (const char* key : {"vision_chunk_size", "vision_max_num_chunks", "vision_num_cross_attention_layers",
                          "vision_model", "quantization_args", "lora_args", "moe_args"})
    if (f.find(key)) fail(path, ": ", key, " is set; titan imports Meta's text-only, unquantized Llama 3 checkpoints");
  DecoderArgs a;
  a.dim = f.integer("dim");
  a.n_layers = f.integer("n_layers");
  a.n_heads = f.integer("n_heads");
  if (f.find("n_kv_heads")) a.n_kv_heads = f.integer("n_kv_heads");
  a.vocab_size = f.integer("vocab_size");
  if (a.vocab_size <= 0) fail(path, ": vocab_size = ", a.vocab_size, "; Meta's checkpoints record the real size");
  // Meta's ModelArgs defaults where a field is absent.
  a.multiple_of = f.find("multiple_of") ? f.integer("multiple_of") : 256;
  if (f.find("ffn_dim_multiplier")) a.ffn_dim_multiplier = f.number("ffn_dim_multiplier", 1.0);
  a.norm_eps = f.number("norm_eps", 1e-5);
  a.rope_theta = f.number("rope_theta", 500000.0);
  a.rope_scaling = models::RopeScaling{};
  a.rope_scaling.enabled = f.boolean("use_scaled_rope", false);
  a.rope_scaling.factor = f.number("rope_scaling_factor", 8.0);
  a.rope_scaling.high_freq_factor = f.number("rope_high_freq_factor", a.rope_scaling.high_freq_factor);
  a.tie_word_embeddings = tied;
  if (!(a.rope_theta > 0)) fail(path, ": rope_theta must be positive, got ", a.rope_theta);
  if (a.rope_scaling.enabled && !(a.rope_scaling.factor > 0))
    fail(path, ": rope_scaling_factor must be positive, got ", a.rope_scaling.factor);
  try {
    a.check();
  } catch (const UserError& e) {
    fail(path, ": ", e.what());
  }
  return a;
}

DecoderArgs read_hf_config(const std::string& config_json_path) {
  return from_hf_config(models::read_json_file(config_json_path, "a Hugging Face config.json"), config_json_path);
}

}  // namespace titan::llama3
