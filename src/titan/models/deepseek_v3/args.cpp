#include "titan/models/deepseek_v3/args.h"

#include <map>

namespace titan::deepseek_v3 {

DecoderArgs base_args() {
  DecoderArgs a;
  a.family_name = "deepseek_v3";
  a.rope_layout = models::RopeLayout::interleaved;
  a.rope_scaling.enabled = false;
  a.yarn = models::YarnScaling{};
  a.norm_eps = 1e-5;
  a.rope_theta = 10000;
  a.multiple_of = 1;
  a.max_seq_len = 16384;
  a.counts_tied_output = false;
  a.final_norm_dtype_eps = true;
  return a;
}

namespace {

struct Shape {
  int64_t vocab, dim, inter_dim, moe_inter_dim, layers, dense_layers, heads;
  int64_t experts, shared, top_k;
  std::optional<int64_t> groups, limited_groups;
  const char* score_func;
  bool route_norm;
  double route_scale;
  int64_t q_lora_rank;
  double mscale;
};

DecoderArgs make(const Shape& s) {
  DecoderArgs a = base_args();
  a.vocab_size = s.vocab;
  a.dim = s.dim;
  a.hidden_dim = s.inter_dim;
  a.n_layers = s.layers;
  a.n_dense_layers = s.dense_layers;
  a.n_heads = s.heads;
  models::MoEArgs m;
  m.num_experts = s.experts;
  m.num_shared_experts = s.shared;
  m.top_k = s.top_k;
  m.num_expert_groups = s.groups;
  m.num_limited_groups = s.limited_groups;
  m.score_func = s.score_func;
  m.route_norm = s.route_norm;
  m.route_scale = s.route_scale;
  m.score_before_experts = false;
  m.hidden_dim = s.moe_inter_dim;
  a.moe = m;
  models::LatentAttentionArgs l;
  l.q_lora_rank = s.q_lora_rank;
  l.kv_lora_rank = 512;
  l.qk_nope_head_dim = 128;
  l.qk_rope_head_dim = 64;
  l.v_head_dim = 128;
  a.mla = l;
  a.yarn->mscale = s.mscale;
  return a;
}

const std::map<std::string, DecoderArgs>& flavors() {
  static const std::map<std::string, DecoderArgs> table = [] {
    std::map<std::string, DecoderArgs> t;
    t["debugmodel"] = make({2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, std::nullopt, std::nullopt, "softmax", false, 1.0, 0, 0.70});
    // torchtitan's flex-attention variant of the debug model: the same arguments with the document (block-causal)
    // mask, which torchtitan's 16B, 236B and 671B flavors use too.
    t["debugmodel_flex_attn"] = t["debugmodel"];
    t["debugmodel_flex_attn"].attn_mask = "block_causal";
    t["16B"] = make({102400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, std::nullopt, std::nullopt, "softmax", false, 1.0, 0, 0.70});
    t["236B"] = make({102400, 5120, 12288, 1536, 60, 1, 128, 160, 2, 6, 8, 3, "softmax", false, 16.0, 1536, 1.0});
    t["671B"] = make({129280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, 8, 4, "sigmoid", true, 2.5, 1536, 1.0});
    for (const char* name : {"16B", "236B", "671B"}) t[name].attn_mask = "block_causal";
    return t;
  }();
  return table;
}

}  // namespace

std::vector<std::string> flavor_names() { return models::flavor_names(flavors()); }

DecoderArgs flavor(const std::string& name) { return models::find_flavor(flavors(), "deepseek_v3", name); }

}  // namespace titan::deepseek_v3
