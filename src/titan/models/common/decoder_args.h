// The arguments of the dense decoder-only transformer that Llama 3 and Qwen3 share (models/common/decoder.h), and
// the figures derived from shapes alone: parameter shapes and counts, training FLOPs per token. Each family's
// flavors fill them (models/<family>/args.h).
#pragma once
#include <algorithm>
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

// YaRN context extension (DeepSeek-V3's RoPE, as torchtitan computes it): active when max_seq_len exceeds
// original_seq_len. Frequencies whose wavelength fits fewer than beta_slow turns in the original context are divided
// by `factor`, those with more than beta_fast turns kept, the band between ramped linearly; the softmax scale is
// multiplied by (0.1 mscale ln(factor) + 1)^2.
struct YarnScaling {
  int64_t original_seq_len = 4096;
  double factor = 40;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 1.0;
};

// Multi-head latent attention (DeepSeek-V2/V3): queries through wq, or through a low-rank wq_a, an RMSNorm and wq_b
// (q_lora_rank > 0); keys and values from one down-projection wkv_a to kv_lora_rank (normed, then expanded per head
// by wkv_b into qk_nope_head_dim key and v_head_dim value columns) plus a qk_rope_head_dim rotary key that every
// head shares. Each head's query and key are qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim.
struct LatentAttentionArgs {
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  // The epsilon of q_norm and kv_norm when it is not norm_eps (transformers' DeepseekV3 fixes them at 1e-6).
  std::optional<double> norm_eps;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// How each head's rotary pairs are laid out in q and k: (x0, x1), (x2, x3), ... (Meta's Llama) or the first
// halves of all pairs, then the second halves (Hugging Face, and torchtitan's Qwen3).
enum class RopeLayout { interleaved, half_split };

struct DecoderArgs : protocols::ModelArgs {
  std::string family_name = "llama3";
  std::string attn_mask = "causal";  // the flavor's mask (model.attn_mask_type's default); not part of the weights' shape
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
  // Set: every block's feed-forward is a Mixture of Experts (models/common/moe.h) instead of the dense SwiGLU,
  // except the first n_dense_layers blocks (DeepSeek-V3), which keep the dense SwiGLU of width ffn_hidden_dim().
  std::optional<MoEArgs> moe;
  int64_t n_dense_layers = 0;
  // Set: multi-head latent attention (DeepSeek-V3) instead of grouped-query attention; n_kv_heads, head_dim and
  // qk_norm do not apply.
  std::optional<LatentAttentionArgs> mla;
  std::optional<YarnScaling> yarn;  // with mla: YaRN RoPE on the rotary key/query parts
  // The final norm's epsilon is the input dtype's machine epsilon (torchtitan's DeepSeek-V3 builds it without one)
  // rather than norm_eps.
  bool final_norm_dtype_eps = false;

  int64_t kv_heads() const { return mla ? n_heads : n_kv_heads.value_or(n_heads); }
  // Each head's query/key width (with latent attention: qk_nope_head_dim + qk_rope_head_dim).
  int64_t head_dim() const {
    if (mla) return mla->qk_head_dim();
    return head_dim_value.value_or(n_heads > 0 ? dim / n_heads : 0);
  }
  int64_t value_head_dim() const { return mla ? mla->v_head_dim : head_dim(); }
  // The rotated width of each query/key head (the RoPE table's 2 x columns).
  int64_t rope_dim() const { return mla ? mla->qk_rope_head_dim : head_dim(); }
  // Whether block `layer`'s feed-forward is the Mixture of Experts.
  bool is_moe_layer(int64_t layer) const { return moe && layer >= n_dense_layers; }
  int64_t moe_layers() const { return moe ? std::max<int64_t>(n_layers - n_dense_layers, 0) : 0; }
  // The softmax scale's factor over 1/sqrt(head_dim) (YaRN's mscale squared when it is active, else 1).
  double attention_scale_factor() const;
  bool yarn_active() const { return yarn && max_seq_len > yarn->original_seq_len; }
  // hidden_dim when set; else int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded up to a multiple of multiple_of.
  int64_t ffn_hidden_dim() const;
  // Throws UserError when the dimensions do not fit together (heads dividing dim, GQA grouping, ...).
  void check() const;

  std::string family() const override { return family_name; }
  std::vector<ParameterShape> parameter_shapes() const override;
  // Block `layer`'s parameters alone ("layers.<layer>.*"): the plan's and the memory estimate's per-block sums,
  // without building the whole model's list. Blocks differ only where dense blocks precede the MoE ones.
  std::vector<ParameterShape> layer_parameter_shapes(int64_t layer) const;
  std::vector<ParameterShape> buffer_shapes() const override;  // layers.N.moe.expert_bias with MoE balancing
  std::vector<std::pair<std::string, std::string>> tied_aliases() const override {
    if (!tie_word_embeddings) return {};
    return {{"output.weight", "tok_embeddings.weight"}};
  }
  int64_t reported_parameters() const override;
  int64_t active_parameters() const override;
  int64_t embedding_parameters() const override { return vocab_size * dim; }
  // 6 x (parameters - embedding) + 12 x layers x heads x head_dim x seq_len (torchtitan's formula); with MoE blocks
  // the parameters are the active ones: every dense one, the routers, the shared experts, and the routed experts'
  // times top_k / num_experts (torchtitan's get_moe_model_nparams_and_flops).
  double flops_per_token(int64_t seq_len) const override;
  int64_t vocabulary() const override { return vocab_size; }
  int64_t context_length() const override { return max_seq_len; }
  std::string attn_mask_type() const override { return attn_mask; }
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
