#include "titan/models/qwen3/hf_config.h"

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/models/common/json_fields.h"

namespace titan::qwen3 {

using json = nlohmann::json;

json to_hf_config(const DecoderArgs& args, const std::string& torch_dtype) {
  json c;
  c["architectures"] = {args.moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"};
  c["model_type"] = args.moe ? "qwen3_moe" : "qwen3";
  if (args.moe) {
    // What Qwen3MoeForCausalLM computes: softmax routing, scores on the experts' outputs, no shared experts.
    const auto& m = *args.moe;
    std::vector<std::string> beyond;
    if (m.score_func != "softmax") beyond.push_back(cat("score_func ", quote(m.score_func)));
    if (m.num_shared_experts) beyond.push_back(cat(m.num_shared_experts, " shared expert(s)"));
    if (m.score_before_experts) beyond.push_back("score_before_experts = true");
    if (m.route_scale != 1.0) beyond.push_back(cat("route_scale ", m.route_scale));
    if (m.num_expert_groups) beyond.push_back("node-limited routing (num_expert_groups)");
    if (!beyond.empty())
      fail("this Mixture-of-Experts model has ", join(beyond, ", "), ", which Hugging Face's Qwen3MoeForCausalLM cannot express");
    c["num_experts"] = m.num_experts;
    c["num_experts_per_tok"] = m.top_k;
    c["moe_intermediate_size"] = m.hidden_dim;
    c["norm_topk_prob"] = m.route_norm;
    c["decoder_sparse_step"] = 1;
    // Leading dense blocks (model.n_dense_layers): Qwen3MoeForCausalLM's dense layers, of intermediate_size.
    json dense = json::array();
    for (int64_t layer = 0; layer < args.n_dense_layers; ++layer) dense.push_back(layer);
    c["mlp_only_layers"] = dense;
    c["output_router_logits"] = false;
  }
  c["hidden_size"] = args.dim;
  c["intermediate_size"] = args.ffn_hidden_dim();
  c["num_hidden_layers"] = args.n_layers;
  c["num_attention_heads"] = args.n_heads;
  c["num_key_value_heads"] = args.kv_heads();
  c["head_dim"] = args.head_dim();
  c["vocab_size"] = args.vocab_size;
  c["rms_norm_eps"] = args.norm_eps;
  c["rope_theta"] = args.rope_theta;
  c["rope_scaling"] = nullptr;
  c["max_position_embeddings"] = args.max_seq_len;
  c["tie_word_embeddings"] = args.tie_word_embeddings;
  c["hidden_act"] = "silu";
  c["attention_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["use_sliding_window"] = false;
  c["max_window_layers"] = args.n_layers;
  c["torch_dtype"] = torch_dtype;
  return c;
}


DecoderArgs from_hf_config(const json& config, const std::string& path) {
  if (!config.is_object()) fail(path, ": expected a JSON object (a Hugging Face config.json)");
  models::JsonFields f{config, path, "a Qwen3 config.json"};
  const json* type = f.find("model_type");
  if (type && *type != "qwen3" && *type != "qwen3_moe")
    fail(path, ": model_type = ", type->dump(), "; titan's qwen3 family reads model_type \"qwen3\" (dense Qwen3) and "
         "\"qwen3_moe\" (Qwen3-MoE)");
  const bool moe = type && *type == "qwen3_moe";
  DecoderArgs a = base_args();
  a.dim = f.integer("hidden_size");
  a.n_layers = f.integer("num_hidden_layers");
  a.n_heads = f.integer("num_attention_heads");
  a.n_kv_heads = f.find("num_key_value_heads") ? f.integer("num_key_value_heads") : a.n_heads;
  // Qwen3Config's default head_dim is 128; Qwen3MoeConfig has none, and its attention takes hidden_size / heads.
  if (f.find("head_dim")) a.head_dim_value = f.integer("head_dim");
  else if (moe && a.n_heads > 0) a.head_dim_value = a.dim / a.n_heads;
  else a.head_dim_value = 128;
  a.vocab_size = f.integer("vocab_size");
  a.hidden_dim = moe && !f.find("intermediate_size") ? 6144 : f.integer("intermediate_size");  // dense layers' width
  // Qwen3Config's defaults where a field is absent: rms_norm_eps 1e-6, rope_theta 10000, untied, 32768 positions.
  a.norm_eps = f.number("rms_norm_eps", 1e-6);
  a.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  a.max_seq_len = f.find("max_position_embeddings") ? f.integer("max_position_embeddings") : 32768;
  if (const json* act = f.find("hidden_act"); act && *act != "silu")
    fail(path, ": hidden_act = ", act->dump(), "; Qwen3's feed-forward uses \"silu\" (SwiGLU)");
  if (f.boolean("attention_bias", false)) fail(path, ": attention_bias = true; titan's Qwen3 has no biases");
  if (f.boolean("use_sliding_window", false))
    fail(path, ": use_sliding_window = true; titan's Qwen3 computes full causal attention in every layer");
  if (const json* types = f.find("layer_types"); types && types->is_array())
    for (const auto& t : *types)
      if (t != "full_attention")
        fail(path, ": layer_types holds ", t.dump(), "; titan's Qwen3 computes full causal attention in every layer");
  a.rope_theta = f.number("rope_theta", 10000.0);
  // transformers 5 nests theta (and any scaling) in rope_parameters.
  for (const char* field : {"rope_parameters", "rope_scaling"}) {
    const json* rope = f.find(field);
    if (!rope) continue;
    if (!rope->is_object()) fail(path, ": ", field, " must be an object or null, got ", rope->dump());
    models::JsonFields r{*rope, cat(path, ": ", field), ""};
    if (r.find("rope_theta")) a.rope_theta = r.number("rope_theta", a.rope_theta);
    const json* type = r.find("rope_type");
    if (!type) type = r.find("type");
    if (type && *type != "default")
      fail(path, ": ", field, " type ", type->dump(), " is not supported; titan's Qwen3 uses unscaled RoPE");
  }
  if (!(a.rope_theta > 0)) fail(path, ": rope_theta must be positive, got ", a.rope_theta);
  if (moe) {
    // Qwen3MoeConfig's defaults where a field is absent (num_experts 128, 8 per token, width 768, no renormalisation).
    models::MoEArgs m;
    // Published configs say num_experts; transformers 5 writes its attribute's other name, num_local_experts.
    m.num_experts = f.find("num_experts") ? f.integer("num_experts") : f.find("num_local_experts") ? f.integer("num_local_experts") : 128;
    m.top_k = f.find("num_experts_per_tok") ? f.integer("num_experts_per_tok") : 8;
    m.hidden_dim = f.find("moe_intermediate_size") ? f.integer("moe_intermediate_size") : 768;
    m.route_norm = f.boolean("norm_topk_prob", false);
    m.num_shared_experts = 0;
    m.score_func = "softmax";
    m.score_before_experts = false;
    if (f.find("decoder_sparse_step") && f.integer("decoder_sparse_step") != 1)
      fail(path, ": decoder_sparse_step = ", f.integer("decoder_sparse_step"),
           "; titan's Qwen3-MoE has a Mixture of Experts in every layer (decoder_sparse_step 1), as torchtitan's");
    if (const json* dense = f.find("mlp_only_layers"); dense && !dense->is_null()) {
      // Dense layers first (titan's model.n_dense_layers): 0, 1, ..., k - 1.
      bool leading = dense->is_array();
      for (size_t i = 0; leading && i < dense->size(); ++i)
        leading = (*dense)[i].is_number_integer() && (*dense)[i].get<int64_t>() == static_cast<int64_t>(i);
      if (!leading)
        fail(path, ": mlp_only_layers = ", dense->dump(), "; titan's Qwen3-MoE takes dense layers only as the first ones "
             "([0, 1, ..., k - 1], model.n_dense_layers = k)");
      a.n_dense_layers = static_cast<int64_t>(dense->size());
    }
    if (f.find("num_experts") && m.num_experts == 0)
      fail(path, ": num_experts = 0 describes a dense model; write model_type \"qwen3\" for it");
    a.moe = m;
  }
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

}  // namespace titan::qwen3
