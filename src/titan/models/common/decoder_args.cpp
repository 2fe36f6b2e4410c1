#include "titan/models/common/decoder_args.h"

#include <cmath>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/models/common/json_fields.h"

namespace titan::models {

using json = nlohmann::json;

int64_t DecoderArgs::ffn_hidden_dim() const {
  if (hidden_dim) return *hidden_dim;
  int64_t hidden = static_cast<int64_t>(2.0 * (4 * dim) / 3.0);
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

void DecoderArgs::check() const {
  if (dim <= 0 || n_layers <= 0 || n_heads <= 0 || vocab_size <= 0 || multiple_of <= 0)
    fail("model dimensions must be positive (dim ", dim, ", n_layers ", n_layers, ", n_heads ", n_heads, ", vocab_size ",
         vocab_size, ")");
  if (hidden_dim && *hidden_dim <= 0) fail("the feed-forward hidden_dim must be positive, got ", *hidden_dim);
  if (ffn_dim_multiplier && !(*ffn_dim_multiplier > 0)) fail("ffn_dim_multiplier must be positive, got ", *ffn_dim_multiplier);
  if (!(norm_eps > 0)) fail("norm_eps must be positive, got ", norm_eps);
  if (!(rope_theta > 0)) fail("rope_theta must be positive, got ", rope_theta);
  if (max_seq_len <= 0) fail("max_seq_len must be positive, got ", max_seq_len);
  if (rope_scaling.enabled &&
      (!(rope_scaling.factor > 0) || !(rope_scaling.low_freq_factor > 0) ||
       !(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor) || rope_scaling.original_max_position_embeddings <= 0))
    fail("RoPE scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0; got factor ",
         rope_scaling.factor, ", low_freq_factor ", rope_scaling.low_freq_factor, ", high_freq_factor ",
         rope_scaling.high_freq_factor, ", original_max_position_embeddings ", rope_scaling.original_max_position_embeddings);
  if (mla) {
    const LatentAttentionArgs& l = *mla;
    if (l.q_lora_rank < 0 || l.kv_lora_rank <= 0 || l.qk_nope_head_dim < 0 || l.qk_rope_head_dim <= 0 || l.v_head_dim <= 0)
      fail("latent attention needs q_lora_rank >= 0, kv_lora_rank > 0, qk_nope_head_dim >= 0, qk_rope_head_dim > 0 and "
           "v_head_dim > 0; got ", l.q_lora_rank, ", ", l.kv_lora_rank, ", ", l.qk_nope_head_dim, ", ", l.qk_rope_head_dim, ", ",
           l.v_head_dim);
    if (l.qk_rope_head_dim % 2 != 0) fail("qk_rope_head_dim ", l.qk_rope_head_dim, " must be even for rotary embeddings");
    if (qk_norm) fail("latent attention has no per-head q/k norms (qk_norm)");
    if (rope_scaling.enabled) fail("latent attention takes YaRN scaling, not Llama 3.1's rope_scaling");
  } else {
    if (head_dim_value) {
      if (*head_dim_value <= 0) fail("head_dim must be positive, got ", *head_dim_value);
    } else if (dim % n_heads != 0) {
      fail("model dim ", dim, " is not divisible by n_heads ", n_heads);
    }
    if (head_dim() % 2 != 0) fail("head_dim ", head_dim(), " must be even for rotary embeddings");
    if (kv_heads() <= 0 || n_heads % kv_heads() != 0)
      fail("n_heads ", n_heads, " must be a multiple of n_kv_heads ", kv_heads());
    if (yarn) fail("YaRN scaling applies to latent attention only here");
  }
  if (yarn && (!(yarn->factor >= 1) || yarn->original_seq_len <= 0 || !(yarn->beta_fast > 0) || !(yarn->beta_slow > 0)))
    fail("YaRN needs factor >= 1, original_seq_len > 0 and positive beta_fast/beta_slow; got factor ", yarn->factor,
         ", original_seq_len ", yarn->original_seq_len, ", beta_fast ", yarn->beta_fast, ", beta_slow ", yarn->beta_slow);
  if (n_dense_layers < 0 || (n_dense_layers > 0 && !moe))
    fail("n_dense_layers = ", n_dense_layers, " needs a Mixture-of-Experts model (the dense blocks precede the MoE ones)");
  if (moe) moe->check();
}

double DecoderArgs::attention_scale_factor() const {
  if (!yarn_active()) return 1.0;
  const double m = 0.1 * yarn->mscale * std::log(yarn->factor) + 1.0;
  return m * m;
}

std::vector<ParameterShape> DecoderArgs::buffer_shapes() const {
  std::vector<ParameterShape> out;
  if (moe && moe->load_balance_coeff)
    for (int64_t i = n_dense_layers; i < n_layers; ++i) out.push_back({cat("layers.", i, ".moe.expert_bias"), {moe->num_experts}});
  return out;
}

std::vector<ParameterShape> DecoderArgs::parameter_shapes() const {
  std::vector<ParameterShape> out;
  out.push_back({"tok_embeddings.weight", {vocab_size, dim}});
  for (int64_t i = 0; i < n_layers; ++i)
    for (auto& p : layer_parameter_shapes(i)) out.push_back(std::move(p));
  out.push_back({"norm.weight", {dim}});
  if (!tie_word_embeddings) out.push_back({"output.weight", {vocab_size, dim}});
  return out;
}

std::vector<ParameterShape> DecoderArgs::layer_parameter_shapes(int64_t layer) const {
  std::vector<ParameterShape> out;
  const int64_t d = dim, hd = head_dim(), h = n_heads, kv = kv_heads(), f = ffn_hidden_dim();
  const std::string p = "layers." + std::to_string(layer) + ".";
  if (mla) {
    const LatentAttentionArgs& l = *mla;
    if (l.q_lora_rank == 0) {
      out.push_back({p + "attention.wq.weight", {h * hd, d}});
    } else {
      out.push_back({p + "attention.wq_a.weight", {l.q_lora_rank, d}});
      out.push_back({p + "attention.q_norm.weight", {l.q_lora_rank}});
      out.push_back({p + "attention.wq_b.weight", {h * hd, l.q_lora_rank}});
    }
    out.push_back({p + "attention.wkv_a.weight", {l.kv_lora_rank + l.qk_rope_head_dim, d}});
    out.push_back({p + "attention.kv_norm.weight", {l.kv_lora_rank}});
    out.push_back({p + "attention.wkv_b.weight", {h * (l.qk_nope_head_dim + l.v_head_dim), l.kv_lora_rank}});
    out.push_back({p + "attention.wo.weight", {d, h * l.v_head_dim}});
  } else {
    out.push_back({p + "attention.wq.weight", {h * hd, d}});
    out.push_back({p + "attention.wk.weight", {kv * hd, d}});
    out.push_back({p + "attention.wv.weight", {kv * hd, d}});
    out.push_back({p + "attention.wo.weight", {d, h * hd}});
  }
  if (qk_norm) {
    out.push_back({p + "attention.q_norm.weight", {hd}});
    out.push_back({p + "attention.k_norm.weight", {hd}});
  }
  if (is_moe_layer(layer)) {
    const int64_t e = moe->num_experts, m = moe->hidden_dim, shared = moe->hidden_dim * moe->num_shared_experts;
    out.push_back({p + "moe.router.gate.weight", {e, d}});
    out.push_back({p + "moe.experts.w1", {e, m, d}});
    out.push_back({p + "moe.experts.w2", {e, d, m}});
    out.push_back({p + "moe.experts.w3", {e, m, d}});
    if (shared > 0) {
      out.push_back({p + "moe.shared_experts.w1.weight", {shared, d}});
      out.push_back({p + "moe.shared_experts.w2.weight", {d, shared}});
      out.push_back({p + "moe.shared_experts.w3.weight", {shared, d}});
    }
  } else {
    out.push_back({p + "feed_forward.w1.weight", {f, d}});
    out.push_back({p + "feed_forward.w2.weight", {d, f}});
    out.push_back({p + "feed_forward.w3.weight", {f, d}});
  }
  out.push_back({p + "attention_norm.weight", {d}});
  out.push_back({p + "ffn_norm.weight", {d}});
  return out;
}

int64_t DecoderArgs::reported_parameters() const {
  const int64_t stored = stored_parameters();
  return tie_word_embeddings && !counts_tied_output ? stored - embedding_parameters() : stored;
}

int64_t DecoderArgs::active_parameters() const {
  if (!moe || moe_layers() == 0) return reported_parameters();
  int64_t routed = 0;  // one MoE block's routed experts
  for (const auto& p : layer_parameter_shapes(n_layers - 1))
    if (p.name.find("moe.experts.") != std::string::npos) routed += p.numel();
  return reported_parameters() - moe_layers() * (routed - routed * moe->top_k / moe->num_experts);
}

double DecoderArgs::flops_per_token(int64_t seq_len) const {
  double dense = static_cast<double>(stored_parameters() - embedding_parameters());
  if (moe) {
    // Only top_k of the routed experts' parameters are active per token (floor of the product, as torchtitan).
    int64_t routed = 0;
    if (moe_layers() > 0)
      for (const auto& p : layer_parameter_shapes(n_layers - 1))
        if (p.name.find("moe.experts.") != std::string::npos) routed += p.numel();
    routed *= moe_layers();
    dense -= static_cast<double>(routed);
    dense += static_cast<double>(routed * moe->top_k / moe->num_experts);
  }
  if (tie_word_embeddings && counts_tied_output) dense += static_cast<double>(vocab_size * dim);
  // 6 x layers x heads x (query/key width + value width) x seq_len: QK^T and the product with V, forward and back.
  double attention = 6.0 * static_cast<double>(n_layers) * static_cast<double>(n_heads) *
                     static_cast<double>(head_dim() + value_head_dim()) * static_cast<double>(seq_len);
  return 6.0 * dense + attention;
}

namespace {

json rope_scaling_json(const RopeScaling& r) {
  if (!r.enabled) return nullptr;
  return {{"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position_embeddings", r.original_max_position_embeddings}};
}


const char* layout_name(RopeLayout l) { return l == RopeLayout::interleaved ? "interleaved" : "half_split"; }

}  // namespace

json DecoderArgs::to_json() const {
  json j = {{"family", family_name},
            {"dim", dim},
            {"n_layers", n_layers},
            {"n_heads", n_heads},
            {"n_kv_heads", kv_heads()},
            {"head_dim", head_dim()},
            {"vocab_size", vocab_size},
            {"ffn_hidden_dim", ffn_hidden_dim()},
            {"norm_eps", norm_eps},
            {"rope_theta", rope_theta},
            {"rope_layout", layout_name(rope_layout)},
            {"qk_norm", qk_norm},
            {"max_seq_len", max_seq_len},
            {"tie_word_embeddings", tie_word_embeddings},
            {"depth_init", depth_init},
            {"attn_mask", attn_mask}};  // the flavor's default mask: a run that takes its model from here keeps it
  j["rope_scaling"] = rope_scaling_json(rope_scaling);
  if (moe) {
    json m = {{"num_experts", moe->num_experts},
              {"num_shared_experts", moe->num_shared_experts},
              {"score_func", moe->score_func},
              {"route_norm", moe->route_norm},
              {"route_scale", moe->route_scale},
              {"score_before_experts", moe->score_before_experts},
              {"top_k", moe->top_k},
              {"hidden_dim", moe->hidden_dim}};
    m["num_expert_groups"] = moe->num_expert_groups ? json(*moe->num_expert_groups) : json(nullptr);
    m["num_limited_groups"] = moe->num_limited_groups ? json(*moe->num_limited_groups) : json(nullptr);
    m["load_balance_coeff"] = moe->load_balance_coeff ? json(*moe->load_balance_coeff) : json(nullptr);
    j["moe"] = m;
    if (n_dense_layers > 0) j["n_dense_layers"] = n_dense_layers;
  }
  if (mla)
    j["mla"] = {{"q_lora_rank", mla->q_lora_rank},
                {"kv_lora_rank", mla->kv_lora_rank},
                {"qk_nope_head_dim", mla->qk_nope_head_dim},
                {"qk_rope_head_dim", mla->qk_rope_head_dim},
                {"v_head_dim", mla->v_head_dim},
                {"norm_eps", mla->norm_eps ? json(*mla->norm_eps) : json(nullptr)}};
  if (yarn)
    j["yarn"] = {{"original_seq_len", yarn->original_seq_len},
                 {"factor", yarn->factor},
                 {"beta_fast", yarn->beta_fast},
                 {"beta_slow", yarn->beta_slow},
                 {"mscale", yarn->mscale}};
  if (final_norm_dtype_eps) j["final_norm_dtype_eps"] = true;
  return j;
}

DecoderArgs decoder_args_from_json(const json& j, const std::string& where, const std::string& family) {
  if (!j.is_object()) fail(where, ": model arguments must be a JSON object");
  JsonFields f{j, where, ""};
  DecoderArgs a;
  a.family_name = family;
  if (const json* name = f.find("family")) {
    if (!name->is_string()) fail(where, ": family must be a string, got ", name->dump());
    a.family_name = name->get<std::string>();
  }
  a.dim = f.integer("dim");
  a.n_layers = f.integer("n_layers");
  a.n_heads = f.integer("n_heads");
  a.n_kv_heads = f.integer("n_kv_heads");
  // Written since head_dim could differ from dim / n_heads; older metadata implies the quotient.
  if (f.find("head_dim") && (a.n_heads <= 0 || f.integer("head_dim") != a.dim / a.n_heads || a.dim % a.n_heads != 0))
    a.head_dim_value = f.integer("head_dim");
  a.vocab_size = f.integer("vocab_size");
  a.hidden_dim = f.integer("ffn_hidden_dim");
  a.multiple_of = 1;
  a.norm_eps = f.number("norm_eps", a.norm_eps);
  a.rope_theta = f.number("rope_theta", a.rope_theta);
  a.max_seq_len = f.integer("max_seq_len");
  a.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  a.depth_init = f.boolean("depth_init", true);
  a.qk_norm = f.boolean("qk_norm", false);
  if (const json* mask = f.find("attn_mask")) {
    if (*mask != "causal" && *mask != "block_causal") fail(where, ": attn_mask must be \"causal\" or \"block_causal\", got ", mask->dump());
    a.attn_mask = mask->get<std::string>();
  }
  if (const json* layout = f.find("rope_layout")) {
    if (*layout == "interleaved") a.rope_layout = RopeLayout::interleaved;
    else if (*layout == "half_split") a.rope_layout = RopeLayout::half_split;
    else fail(where, ": rope_layout must be \"interleaved\" or \"half_split\", got ", layout->dump());
  }
  const json* rope = f.find("rope_scaling");
  a.rope_scaling.enabled = rope != nullptr;
  if (rope) {
    JsonFields r{*rope, where + ": rope_scaling", ""};
    a.rope_scaling.factor = r.number("factor", a.rope_scaling.factor);
    a.rope_scaling.low_freq_factor = r.number("low_freq_factor", a.rope_scaling.low_freq_factor);
    a.rope_scaling.high_freq_factor = r.number("high_freq_factor", a.rope_scaling.high_freq_factor);
    a.rope_scaling.original_max_position_embeddings = r.integer("original_max_position_embeddings");
  }
  if (const json* m = f.find("moe"); m && !m->is_null()) {
    JsonFields mf{*m, where + ": moe", ""};
    MoEArgs moe;
    moe.num_experts = mf.integer("num_experts");
    moe.num_shared_experts = mf.integer("num_shared_experts");
    const json* score = mf.find("score_func");
    if (!score || !score->is_string()) fail(where, ": moe.score_func must be a string");
    moe.score_func = score->get<std::string>();
    moe.route_norm = mf.boolean("route_norm", false);
    moe.route_scale = mf.number("route_scale", 1.0);
    moe.score_before_experts = mf.boolean("score_before_experts", true);
    moe.top_k = mf.integer("top_k");
    moe.hidden_dim = mf.integer("hidden_dim");
    auto optional_integer = [&](const char* key) -> std::optional<int64_t> {
      const json* v = mf.find(key);
      if (!v || v->is_null()) return std::nullopt;
      return mf.integer(key);
    };
    moe.num_expert_groups = optional_integer("num_expert_groups");
    moe.num_limited_groups = optional_integer("num_limited_groups");
    const json* coeff = mf.find("load_balance_coeff");
    moe.load_balance_coeff = coeff && !coeff->is_null() ? std::optional<double>(mf.number("load_balance_coeff", 0)) : std::nullopt;
    a.moe = moe;
    if (f.find("n_dense_layers")) a.n_dense_layers = f.integer("n_dense_layers");
  }
  if (const json* l = f.find("mla"); l && !l->is_null()) {
    JsonFields lf{*l, where + ": mla", ""};
    LatentAttentionArgs mla;
    mla.q_lora_rank = lf.integer("q_lora_rank");
    mla.kv_lora_rank = lf.integer("kv_lora_rank");
    mla.qk_nope_head_dim = lf.integer("qk_nope_head_dim");
    mla.qk_rope_head_dim = lf.integer("qk_rope_head_dim");
    mla.v_head_dim = lf.integer("v_head_dim");
    if (lf.find("norm_eps")) mla.norm_eps = lf.number("norm_eps", 0);
    a.mla = mla;
    a.head_dim_value.reset();
  }
  if (const json* y = f.find("yarn"); y && !y->is_null()) {
    JsonFields yf{*y, where + ": yarn", ""};
    YarnScaling yarn;
    yarn.original_seq_len = yf.integer("original_seq_len");
    yarn.factor = yf.number("factor", yarn.factor);
    yarn.beta_fast = yf.number("beta_fast", yarn.beta_fast);
    yarn.beta_slow = yf.number("beta_slow", yarn.beta_slow);
    yarn.mscale = yf.number("mscale", yarn.mscale);
    a.yarn = yarn;
  }
  a.final_norm_dtype_eps = f.boolean("final_norm_dtype_eps", false);
  try {
    a.check();
  } catch (const UserError& e) {
    fail(where, ": ", e.what());
  }
  return a;
}

std::shared_ptr<const protocols::ModelArgs> DecoderArgs::parse_json(const json& j, const std::string& where) const {
  auto out = std::make_shared<DecoderArgs>(decoder_args_from_json(j, where, family_name));
  out->counts_tied_output = counts_tied_output;
  return out;
}

std::vector<std::string> DecoderArgs::computation_differences(const protocols::ModelArgs& other_args) const {
  std::vector<std::string> out;
  auto compare = [&](const char* name, auto x, auto y) {
    if (x != y) out.push_back(cat(name, ": ", x, " vs ", y));
  };
  compare("model family (model.name)", family_name, other_args.family());
  const auto* other = dynamic_cast<const DecoderArgs*>(&other_args);
  if (!other) return out;
  const DecoderArgs &a = *this, &b = *other;
  compare("dim (hidden_size)", a.dim, b.dim);
  compare("n_layers (num_hidden_layers)", a.n_layers, b.n_layers);
  compare("n_heads (num_attention_heads)", a.n_heads, b.n_heads);
  compare("n_kv_heads (num_key_value_heads)", a.kv_heads(), b.kv_heads());
  compare("head_dim", a.head_dim(), b.head_dim());
  compare("vocab_size", a.vocab_size, b.vocab_size);
  compare("feed-forward (moe)", a.moe ? "Mixture of Experts" : "dense", b.moe ? "Mixture of Experts" : "dense");
  if (a.moe && b.moe)
    for (auto& line : a.moe->differences(*b.moe)) out.push_back(std::move(line));
  if (a.moe && b.moe) compare("dense layers before the MoE ones (first_k_dense_replace)", a.n_dense_layers, b.n_dense_layers);
  if (!a.moe || a.n_dense_layers > 0)
    compare("feed-forward hidden dim (intermediate_size)", a.ffn_hidden_dim(), b.ffn_hidden_dim());
  compare("attention", a.mla ? "latent (MLA)" : "grouped-query", b.mla ? "latent (MLA)" : "grouped-query");
  if (a.mla && b.mla) {
    compare("q_lora_rank", a.mla->q_lora_rank, b.mla->q_lora_rank);
    compare("kv_lora_rank", a.mla->kv_lora_rank, b.mla->kv_lora_rank);
    compare("qk_nope_head_dim", a.mla->qk_nope_head_dim, b.mla->qk_nope_head_dim);
    compare("qk_rope_head_dim", a.mla->qk_rope_head_dim, b.mla->qk_rope_head_dim);
    compare("v_head_dim", a.mla->v_head_dim, b.mla->v_head_dim);
  }
  compare("YaRN scaling (rope_scaling)", a.yarn_active() ? "active" : "off", b.yarn_active() ? "active" : "off");
  if (a.yarn_active() && b.yarn_active()) {
    compare("YaRN factor", a.yarn->factor, b.yarn->factor);
    compare("YaRN original_seq_len (original_max_position_embeddings)", a.yarn->original_seq_len, b.yarn->original_seq_len);
    compare("YaRN beta_fast", a.yarn->beta_fast, b.yarn->beta_fast);
    compare("YaRN beta_slow", a.yarn->beta_slow, b.yarn->beta_slow);
    compare("YaRN mscale", a.yarn->mscale, b.yarn->mscale);
  }
  // Not compared: the final norm's epsilon (torchtitan's DeepSeek-V3 flavors take the dtype's, a config.json
  // rms_norm_eps), a difference of rounding size that torchtitan's own conversion ignores too.
  compare("norm_eps (rms_norm_eps)", a.norm_eps, b.norm_eps);
  compare("rope_theta", a.rope_theta, b.rope_theta);
  compare("q/k norms (qk_norm)", a.qk_norm ? "true" : "false", b.qk_norm ? "true" : "false");
  compare("rotary layout", layout_name(a.rope_layout), layout_name(b.rope_layout));
  compare("tie_word_embeddings", a.tie_word_embeddings ? "true" : "false", b.tie_word_embeddings ? "true" : "false");
  compare("rope scaling (rope_scaling)", a.rope_scaling.enabled ? "llama3" : "none", b.rope_scaling.enabled ? "llama3" : "none");
  if (a.rope_scaling.enabled && b.rope_scaling.enabled) {
    compare("rope_scaling factor", a.rope_scaling.factor, b.rope_scaling.factor);
    compare("rope_scaling low_freq_factor", a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
    compare("rope_scaling high_freq_factor", a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
    compare("rope_scaling original_max_position_embeddings", a.rope_scaling.original_max_position_embeddings,
            b.rope_scaling.original_max_position_embeddings);
  }
  return out;
}

std::shared_ptr<const protocols::ModelArgs> DecoderArgs::with_context_length(int64_t length) const {
  auto out = std::make_shared<DecoderArgs>(*this);
  out->max_seq_len = length;
  return out;
}

std::vector<std::string> flavor_names(const std::map<std::string, DecoderArgs>& table) {
  std::vector<std::string> names;
  for (const auto& [name, args] : table) names.push_back(name);
  return names;
}

DecoderArgs find_flavor(const std::map<std::string, DecoderArgs>& table, const std::string& family, const std::string& name) {
  auto it = table.find(name);
  if (it != table.end()) return it->second;
  const auto names = flavor_names(table);
  const std::string hint = closest_match(name, names);
  fail("unknown ", family, " flavor ", quote(name), "; known flavors: ", join(names, ", "),
       hint.empty() ? "" : cat(" (did you mean ", quote(hint), "?)"));
}

const DecoderArgs& as_decoder(const protocols::ModelArgs& args, const std::string& what) {
  const auto* d = dynamic_cast<const DecoderArgs*>(&args);
  if (!d) fail(what, " supports the decoder families (llama3, qwen3, deepseek_v3); model.name = ", quote(args.family()), " is not one");
  return *d;
}

}  // namespace titan::models
