// Llama 3 model arguments, the named flavors (torchtitan's dimensions plus Llama 3.2 1B/3B), and the figures
// derived from shapes alone: parameter counts and training FLOPs per token.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::llama3 {

struct RopeScaling {
  bool enabled = true;  // Llama 3.1-style frequency scaling
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelArgs {
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  std::optional<int64_t> n_kv_heads;
  int64_t vocab_size = 128256;
  int64_t multiple_of = 256;
  std::optional<double> ffn_dim_multiplier;
  std::optional<int64_t> hidden_dim;  // the feed-forward width when given outright (an HF config's intermediate_size)
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  RopeScaling rope_scaling;
  int64_t max_seq_len = 131072;
  bool depth_init = true;            // residual-output init std scales with the block's depth
  bool tie_word_embeddings = false;  // Llama 3.2 1B/3B share the embedding with the output projection

  int64_t kv_heads() const { return n_kv_heads.value_or(n_heads); }
  int64_t head_dim() const { return dim / n_heads; }
  // hidden_dim when set; else int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded up to a multiple of multiple_of.
  int64_t ffn_hidden_dim() const;
  // Throws UserError when the dimensions do not fit together (heads dividing dim, GQA grouping, ...).
  void check() const;
};

std::vector<std::string> flavor_names();
// Throws UserError naming the known flavors when `name` is not one of them.
ModelArgs flavor(const std::string& name);

struct ParameterShape {
  std::string name;  // torchtitan FQN, e.g. "layers.0.attention.wq.weight"
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// Every parameter of the model in registration order, from the arguments alone (nothing is allocated).
std::vector<ParameterShape> parameter_shapes(const ModelArgs& args);
int64_t count_parameters(const ModelArgs& args);
int64_t count_embedding_parameters(const ModelArgs& args);

// Training FLOPs per token (forward + backward): 6 x (parameters - embedding) + 12 x layers x heads x head_dim x
// seq_len, torchtitan's formula. A tied output projection is still counted as a matmul.
double flops_per_token(const ModelArgs& args, int64_t seq_len);

}  // namespace titan::llama3
