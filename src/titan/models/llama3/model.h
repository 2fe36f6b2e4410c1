// The Llama 3 transformer (Meta/torchtitan layout and parameter names), built from nn::Unit blocks.
// It knows nothing of parallelism or activation checkpointing; those wrap its units from outside.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "titan/models/llama3/args.h"
#include "titan/nn/init.h"
#include "titan/nn/unit.h"

namespace titan::llama3 {

// Complex64 (end, head_dim / 2) table of e^{i * position * frequency} with Llama 3.1 frequency scaling.
at::Tensor precompute_rope(int64_t head_dim, int64_t end, double theta, const RopeScaling& scaling);
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
  Attention(const ModelArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<nn::Linear> wq, wk, wv, wo;
  std::shared_ptr<InnerAttention> inner_attention;

 protected:
  at::Tensor forward(const Inputs& inputs, const nn::Context& context) override;

 private:
  int64_t n_heads_, n_kv_heads_, head_dim_;
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

class TransformerBlock : public nn::Unit {
 public:
  TransformerBlock(int64_t layer_id, const ModelArgs& args, const nn::ParameterOptions& options);
  std::shared_ptr<Attention> attention;
  std::shared_ptr<FeedForward> feed_forward;
  std::shared_ptr<nn::RMSNorm> attention_norm, ffn_norm;
  // The init std of the residual-output projections (wo, w2, w3): 0.02 / sqrt(2 x depth).
  double output_init_std() const { return weight_init_std_; }

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

class Transformer : public torch::nn::Module {
 public:
  // Parameters are created with `options`; without storage (options.allocate = false) parallelisms can shard the
  // model before each rank allocates and initialises only its pieces (see models/llama3/parallelize.h).
  explicit Transformer(const ModelArgs& args, const nn::ParameterOptions& options = {});

  // tokens: int64 (batch, seq) -> logits (batch, seq, vocab). positions: optional int64 (batch or 1, seq).
  // document_positions (batch, seq_len): each token's index in its document; when given, attention is
  // block-causal (model.attn_mask_type = "block_causal").
  // labels (batch, seq): the forward returns the summed cross-entropy against them (float32 scalar, ignoring
  // labels of -100) from the fused output projection and loss, and no logits exist for the whole batch.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions = {}, const at::Tensor& document_positions = {},
                     const at::Tensor& labels = {});
  // The modules [begin, end) of the forward order tok_embeddings, layers.0 .. layers.{n-1}, norm, output (indices
  // 0 .. n_layers + 2) on `input`: tokens when begin is 0, else the hidden state the module before produced. A
  // pipeline stage runs its part this way; `seq_len` is the whole sequence's length (the input may be a shard).
  // `labels`, when the range ends with the output: the loss instead of the logits, as forward().
  at::Tensor forward_modules(const at::Tensor& input, int64_t begin, int64_t end, int64_t seq_len, const at::Tensor& positions = {},
                             const at::Tensor& document_positions = {}, const at::Tensor& labels = {});
  int64_t module_count() const { return static_cast<int64_t>(layers.size()) + 3; }
  // The forward-order names: "tok_embeddings", "layers.0", ..., "norm", "output".
  std::vector<std::string> module_names() const;
  // torchtitan's initial distribution of every parameter, by name.
  std::map<std::string, nn::InitSpec> init_specs() const;
  // Initialises every parameter from `seed` (nn/init.h: the same values as any sharded initialisation with that
  // seed); parameters built without storage are allocated first.
  void init_weights(uint64_t seed = 0);

  const ModelArgs& args() const { return args_; }
  std::shared_ptr<nn::Embedding> tok_embeddings;
  std::vector<std::shared_ptr<TransformerBlock>> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<OutputProjection> output;

  // Moves parameters (and the RoPE table) to a device/dtype; the RoPE table stays complex64.
  void to_device(const at::Device& device, std::optional<at::ScalarType> dtype = std::nullopt);
  // Moves the RoPE table alone (parameters placed elsewhere, e.g. by parallelisms).
  void move_buffers(const at::Device& device) { rope_ = rope_.to(device); }

 private:
  ModelArgs args_;
  at::Tensor rope_;
};

}  // namespace titan::llama3
