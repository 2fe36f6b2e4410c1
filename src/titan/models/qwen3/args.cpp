#include "titan/models/qwen3/args.h"

#include <map>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::qwen3 {

DecoderArgs base_args() {
  DecoderArgs a;
  a.family_name = "qwen3";
  a.qk_norm = true;
  a.rope_layout = models::RopeLayout::half_split;
  a.rope_scaling.enabled = false;
  a.norm_eps = 1e-6;
  a.rope_theta = 1000000;
  a.multiple_of = 1;
  a.max_seq_len = 4096;
  a.counts_tied_output = false;
  return a;
}

namespace {

DecoderArgs make(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t vocab, int64_t hidden, bool tied) {
  DecoderArgs a = base_args();
  a.dim = dim;
  a.n_layers = layers;
  a.n_heads = heads;
  a.n_kv_heads = kv_heads;
  a.head_dim_value = 128;
  a.vocab_size = vocab;
  a.hidden_dim = hidden;
  a.tie_word_embeddings = tied;
  return a;
}

// torchtitan's Qwen3 MoE flavors: every block a Mixture of Experts, softmax routing over `experts` experts of width
// `inter`, top 8 renormalised, the scores applied to the experts' outputs, no shared experts.
DecoderArgs make_moe(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t vocab, int64_t hidden, int64_t inter,
                     int64_t experts, int64_t max_seq_len, double rope_theta) {
  DecoderArgs a = make(dim, layers, heads, kv_heads, vocab, hidden, false);
  a.max_seq_len = max_seq_len;
  a.rope_theta = rope_theta;
  models::MoEArgs m;
  m.num_experts = experts;
  m.num_shared_experts = 0;
  m.top_k = 8;
  m.score_func = "softmax";
  m.route_norm = true;
  m.route_scale = 1.0;
  m.score_before_experts = false;
  m.hidden_dim = inter;
  a.moe = m;
  return a;
}

const std::map<std::string, DecoderArgs>& flavors() {
  static const std::map<std::string, DecoderArgs> table = {
      {"debugmodel", make(256, 8, 16, 8, 2048, 3072, true)},
      {"0.6B", make(1024, 28, 16, 8, 151936, 3072, true)},
      {"1.7B", make(2048, 28, 16, 8, 151936, 6144, true)},
      {"4B", make(2560, 36, 32, 8, 151936, 9728, true)},
      {"8B", make(4096, 36, 32, 8, 151936, 12288, false)},
      {"14B", make(5120, 40, 40, 8, 151936, 17408, false)},
      {"32B", make(5120, 64, 64, 8, 151936, 25600, false)},
      {"debugmodel_moe", make_moe(256, 8, 16, 8, 2048, 3072, 768, 64, 4096, 1000000)},
      {"30B-A3B", make_moe(2048, 48, 32, 4, 151936, 6144, 768, 128, 262144, 1000000)},
      // torchtitan v0.2.2's theta for this flavor (5e6), which it marks as unchecked.
      {"235B-A22B", make_moe(4096, 94, 64, 4, 151936, 12288, 1536, 128, 4096, 5000000)},
  };
  return table;
}

}  // namespace

std::vector<std::string> flavor_names() { return models::flavor_names(flavors()); }

DecoderArgs flavor(const std::string& name) { return models::find_flavor(flavors(), "qwen3", name); }

}  // namespace titan::qwen3
