// The decoder-only transformer of Llama 3 and Qwen3 (torchtitan's layouts and parameter names), built from nn::Unit
// blocks: Qwen3 adds per-head RMSNorms on queries and keys, an explicit head_dim and the half-split rotary layout,
// and its MoE flavors a Mixture-of-Experts feed-forward in every block (models/common/moe.h). It knows nothing of parallelism or activation checkpointing; those wrap its units from outside.
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "titan/models/common/decoder_args.h"
#include "titan/nn/init.h"
#include "titan/nn/model.h"
#include "titan/nn/unit.h"

namespace titan::models {

// Complex64 (end, head_dim / 2) table of e^{i * position * frequency} with Llama 3.1 frequency scaling.
at::Tensor precompute_rope(int64_t head_dim, int64_t end, double theta, const RopeScaling& scaling);
// The same with YaRN's frequencies when `end` exceeds yarn.original_seq_len (DeepSeek-V3), plain ones otherwise.
at::Tensor precompute_yarn_rope(int64_t head_dim, int64_t end, double theta, const YarnScaling& yarn);
// The same with the choice of YaRN's frequencies given (`active`) rather than taken from `end`.
at::Tensor precompute_yarn_rope(int64_t head_dim, int64_t end, double theta, const YarnScaling& yarn, bool active);
// The model's table: rope_dim() columns pairs, max_seq_len rows (`end` rows when given), with the scaling its
// arguments name; YaRN's frequencies are chosen by max_seq_len whatever `end` is.
at::Tensor precompute_rope(const DecoderArgs& args, int64_t end = -1);
// The table rotates interleaved (even, odd) pairs of q and k's last dimension: kernels::rope, or
// kernels::rope_reference where the fused kernel does not apply.

// The attention core (torchtitan's inner_attention): softmax(q k^T / sqrt(d)) v over (batch, heads, seq, head_dim)
// inputs {q, k, v} (k and v may have fewer heads, GQA), causal, or block-causal with the context's attn_mask. A unit
// of its own so that wrappers can replace it (context parallelism).
class InnerAttention : public nn::Unit {
 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;
};

class Attention : public nn::Unit {
 public:
  Attention(const DecoderArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<nn::Linear> wq, wk, wv, wo;
  std::shared_ptr<nn::RMSNorm> q_norm, k_norm;  // with args.qk_norm: over each head's head_dim, before RoPE
  std::shared_ptr<InnerAttention> inner_attention;

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;

 private:
  int64_t n_heads_, n_kv_heads_, head_dim_;
  RopeLayout rope_layout_;
};

// Multi-head latent attention (DeepSeek-V3, torchtitan's parameter names): see LatentAttentionArgs. The rotary
// parts are rotated in the interleaved layout; the attention core sees queries/keys of qk_nope_head_dim +
// qk_rope_head_dim and values zero-padded to that width (its output's padding is dropped), so the fused kernel and
// the context-parallel wrapper apply unchanged; YaRN's softmax scale is folded into the queries.
class LatentAttention : public nn::Unit {
 public:
  LatentAttention(const DecoderArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<nn::Linear> wq, wq_a, wq_b, wkv_a, wkv_b, wo;  // wq without q_lora_rank, wq_a/wq_b with it
  std::shared_ptr<nn::RMSNorm> q_norm, kv_norm;                  // q_norm with q_lora_rank
  std::shared_ptr<InnerAttention> inner_attention;
  std::vector<nn::Linear*> linears() const;

  // Cached sampling (models/common/kv_cache.h), the same function as forward(): this call's normed latents and rotated
  // shared keys are written to `cache` ((batch, capacity, kv_lora_rank + qk_rope_head_dim), made at the first call)
  // at positions [start, start + tokens), and the queries attend to positions [0, start + tokens) where `mask`
  // ((batch, 1, tokens, start + tokens)) allows, in the absorbed form: each head's query is taken into the latent
  // space through wkv_b's key rows, and the attention's output out of it through its value rows. The cache holds
  // kv_lora_rank + qk_rope_head_dim values per position instead of every head's keys and values, and every head
  // reads the same cached rows.
  at::Tensor forward_cached(const at::Tensor& x, const nn::Context& context, at::Tensor& cache, int64_t start, int64_t capacity,
                            const at::Tensor& mask);

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;

 private:
  // What forward() and forward_cached() share: the queries, (batch, tokens, heads, qk head width), with the heads
  // taken from the projection's width (a tensor-parallel rank sees its own), and wkv_a's output (latent, rotary key).
  std::pair<at::Tensor, at::Tensor> project(const at::Tensor& x, const nn::Context& context) const;

  LatentAttentionArgs mla_;
  double query_scale_;
};

class FeedForward : public nn::Unit {
 public:
  FeedForward(int64_t dim, int64_t hidden_dim, const nn::ParameterOptions& options);
  std::shared_ptr<nn::Linear> w1, w2, w3;
  std::shared_ptr<nn::SwiGLU> gate;

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;
};

// The block-causal mask for document positions (batch, seq_len): bool (batch, 1, seq_len, seq_len).
at::Tensor block_causal_mask(const at::Tensor& document_positions);
// Each position's document index, int32 (batch, seq_len), from the positions within documents.
at::Tensor document_ids(const at::Tensor& document_positions);

class MoE;  // models/common/moe.h

class TransformerBlock : public nn::Unit {
 public:
  TransformerBlock(int64_t layer_id, const DecoderArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<Attention> attention;                 // grouped-query attention, or null with latent attention
  std::shared_ptr<LatentAttention> latent_attention;    // with args.mla (registered as "attention")
  std::shared_ptr<FeedForward> feed_forward;  // the dense feed-forward, or null in a Mixture-of-Experts block
  std::shared_ptr<MoE> moe;                   // with args.moe: the Mixture-of-Experts feed-forward instead
  std::shared_ptr<nn::RMSNorm> attention_norm, ffn_norm;
  // The init std of the residual-output projections (wo, w2, w3): 0.02 / sqrt(2 x depth).
  double output_init_std() const { return weight_init_std_; }
  // The attention's core (either kind), and its projections.
  InnerAttention& inner_attention() const;
  std::vector<nn::Linear*> attention_linears() const;

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;

 private:
  double weight_init_std_;
};

// The output projection; with tied embeddings it reads the embedding's weight and owns no parameter.
class OutputProjection : public nn::Unit {
 public:
  OutputProjection(int64_t dim, int64_t vocab_size, at::Tensor* tied_weight, const nn::ParameterOptions& options);
  at::Tensor& weight() { return tied_ ? *tied_ : own_weight_; }
  bool tied() const { return tied_ != nullptr; }

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;

