#include "titan/models/common/decoder_job.h"

#include <algorithm>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"

namespace titan::models {

namespace {

bool is_set(const config::LoadedConfig& loaded, const std::string& key) { return loaded.origins.count(key) > 0; }

// The shape keys that are set, as "key=value" for the log line.
std::vector<std::string> set_shape_keys(const config::LoadedConfig& loaded) {
  std::vector<std::string> out;
  for (const auto& [key, origin] : loaded.origins) {
    if (!starts_with(key, "model.")) continue;
    const std::string name = key.substr(6);
    if (name == "name" || name == "flavor" || name == "hf_assets_path" || name == "tokenizer_path" ||
        name == "attn_mask_type" || name == "converters" || name == "print_after_conversion")
      continue;
    out.push_back(name);
  }
  return out;
}

}  // namespace

DecoderArgs apply_shape_keys(DecoderArgs a, const config::LoadedConfig& loaded) {
  const config::Model& m = loaded.config.model;
  if (m.dim) a.dim = *m.dim;
  if (m.n_layers) a.n_layers = *m.n_layers;
  if (m.n_heads) a.n_heads = *m.n_heads;  // without n_kv_heads, a flavor without GQA keeps one per head
  if (m.n_kv_heads) a.n_kv_heads = *m.n_kv_heads;
  if (m.head_dim) a.head_dim_value = *m.head_dim;  // else a flavor's explicit head_dim (Qwen3) stays, dim / n_heads otherwise
  if (m.vocab_size) a.vocab_size = *m.vocab_size;
  if (m.multiple_of || m.ffn_dim_multiplier) a.hidden_dim.reset();  // the width is derived again
  if (m.multiple_of) a.multiple_of = *m.multiple_of;
  if (m.ffn_dim_multiplier) a.ffn_dim_multiplier = *m.ffn_dim_multiplier;
  if (m.hidden_dim) a.hidden_dim = *m.hidden_dim;
  if (m.norm_eps) a.norm_eps = *m.norm_eps;
  if (m.rope_theta) a.rope_theta = *m.rope_theta;
  if (m.rope_scaling != "flavor") a.rope_scaling.enabled = m.rope_scaling == "llama3";
  if (m.rope_scaling_factor) a.rope_scaling.factor = *m.rope_scaling_factor;
  if (m.rope_low_freq_factor) a.rope_scaling.low_freq_factor = *m.rope_low_freq_factor;
  if (m.rope_high_freq_factor) a.rope_scaling.high_freq_factor = *m.rope_high_freq_factor;
  if (m.rope_original_max_position_embeddings)
    a.rope_scaling.original_max_position_embeddings = *m.rope_original_max_position_embeddings;
  if (!a.rope_scaling.enabled)
    for (const char* key : {"model.rope_scaling_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
                            "model.rope_original_max_position_embeddings"})
      if (is_set(loaded, key))
        fail(key, " ", loaded.where(key), " has no effect: RoPE scaling is off (model.rope_scaling = \"none\"",
             is_set(loaded, "model.rope_scaling") ? "" : " for this flavor", "); set model.rope_scaling = \"llama3\"");
  if (is_set(loaded, "model.tie_word_embeddings")) a.tie_word_embeddings = m.tie_word_embeddings;
  for (const auto& [key, value] : {std::pair{"model.moe_num_experts", m.moe_num_experts}, std::pair{"model.moe_top_k", m.moe_top_k},
                                   std::pair{"model.moe_inter_dim", m.moe_inter_dim}}) {
    if (!value) continue;
    if (!a.moe)
      fail(key, " = ", *value, " ", loaded.where(key), " applies to Mixture-of-Experts flavors; model.flavor ", quote(m.flavor),
           " is dense");
  }
  if (a.moe) {
    if (m.moe_num_experts) a.moe->num_experts = *m.moe_num_experts;
    if (m.moe_top_k) a.moe->top_k = *m.moe_top_k;
    if (m.moe_inter_dim) a.moe->hidden_dim = *m.moe_inter_dim;
    if (m.moe_load_balance_coeff)
      a.moe->load_balance_coeff = *m.moe_load_balance_coeff > 0 ? std::optional<double>(*m.moe_load_balance_coeff) : std::nullopt;
    a.moe->force_load_balance = loaded.config.debug.moe_force_load_balance;
  } else if (loaded.config.debug.moe_force_load_balance) {
    fail("debug.moe_force_load_balance ", loaded.where("debug.moe_force_load_balance"), " applies to Mixture-of-Experts flavors; model.flavor ",
         quote(m.flavor), " is dense");
  }
  if (m.moe_load_balance_coeff && !a.moe)
    fail("model.moe_load_balance_coeff ", loaded.where("model.moe_load_balance_coeff"),
         " applies to Mixture-of-Experts flavors; model.flavor ", quote(m.flavor), " is dense");
  if (m.n_dense_layers) {
    if (!a.moe)
      fail("model.n_dense_layers = ", *m.n_dense_layers, " ", loaded.where("model.n_dense_layers"),
           " applies to Mixture-of-Experts flavors; model.flavor ", quote(m.flavor), " is dense");
    a.n_dense_layers = *m.n_dense_layers;
  }
  for (const auto& [key, value] : {std::pair{"model.q_lora_rank", m.q_lora_rank}, std::pair{"model.kv_lora_rank", m.kv_lora_rank},
                                   std::pair{"model.qk_nope_head_dim", m.qk_nope_head_dim},
                                   std::pair{"model.qk_rope_head_dim", m.qk_rope_head_dim}, std::pair{"model.v_head_dim", m.v_head_dim}})
    if (value && !a.mla)
      fail(key, " = ", *value, " ", loaded.where(key), " applies to latent attention (model.name = \"deepseek_v3\"); model.flavor ",
           quote(m.flavor), " has grouped-query attention");
  if (a.mla) {
    for (const char* key : {"model.n_kv_heads", "model.head_dim"})
      if (is_set(loaded, key))
        fail(key, " ", loaded.where(key), " applies to grouped-query attention; latent attention's widths are model.qk_nope_head_dim, "
             "model.qk_rope_head_dim and model.v_head_dim");
    if (m.q_lora_rank) a.mla->q_lora_rank = *m.q_lora_rank;
    if (m.kv_lora_rank) a.mla->kv_lora_rank = *m.kv_lora_rank;
    if (m.qk_nope_head_dim) a.mla->qk_nope_head_dim = *m.qk_nope_head_dim;
    if (m.qk_rope_head_dim) a.mla->qk_rope_head_dim = *m.qk_rope_head_dim;
    if (m.v_head_dim) a.mla->v_head_dim = *m.v_head_dim;
  }
  const int64_t seq_len = loaded.config.training.seq_len;
  if (m.max_seq_len && *m.max_seq_len < seq_len)
    fail("model.max_seq_len = ", *m.max_seq_len, " ", loaded.where("model.max_seq_len"),
         " is shorter than training.seq_len = ", seq_len, "; the model must cover the training sequences");
  a.max_seq_len = m.max_seq_len.value_or(seq_len);
  try {
    a.check();
  } catch (const UserError& e) {
    const auto keys = set_shape_keys(loaded);
    fail("model shape ", keys.empty() ? cat("of flavor ", quote(m.flavor)) : cat("(", join(keys, ", "), " set over flavor ", quote(m.flavor), ")"),
         ": ", e.what());
  }
  return a;
}

namespace {

// Validation runs the same model: its windows must fit the model's context (the RoPE table) too.
DecoderJobModel checked(DecoderJobModel model, const config::LoadedConfig& loaded) {
  const auto& v = loaded.config.validation;
  if (v.enable && v.seq_len > model.args.max_seq_len)
    fail("validation.seq_len = ", v.seq_len, " ", loaded.where("validation.seq_len"), " is longer than the model's max_seq_len ",
         model.args.max_seq_len, " (training.seq_len = ", loaded.config.training.seq_len,
         " unless model.max_seq_len says otherwise); set model.max_seq_len = ", v.seq_len, " or shorten validation.seq_len");
  return model;
}

DecoderJobModel unchecked_job_model(const config::LoadedConfig& loaded, const DecoderFamily& family,
                                    const protocols::RecordedModel* recorded) {
  const config::JobConfig& c = loaded.config;
  const auto keys = set_shape_keys(loaded);
  const bool from_hf = c.checkpoint.initial_load_in_hf && c.checkpoint.initial_load_path;
  const bool hf_flavor = c.model.flavor == kHfFlavor;
  if (hf_flavor && !from_hf && !recorded)
    fail("model.flavor = \"hf\" ", loaded.where("model.flavor"),
         " takes the model's shape from the weights the job starts from; set checkpoint.initial_load_path to a Hugging "
         "Face folder with checkpoint.initial_load_in_hf = true, or to a titan checkpoint, or name a flavor");
  // `recorded` without Hugging Face weights: the titan checkpoint the job starts from, no flavor named.
  if ((!from_hf && !recorded) || (is_set(loaded, "model.flavor") && !hf_flavor)) {
    DecoderJobModel out{apply_shape_keys(family.flavor(c.model.flavor), loaded), c.model.flavor};
    if (!keys.empty()) out.name = cat(c.model.flavor, " with ", join(keys, ", "), " set");
    if (from_hf && !recorded) {
      // The configured model must compute what the Hugging Face weights were trained to compute (a resumed run is
      // checked against its checkpoint when that loads).
      const std::string path = (std::filesystem::path(*c.checkpoint.initial_load_path) / "config.json").string();
      const auto differences = family.read_hf_config(path).computation_differences(out.args);
      if (!differences.empty())
        fail(path, " describes another model than model.flavor = ", quote(c.model.flavor), " ", loaded.where("model.flavor"),
             keys.empty() ? "" : cat(" with ", join(keys, ", ")), " (config.json vs configured):\n  ", join(differences, "\n  "),
             "\nset model.flavor = \"hf\" to take the whole shape from config.json, or fix the flavor or [model] keys");
    }
    return out;
  }
  // No flavor named: the Hugging Face config.json is the shape, or the shape a checkpoint recorded (the run's own
  // once it has saved, or the titan checkpoint it starts from); shape keys set in the config must agree with it.
  const std::string path =
      recorded ? recorded->where : (std::filesystem::path(*c.checkpoint.initial_load_path) / "config.json").string();
  DecoderArgs hf = recorded ? decoder_args_from_json(recorded->model, recorded->where + ": model", c.model.name)
                           : family.read_hf_config(path);
  if (recorded && !recorded->model.contains("attn_mask")) {
    // Recorded before the mask was: the recorded flavor's, where it is one of the family's.
    try {
      hf.attn_mask = family.flavor(recorded->flavor).attn_mask;
    } catch (const UserError&) {
    }
  }
  DecoderArgs args = apply_shape_keys(hf, loaded);
  // The model keeps the context it was made for (max_position_embeddings) unless model.max_seq_len says otherwise,
  // so that its Hugging Face export still advertises it.
  if (!c.model.max_seq_len) args.max_seq_len = std::max(hf.max_seq_len, c.training.seq_len);
  if (!recorded && c.training.seq_len > hf.max_seq_len)
    log::warn("training.seq_len = ", c.training.seq_len, " is longer than the ", hf.max_seq_len, " positions of ", path,
              " (max_position_embeddings): RoPE goes on past them with the same frequencies, untrained in these weights, and "
              "the model's context (and an export's max_position_embeddings) becomes ", args.max_seq_len);
  const auto differences = hf.computation_differences(args);
  if (!differences.empty())
    fail("[model] keys ", join(keys, ", "), " change the model that ", path, " describes (",
         recorded ? "recorded" : "config.json", " vs configured):\n  ",
         join(differences, "\n  "), "\nremove them to train the model the weights belong to");
  return {args, recorded ? recorded->flavor : cat("from ", path)};
}

}  // namespace

DecoderJobModel job_model(const config::LoadedConfig& loaded, const DecoderFamily& family,
                          const protocols::RecordedModel* recorded) {
  return checked(unchecked_job_model(loaded, family, recorded), loaded);
}

}  // namespace titan::models
