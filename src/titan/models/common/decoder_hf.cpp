#include "titan/models/common/decoder_hf.h"

#include <regex>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::models {
namespace {

// (titan suffix inside a block, HF suffix inside a decoder layer)
const std::pair<const char*, const char*> kLayerNames[] = {
    {"attention.wq.weight", "self_attn.q_proj.weight"},   {"attention.wk.weight", "self_attn.k_proj.weight"},
    {"attention.wv.weight", "self_attn.v_proj.weight"},   {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"attention.q_norm.weight", "self_attn.q_norm.weight"}, {"attention.k_norm.weight", "self_attn.k_norm.weight"},
    {"feed_forward.w1.weight", "mlp.gate_proj.weight"},   {"feed_forward.w2.weight", "mlp.down_proj.weight"},
    {"feed_forward.w3.weight", "mlp.up_proj.weight"},     {"attention_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    // Mixture-of-Experts blocks: the router, and the shared experts where a family has them (as DeepSeek's HF names).
    {"moe.router.gate.weight", "mlp.gate.weight"},
    {"moe.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
    {"moe.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
    {"moe.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"}};

// DeepSeek-V3's latent attention (DeepseekV3ForCausalLM's names) and its routers' balancing biases; its other
// names are the table's above.
const std::pair<const char*, const char*> kLatentNames[] = {
    {"attention.wq.weight", "self_attn.q_proj.weight"},
    {"attention.wq_a.weight", "self_attn.q_a_proj.weight"},
    {"attention.q_norm.weight", "self_attn.q_a_layernorm.weight"},
    {"attention.wq_b.weight", "self_attn.q_b_proj.weight"},
    {"attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
    {"attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
    {"attention.wkv_b.weight", "self_attn.kv_b_proj.weight"},
    {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"moe.expert_bias", "mlp.gate.e_score_correction_bias"}};

// The routed experts' 3-D weights: one HF tensor per expert (model.layers.N.mlp.experts.J.<projection>.weight).
const std::pair<const char*, const char*> kExpertNames[] = {
    {"moe.experts.w1", "gate_proj"}, {"moe.experts.w2", "down_proj"}, {"moe.experts.w3", "up_proj"}};

// Meta keeps each head's rotary pairs interleaved (x0, x1), (x2, x3), ...; HF stores the first halves of all pairs,
// then the second halves. Rows of wq/wk are reordered accordingly.
at::Tensor interleaved_to_halves(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  return w.view({heads, rows / heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
}

at::Tensor halves_to_interleaved(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  return w.view({heads, 2, rows / heads / 2, cols}).transpose(1, 2).reshape({rows, cols});
}

int64_t rotary_heads(const std::string& titan_name, const DecoderArgs& args) {
  // DeepSeek-V3's files keep the rotary columns interleaved (transformers' rope_interleave), as torchtitan does.
  if (args.rope_layout != RopeLayout::interleaved || args.mla) return 0;
  if (titan_name.find("attention.wq.weight") != std::string::npos) return args.n_heads;
  if (titan_name.find("attention.wk.weight") != std::string::npos) return args.kv_heads();
  return 0;
}

}  // namespace

int64_t permuted_rows_per_head(const std::string& titan_name, const DecoderArgs& args) {
  return rotary_heads(titan_name, args) ? args.head_dim() : 0;
}

at::Tensor from_hf_head_rows(const at::Tensor& hf_rows, int64_t rows_per_head) {
  return halves_to_interleaved(hf_rows, hf_rows.size(0) / rows_per_head);
}

std::optional<std::string> to_hf_name(const std::string& name, const DecoderArgs& args) {
  if (name == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (name == "norm.weight") return "model.norm.weight";
  if (name == "output.weight") return "lm_head.weight";
  static const std::regex layer(R"(layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return std::nullopt;
  if (args.mla)
    for (const auto& [titan, hf] : kLatentNames)
      if (m[2] == titan) return "model.layers." + m[1].str() + "." + hf;
  for (const auto& [titan, hf] : kLayerNames)
    if (m[2] == titan && (!args.mla || std::string(titan).rfind("attention.", 0) != 0)) return "model.layers." + m[1].str() + "." + hf;
  return std::nullopt;
}

std::optional<std::string> from_hf_name(const std::string& name, const DecoderArgs& args) {
  if (name == "model.embed_tokens.weight") return "tok_embeddings.weight";
  if (name == "model.norm.weight") return "norm.weight";
  if (name == "lm_head.weight") return "output.weight";
  static const std::regex layer(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return std::nullopt;
  if (args.mla)
    for (const auto& [titan, hf] : kLatentNames)
      if (m[2] == hf) return "layers." + m[1].str() + "." + titan;
  for (const auto& [titan, hf] : kLayerNames)
    if (m[2] == hf && (!args.mla || std::string(titan).rfind("attention.", 0) != 0)) return "layers." + m[1].str() + "." + titan;
  return std::nullopt;
}

std::optional<std::string> skipped_hf_tensor(const std::string& name, const DecoderArgs& args) {
  if (ends_with(name, ".rotary_emb.inv_freq"))
    return "RoPE frequencies older transformers versions saved (computed from config.json's RoPE settings instead, as "
           "transformers does)";
  if (!args.mla) return std::nullopt;
  static const std::regex layer(R"(model\.layers\.(\d+)\..+)");
  std::smatch m;
  if (!std::regex_match(name, m, layer) || (m[1].length() < 10 && std::stoll(m[1].str()) < args.n_layers)) return std::nullopt;
  return cat("the multi-token-prediction layer past the model's ", args.n_layers,
             " blocks (config.json's num_nextn_predict_layers), which titan's DeepSeek-V3, as torchtitan's, does not train");
}

int64_t hf_slices(const std::string& name, const DecoderArgs& args) {
  if (!args.moe) return 0;
  static const std::regex expert(R"(layers\.\d+\.moe\.experts\.w[123])");
  return std::regex_match(name, expert) ? args.moe->num_experts : 0;
}

std::string hf_slice_name(const std::string& name, int64_t index) {
  static const std::regex expert(R"(layers\.(\d+)\.(moe\.experts\.w[123]))");
  std::smatch m;
  if (std::regex_match(name, m, expert))
    for (const auto& [titan, hf] : kExpertNames)
      if (m[2] == titan) return "model.layers." + m[1].str() + ".mlp.experts." + std::to_string(index) + "." + hf + ".weight";
  TORCH_CHECK(false, "internal: ", name, " is not an expert weight");
}

std::optional<std::pair<std::string, int64_t>> from_hf_slice_name(const std::string& name) {
  static const std::regex expert(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight)");
  std::smatch m;
  if (std::regex_match(name, m, expert))
    for (const auto& [titan, hf] : kExpertNames)
      if (m[3] == hf) return std::make_pair("layers." + m[1].str() + "." + titan, std::stoll(m[2].str()));
  return std::nullopt;
}

at::Tensor to_hf_tensor(const std::string& titan_name, const at::Tensor& t, const DecoderArgs& args) {
  int64_t heads = rotary_heads(titan_name, args);
  return heads ? interleaved_to_halves(t, heads) : t;
}

at::Tensor from_hf_tensor(const std::string& titan_name, const at::Tensor& t, const DecoderArgs& args) {
  int64_t heads = rotary_heads(titan_name, args);
  return heads ? halves_to_interleaved(t, heads) : t;
}

}  // namespace titan::models
