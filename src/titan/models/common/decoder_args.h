// The arguments of the dense decoder-only transformer that Llama 3 and Qwen3 share (models/common/decoder.h), and
// the figures derived from shapes alone: parameter shapes and counts, training FLOPs per token. Each family's
// flavors fill them (models/<family>/args.h).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "titan/models/common/moe_args.h"
#include "titan/protocols/model_args.h"

namespace titan::models {

using protocols::ParameterShape;

struct RopeScaling {
  bool enabled = true;  // Llama 3.1-style frequency scaling
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// How each head's rotary pairs are laid out in q and k: (x0, x1), (x2, x3), ... (Meta's Llama) or the first
// halves of all pairs, then the second halves (Hugging Face, and torchtitan's Qwen3).
enum class RopeLayout { interleaved, half_split };

struct DecoderArgs : protocols::ModelArgs {
  std::string family_name = "llama3";
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  std::optional<int64_t> n_kv_heads;
  std::optional<int64_t> head_dim_value;  // when given outright (Qwen3); else dim / n_heads
  int64_t vocab_size = 128256;
  int64_t multiple_of = 256;
  std::optional<double> ffn_dim_multiplier;
  std::optional<int64_t> hidden_dim;  // the feed-forward width when given outright (an HF config's intermediate_size)
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  RopeScaling rope_scaling;
  RopeLayout rope_layout = RopeLayout::interleaved;
  bool qk_norm = false;              // RMSNorm over each query and key head before RoPE (Qwen3)
  int64_t max_seq_len = 131072;
  bool depth_init = true;            // residual-output init std scales with the block's depth
  bool tie_word_embeddings = false;  // the output projection reads the embedding's table
  // torchtitan's counting for the family: Llama 3's formula counts a tied output projection as a matmul and every
  // parameter; the MoE-family formula Qwen3 uses counts neither the tied output's FLOPs nor, when tied, the embedding.
  bool counts_tied_output = true;
  // Set: every block's feed-forward is a Mixture of Experts (models/common/moe.h) instead of the dense SwiGLU.
  std::optional<MoEArgs> moe;

  int64_t kv_heads() const { return n_kv_heads.value_or(n_heads); }
  int64_t head_dim() const { return head_dim_value.value_or(n_heads > 0 ? dim / n_heads : 0); }
  // hidden_dim when set; else int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded up to a multiple of multiple_of.
  int64_t ffn_hidden_dim() const;
  // Throws UserError when the dimensions do not fit together (heads dividing dim, GQA grouping, ...).
  void check() const;

  std::string family() const override { return family_name; }
  std::vector<ParameterShape> parameter_shapes() const override;
  // Block `layer`'s parameters alone ("layers.<layer>.*"): every block has the same ones (the plan's and the memory
  // estimate's per-block sums, without building the whole model's list).
  std::vector<ParameterShape> layer_parameter_shapes(int64_t layer) const;
  std::vector<ParameterShape> buffer_shapes() const override;  // layers.N.moe.expert_bias with MoE balancing
  std::vector<std::pair<std::string, std::string>> tied_aliases() const override {
    if (!tie_word_embeddings) return {};
    return {{"output.weight", "tok_embeddings.weight"}};
  }
  int64_t reported_parameters() const override;
  int64_t embedding_parameters() const override { return vocab_size * dim; }
  // 6 x (parameters - embedding) + 12 x layers x heads x head_dim x seq_len (torchtitan's formula); with MoE blocks
  // the parameters are the active ones: every dense one, the routers, the shared experts, and the routed experts'
  // times top_k / num_experts (torchtitan's get_moe_model_nparams_and_flops).
  double flops_per_token(int64_t seq_len) const override;
  int64_t vocabulary() const override { return vocab_size; }
  int64_t context_length() const override { return max_seq_len; }
  int64_t layers() const override { return n_layers; }
  nlohmann::json to_json() const override;
  std::shared_ptr<const protocols::ModelArgs> parse_json(const nlohmann::json& j, const std::string& where) const override;
  std::vector<std::string> computation_differences(const protocols::ModelArgs& other) const override;
  std::shared_ptr<const protocols::ModelArgs> with_context_length(int64_t length) const override;
};

// A family's named flavors: their names, and the one called `name` (UserError naming the family, the known flavors
// and the closest one otherwise).
std::vector<std::string> flavor_names(const std::map<std::string, DecoderArgs>& table);
DecoderArgs find_flavor(const std::map<std::string, DecoderArgs>& table, const std::string& family, const std::string& name);

// The decoder arguments behind `args`; throws UserError naming the family when it is another kind of model.
const DecoderArgs& as_decoder(const protocols::ModelArgs& args, const std::string& what);

// Arguments from checkpoint-metadata JSON (to_json); `where` names the source in errors; `family` is used when the
// JSON names none (checkpoints written before families were recorded are Llama 3).
DecoderArgs decoder_args_from_json(const nlohmann::json& j, const std::string& where, const std::string& family);

}  // namespace titan::models
