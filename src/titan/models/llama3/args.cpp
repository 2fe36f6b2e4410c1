#include "titan/models/llama3/args.h"

#include <map>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::llama3 {
namespace {

DecoderArgs make(int64_t dim, int64_t layers, int64_t heads, std::optional<int64_t> kv_heads, int64_t vocab,
                 std::optional<double> ffn_multiplier, int64_t multiple_of, double theta) {
  DecoderArgs a;
  a.dim = dim;
  a.n_layers = layers;
  a.n_heads = heads;
  a.n_kv_heads = kv_heads;
  a.vocab_size = vocab;
  a.ffn_dim_multiplier = ffn_multiplier;
  a.multiple_of = multiple_of;
  a.rope_theta = theta;
  return a;
}

const std::map<std::string, DecoderArgs>& flavors() {
  static const std::map<std::string, DecoderArgs> table = [] {
    std::map<std::string, DecoderArgs> t;
    t["debugmodel"] = make(256, 6, 16, std::nullopt, 2048, std::nullopt, 256, 500000);
    // Same shape with grouped-query attention (4 query heads per key/value head), for tests and small runs.
    t["debugmodel_gqa"] = make(256, 6, 16, 4, 2048, std::nullopt, 256, 500000);
    // About 100M parameters with the debug vocabulary: for benchmarks (checkpoint speed) and mid-size CPU runs.
    t["100M"] = make(768, 16, 12, 4, 2048, std::nullopt, 256, 500000);
    t["8B"] = make(4096, 32, 32, 8, 128256, 1.3, 1024, 500000);
    // torchtitan's flex and varlen attention variants: the same shapes, with the document (block-causal) mask.
    for (const char* name : {"debugmodel_flex_attn", "debugmodel_varlen_attn", "8B_flex", "8B_varlen"}) {
      t[name] = t[std::string(name).starts_with("8B") ? "8B" : "debugmodel"];
      t[name].attn_mask = "block_causal";
    }
    t["70B"] = make(8192, 80, 64, 8, 128256, 1.3, 4096, 500000);
    t["405B"] = make(16384, 126, 128, 8, 128256, 1.2, 4096, 500000);
    // Llama 3.2: tied embeddings and RoPE scaling factor 32.
    DecoderArgs one_b = make(2048, 16, 32, 8, 128256, 1.5, 256, 500000);
    one_b.tie_word_embeddings = true;
    one_b.rope_scaling.factor = 32.0;
    t["1B"] = one_b;
    DecoderArgs three_b = make(3072, 28, 24, 8, 128256, 1.0, 256, 500000);
    three_b.tie_word_embeddings = true;
    three_b.rope_scaling.factor = 32.0;
    t["3B"] = three_b;
    return t;
  }();
  return table;
}

}  // namespace

std::vector<std::string> flavor_names() { return models::flavor_names(flavors()); }

DecoderArgs flavor(const std::string& name) { return models::find_flavor(flavors(), "llama3", name); }

}  // namespace titan::llama3
