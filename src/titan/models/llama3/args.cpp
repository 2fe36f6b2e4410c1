#include "titan/models/llama3/args.h"

#include <map>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::llama3 {
namespace {

ModelArgs make(int64_t dim, int64_t layers, int64_t heads, std::optional<int64_t> kv_heads, int64_t vocab,
               std::optional<double> ffn_multiplier, int64_t multiple_of, double theta) {
  ModelArgs a;
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

const std::map<std::string, ModelArgs>& flavors() {
  static const std::map<std::string, ModelArgs> table = [] {
    std::map<std::string, ModelArgs> t;
    t["debugmodel"] = make(256, 6, 16, std::nullopt, 2048, std::nullopt, 256, 500000);
    // Same shape with grouped-query attention (4 query heads per key/value head), for tests and small runs.
    t["debugmodel_gqa"] = make(256, 6, 16, 4, 2048, std::nullopt, 256, 500000);
    // About 100M parameters with the debug vocabulary: for benchmarks (checkpoint speed) and mid-size CPU runs.
    t["100M"] = make(768, 16, 12, 4, 2048, std::nullopt, 256, 500000);
    t["8B"] = make(4096, 32, 32, 8, 128256, 1.3, 1024, 500000);
    t["70B"] = make(8192, 80, 64, 8, 128256, 1.3, 4096, 500000);
    t["405B"] = make(16384, 126, 128, 8, 128256, 1.2, 4096, 500000);
    // Llama 3.2: tied embeddings and RoPE scaling factor 32.
    ModelArgs one_b = make(2048, 16, 32, 8, 128256, 1.5, 256, 500000);
    one_b.tie_word_embeddings = true;
    one_b.rope_scaling.factor = 32.0;
    t["1B"] = one_b;
    ModelArgs three_b = make(3072, 28, 24, 8, 128256, 1.0, 256, 500000);
    three_b.tie_word_embeddings = true;
    three_b.rope_scaling.factor = 32.0;
    t["3B"] = three_b;
    return t;
  }();
  return table;
}

}  // namespace

int64_t ModelArgs::ffn_hidden_dim() const {
  if (hidden_dim) return *hidden_dim;
  int64_t hidden = static_cast<int64_t>(2.0 * (4 * dim) / 3.0);
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

void ModelArgs::check() const {
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
  if (dim % n_heads != 0) fail("model dim ", dim, " is not divisible by n_heads ", n_heads);
  if (head_dim() % 2 != 0) fail("head_dim ", head_dim(), " must be even for rotary embeddings");
  if (kv_heads() <= 0 || n_heads % kv_heads() != 0)
    fail("n_heads ", n_heads, " must be a multiple of n_kv_heads ", kv_heads());
}

std::vector<std::string> flavor_names() {
  std::vector<std::string> names;
  for (const auto& [name, args] : flavors()) names.push_back(name);
  return names;
}

ModelArgs flavor(const std::string& name) {
  auto it = flavors().find(name);
  if (it == flavors().end()) {
    std::string hint = closest_match(name, flavor_names());
    fail("unknown llama3 flavor ", quote(name), "; known flavors: ", join(flavor_names(), ", "),
         hint.empty() ? "" : cat(" (did you mean ", quote(hint), "?)"));
  }
  return it->second;
}

int64_t ParameterShape::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::vector<ParameterShape> parameter_shapes(const ModelArgs& a) {
  std::vector<ParameterShape> out;
  const int64_t d = a.dim, hd = a.head_dim(), h = a.n_heads, kv = a.kv_heads(), f = a.ffn_hidden_dim();
  out.push_back({"tok_embeddings.weight", {a.vocab_size, d}});
  for (int64_t i = 0; i < a.n_layers; ++i) {
    std::string p = "layers." + std::to_string(i) + ".";
    out.push_back({p + "attention.wq.weight", {h * hd, d}});
    out.push_back({p + "attention.wk.weight", {kv * hd, d}});
    out.push_back({p + "attention.wv.weight", {kv * hd, d}});
    out.push_back({p + "attention.wo.weight", {d, h * hd}});
    out.push_back({p + "feed_forward.w1.weight", {f, d}});
    out.push_back({p + "feed_forward.w2.weight", {d, f}});
    out.push_back({p + "feed_forward.w3.weight", {f, d}});
    out.push_back({p + "attention_norm.weight", {d}});
    out.push_back({p + "ffn_norm.weight", {d}});
  }
  out.push_back({"norm.weight", {d}});
  if (!a.tie_word_embeddings) out.push_back({"output.weight", {a.vocab_size, d}});
  return out;
}

int64_t count_parameters(const ModelArgs& args) {
  int64_t n = 0;
  for (const auto& p : parameter_shapes(args)) n += p.numel();
  return n;
}

int64_t count_embedding_parameters(const ModelArgs& args) { return args.vocab_size * args.dim; }

double flops_per_token(const ModelArgs& a, int64_t seq_len) {
  double dense = static_cast<double>(count_parameters(a) - count_embedding_parameters(a));
  if (a.tie_word_embeddings) dense += static_cast<double>(a.vocab_size * a.dim);
  double attention = 12.0 * static_cast<double>(a.n_layers) * static_cast<double>(a.n_heads) *
                     static_cast<double>(a.head_dim()) * static_cast<double>(seq_len);
  return 6.0 * dense + attention;
}

}  // namespace titan::llama3
