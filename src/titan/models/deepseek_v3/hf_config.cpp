#include "titan/models/deepseek_v3/hf_config.h"

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/models/common/json_fields.h"

namespace titan::deepseek_v3 {

using json = nlohmann::json;

json to_hf_config(const DecoderArgs& args, const std::string& torch_dtype) {
  if (!args.mla || !args.moe) fail("a DeepSeek-V3 config.json describes latent attention and Mixture-of-Experts blocks");
  const auto& m = *args.moe;
  const auto& l = *args.mla;
  std::vector<std::string> beyond;
  if (m.score_func != "sigmoid") beyond.push_back(cat("score_func ", quote(m.score_func), " (Hugging Face's model routes by sigmoid scores only)"));
  if (m.score_before_experts) beyond.push_back("score_before_experts = true");
  if (m.gate_bias) beyond.push_back("a router bias");
  if (!beyond.empty())
    fail("this DeepSeek-V3 model has ", join(beyond, ", "), ", which Hugging Face's DeepseekV3ForCausalLM cannot express");
  json c;
  c["architectures"] = {"DeepseekV3ForCausalLM"};
  c["model_type"] = "deepseek_v3";
  c["vocab_size"] = args.vocab_size;
  c["hidden_size"] = args.dim;
  c["intermediate_size"] = args.ffn_hidden_dim();
  c["moe_intermediate_size"] = m.hidden_dim;
  c["num_hidden_layers"] = args.n_layers;
  c["num_attention_heads"] = args.n_heads;
  c["num_key_value_heads"] = args.n_heads;
  c["n_shared_experts"] = m.num_shared_experts;
  c["n_routed_experts"] = m.num_experts;
  c["routed_scaling_factor"] = m.route_scale;
  c["kv_lora_rank"] = l.kv_lora_rank;
  c["q_lora_rank"] = l.q_lora_rank > 0 ? json(l.q_lora_rank) : json(nullptr);
  c["qk_rope_head_dim"] = l.qk_rope_head_dim;
  c["v_head_dim"] = l.v_head_dim;
  c["qk_nope_head_dim"] = l.qk_nope_head_dim;
  c["n_group"] = m.num_expert_groups.value_or(1);
  c["topk_group"] = m.num_limited_groups.value_or(1);
  c["num_experts_per_tok"] = m.top_k;
  c["first_k_dense_replace"] = args.n_dense_layers;
  c["norm_topk_prob"] = m.route_norm;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = args.max_seq_len;
  c["rms_norm_eps"] = args.norm_eps;
  c["tie_word_embeddings"] = args.tie_word_embeddings;
  c["rope_theta"] = args.rope_theta;
  c["rope_interleave"] = true;
  if (args.yarn_active()) {
    const auto& y = *args.yarn;
    // torchtitan's single mscale scales the softmax (transformers' mscale_all_dim); equal values leave transformers'
    // cos/sin unscaled, as torchtitan's.
    c["rope_scaling"] = {{"type", "yarn"},          {"rope_type", "yarn"},          {"factor", y.factor},
                         {"original_max_position_embeddings", y.original_seq_len}, {"beta_fast", y.beta_fast},
                         {"beta_slow", y.beta_slow}, {"mscale", y.mscale},          {"mscale_all_dim", y.mscale}};
  } else {
    c["rope_scaling"] = nullptr;
  }
  c["attention_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["torch_dtype"] = torch_dtype;
  return c;
}

DecoderArgs from_hf_config(const json& config, const std::string& path) {
  if (!config.is_object()) fail(path, ": expected a JSON object (a Hugging Face config.json)");
  models::JsonFields f{config, path, "a DeepSeek-V3 config.json"};
  const json* type = f.find("model_type");
  if (type && *type != "deepseek_v3")
    fail(path, ": model_type = ", type->dump(), "; titan's deepseek_v3 family reads model_type \"deepseek_v3\"");
  // DeepseekV3Config's defaults where a field is absent (DeepSeek-V3 671B).
  auto integer = [&](const char* key, int64_t fallback) { return f.find(key) ? f.integer(key) : fallback; };
  DecoderArgs a = base_args();
  a.final_norm_dtype_eps = false;  // transformers' final norm takes rms_norm_eps
  a.vocab_size = integer("vocab_size", 129280);
  a.dim = integer("hidden_size", 7168);
  a.hidden_dim = integer("intermediate_size", 18432);
  a.n_layers = integer("num_hidden_layers", 61);
  a.n_heads = integer("num_attention_heads", 128);
  if (f.find("num_key_value_heads") && f.integer("num_key_value_heads") != a.n_heads)
    fail(path, ": num_key_value_heads = ", f.integer("num_key_value_heads"), " differs from num_attention_heads = ", a.n_heads,
         "; latent attention expands keys and values for every head");
  a.n_dense_layers = integer("first_k_dense_replace", 3);
  a.norm_eps = f.number("rms_norm_eps", 1e-6);
  a.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  a.max_seq_len = integer("max_position_embeddings", 4096);
  if (const json* act = f.find("hidden_act"); act && *act != "silu")
    fail(path, ": hidden_act = ", act->dump(), "; DeepSeek-V3's feed-forwards use \"silu\" (SwiGLU)");
  if (f.boolean("attention_bias", false)) fail(path, ": attention_bias = true; titan's DeepSeek-V3 has no biases");
  if (!f.boolean("rope_interleave", true))
    fail(path, ": rope_interleave = false; titan's DeepSeek-V3 rotates interleaved pairs, as the published checkpoints do");
  if (const json* method = f.find("topk_method"); method && *method != "noaux_tc")
    fail(path, ": topk_method = ", method->dump(), "; titan's DeepSeek-V3 routes as \"noaux_tc\" (sigmoid scores, balancing bias, groups)");
  if (const json* scoring = f.find("scoring_func"); scoring && *scoring != "sigmoid")
    fail(path, ": scoring_func = ", scoring->dump(), "; DeepSeek-V3 routes by \"sigmoid\" scores");

  models::LatentAttentionArgs l;
  const json* q_lora = f.find("q_lora_rank");  // null: queries through one projection
  l.q_lora_rank = config.contains("q_lora_rank") ? (q_lora ? f.integer("q_lora_rank") : 0) : 1536;
  l.kv_lora_rank = integer("kv_lora_rank", 512);
  l.qk_nope_head_dim = integer("qk_nope_head_dim", 128);
  l.qk_rope_head_dim = integer("qk_rope_head_dim", 64);
  l.v_head_dim = integer("v_head_dim", 128);
  l.norm_eps = 1e-6;  // transformers' q_a_layernorm and kv_a_layernorm
  a.mla = l;

  models::MoEArgs m;
  m.num_experts = integer("n_routed_experts", 256);
  m.num_shared_experts = integer("n_shared_experts", 1);
  m.top_k = integer("num_experts_per_tok", 8);
  m.hidden_dim = integer("moe_intermediate_size", 2048);
  m.route_scale = f.number("routed_scaling_factor", 2.5);
  m.route_norm = f.boolean("norm_topk_prob", true);
  m.score_func = "sigmoid";
  m.score_before_experts = false;
  const int64_t groups = integer("n_group", 8), limited = integer("topk_group", 4);
  if (groups > 1) {
    m.num_expert_groups = groups;
    m.num_limited_groups = limited;
  } else if (limited != 1) {
    fail(path, ": topk_group = ", limited, " with n_group = ", groups, "; one group keeps all experts (topk_group 1)");
  }
  a.moe = m;

  a.rope_theta = f.number("rope_theta", 10000.0);
  a.yarn.reset();
  // transformers 5 nests theta (and the scaling) in rope_parameters; older files say rope_scaling.
  for (const char* field : {"rope_parameters", "rope_scaling"}) {
    const json* rope = f.find(field);
    if (!rope) continue;
    if (!rope->is_object()) fail(path, ": ", field, " must be an object or null, got ", rope->dump());
    models::JsonFields r{*rope, cat(path, ": ", field), ""};
    if (r.find("rope_theta")) a.rope_theta = r.number("rope_theta", a.rope_theta);
    const json* kind = r.find("rope_type");
    if (!kind) kind = r.find("type");
    if (!kind || *kind == "default") continue;
    if (*kind != "yarn")
      fail(path, ": ", field, " type ", kind->dump(), " is not supported; titan's DeepSeek-V3 takes \"yarn\" or none");
    models::YarnScaling y;
    y.factor = r.number("factor", 1.0);
    y.original_seq_len = r.find("original_max_position_embeddings") ? r.integer("original_max_position_embeddings") : 4096;
    y.beta_fast = r.number("beta_fast", 32);
    y.beta_slow = r.number("beta_slow", 1);
    const double mscale = r.number("mscale", 1.0), mscale_all_dim = r.number("mscale_all_dim", 0.0);
    // transformers scales the softmax by mscale_all_dim's factor squared and cos/sin by the ratio of mscale's to
    // mscale_all_dim's: torchtitan (and titan) compute the first with equal values only.
    if (mscale != mscale_all_dim)
      fail(path, ": ", field, " mscale = ", mscale, " and mscale_all_dim = ", mscale_all_dim,
           " differ; titan's YaRN (torchtitan's) scales the softmax only, which needs them equal");
    y.mscale = mscale_all_dim;
    if (a.max_seq_len <= y.original_seq_len)
      fail(path, ": YaRN over original_max_position_embeddings = ", y.original_seq_len, " with max_position_embeddings = ",
           a.max_seq_len, "; titan applies YaRN to models longer than their original context only");
    a.yarn = y;
  }
  if (!(a.rope_theta > 0)) fail(path, ": rope_theta must be positive, got ", a.rope_theta);
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

}  // namespace titan::deepseek_v3