 private:
  at::Tensor own_weight_;
  at::Tensor* tied_;
};

class Decoder : public nn::Model {
 public:
  // Parameters are created with `options`; without storage (options.allocate = false) parallelisms can shard the
  // model before each rank allocates and initialises only its pieces (see models/common/decoder_parallelize.h).
  explicit Decoder(const DecoderArgs& args, const nn::ParameterOptions& options = {});

  // The forward order is tok_embeddings, layers.0 .. layers.{n-1}, norm, output (indices 0 .. n_layers + 2).
  at::Tensor forward_modules(const at::Tensor& input, int64_t begin, int64_t end, int64_t seq_len, const at::Tensor& positions = {},
                             const at::Tensor& document_positions = {}, const at::Tensor& labels = {}) override;
  int64_t module_count() const override { return static_cast<int64_t>(layers.size()) + 3; }
  std::vector<std::string> module_names() const override;
  int64_t module_of(const std::string& parameter_name) const override;
  // torchtitan's initial distribution of every parameter, by name.
  std::map<std::string, nn::InitSpec> init_specs() const override;
  void move_buffers(const at::Device& device) override;
  // Lengthens the position table to `length` rows (for sampling past the trained context): the frequencies, YaRN's
  // choice and the attention scale stay those of max_seq_len, so the first max_seq_len positions are unchanged.
  void extend_positions(int64_t length);
  int64_t max_seq_len() const override { return args_.max_seq_len; }

  const DecoderArgs& args() const { return args_; }
  std::shared_ptr<nn::Embedding> tok_embeddings;
  std::vector<std::shared_ptr<TransformerBlock>> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<OutputProjection> output;
  // Set by context parallelism (decoder_parallelize.cpp): attention sees this rank's chunks of every sequence and
  // masks block-causal documents chunk pair by chunk pair, so no whole-sequence mask is built. Otherwise attention
  // sees whole sequences (tensor parallelism gathers a pipeline stage's sequence shards first), and the mask is built.
  bool chunked_attention = false;

 private:
  DecoderArgs args_;
  at::Tensor rope_;
};

}  // namespace titan::models
