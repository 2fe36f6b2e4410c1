#include "titan/models/llama3/model.h"

#include <cmath>
#include <torch/nn/modules/container/modulelist.h>

namespace titan::llama3 {

at::Tensor precompute_rope(int64_t head_dim, int64_t end, double theta, const RopeScaling& scaling) {
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor exponents = at::arange(0, head_dim, 2, f32.dtype(at::kLong)).to(at::kFloat) / static_cast<double>(head_dim);
  at::Tensor freqs = 1.0 / at::pow(theta, exponents);
  if (scaling.enabled) {
    // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    const double low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor;
    const double high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / freqs;
    at::Tensor scaled = at::where(wavelen > low_wavelen, freqs / scaling.factor, freqs);
    at::Tensor smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) /
                        (scaling.high_freq_factor - scaling.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    freqs = at::where(medium, smoothed, scaled);
  }
  at::Tensor positions = at::arange(end, f32);
  at::Tensor angles = at::outer(positions, freqs);
  return at::polar(at::ones_like(angles), angles);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& rope, const at::Tensor& positions) {
  const auto b = x.size(0), s = x.size(1), h = x.size(2), d = x.size(3);
  at::Tensor xc = at::view_as_complex(x.to(at::kFloat).reshape({b, s, h, d / 2, 2}));
  at::Tensor table;
  if (!positions.defined()) {
    table = rope.narrow(0, 0, s).view({1, s, 1, d / 2});
  } else {
    table = rope.index_select(0, positions.reshape({-1})).view({positions.size(0), s, 1, d / 2});
  }
  return at::view_as_real(xc * table).flatten(3).to(x.scalar_type());
}

Attention::Attention(const ModelArgs& args)
    : n_heads_(args.n_heads), n_kv_heads_(args.kv_heads()), head_dim_(args.head_dim()) {
  wq = register_module("wq", std::make_shared<nn::Linear>(args.dim, n_heads_ * head_dim_));
  wk = register_module("wk", std::make_shared<nn::Linear>(args.dim, n_kv_heads_ * head_dim_));
  wv = register_module("wv", std::make_shared<nn::Linear>(args.dim, n_kv_heads_ * head_dim_));
  wo = register_module("wo", std::make_shared<nn::Linear>(n_heads_ * head_dim_, args.dim));
}

void Attention::init_weights(double output_std) {
  for (auto* l : {&wq, &wk, &wv}) nn::trunc_normal_((*l)->weight, 0.0, 0.02, -2.0, 2.0);
  nn::trunc_normal_(wo->weight, 0.0, output_std, -2.0, 2.0);
}

at::Tensor Attention::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  const auto bs = x.size(0), seqlen = x.size(1);
  at::Tensor q = (*wq)(x, context).view({bs, seqlen, -1, head_dim_});
  at::Tensor k = (*wk)(x, context).view({bs, seqlen, -1, head_dim_});
  at::Tensor v = (*wv)(x, context).view({bs, seqlen, -1, head_dim_});
  q = apply_rope(q, context.rope, context.positions).transpose(1, 2);
  k = apply_rope(k, context.rope, context.positions).transpose(1, 2);
  v = v.transpose(1, 2);
  const bool masked = context.attn_mask.defined();
  at::Tensor out = at::scaled_dot_product_attention(q, k, v, masked ? std::optional<at::Tensor>(context.attn_mask) : std::nullopt,
                                                    /*dropout_p=*/0.0, /*is_causal=*/!masked,
                                                    /*scale=*/std::nullopt, /*enable_gqa=*/n_heads_ != n_kv_heads_);
  out = out.transpose(1, 2).contiguous().view({bs, seqlen, -1});
  return (*wo)(out, context);
}

FeedForward::FeedForward(int64_t dim, int64_t hidden_dim) {
  w1 = register_module("w1", std::make_shared<nn::Linear>(dim, hidden_dim));
  w2 = register_module("w2", std::make_shared<nn::Linear>(hidden_dim, dim));
  w3 = register_module("w3", std::make_shared<nn::Linear>(dim, hidden_dim));
  gate = register_module("gate", std::make_shared<nn::SwiGLU>());
}

void FeedForward::init_weights(double output_std) {
  nn::trunc_normal_(w1->weight, 0.0, 0.02, -2.0, 2.0);
  nn::trunc_normal_(w2->weight, 0.0, output_std, -2.0, 2.0);
  nn::trunc_normal_(w3->weight, 0.0, output_std, -2.0, 2.0);
}

at::Tensor FeedForward::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  return (*w2)(gate->call({(*w1)(x, context), (*w3)(x, context)}, context), context);
}

TransformerBlock::TransformerBlock(int64_t layer_id, const ModelArgs& args) {
  attention = register_module("attention", std::make_shared<Attention>(args));
  feed_forward = register_module("feed_forward", std::make_shared<FeedForward>(args.dim, args.ffn_hidden_dim()));
  attention_norm = register_module("attention_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps));
  ffn_norm = register_module("ffn_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps));
  const double depth = args.depth_init ? static_cast<double>(layer_id + 1) : static_cast<double>(args.n_layers);
  weight_init_std_ = 0.02 / std::sqrt(2.0 * depth);
}

void TransformerBlock::init_weights() {
  attention_norm->reset_parameters();
  ffn_norm->reset_parameters();
  attention->init_weights(weight_init_std_);
  feed_forward->init_weights(weight_init_std_);
}

at::Tensor TransformerBlock::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  at::Tensor h = x + (*attention)((*attention_norm)(x, context), context);
  return h + (*feed_forward)((*ffn_norm)(h, context), context);
}

OutputProjection::OutputProjection(int64_t dim, int64_t vocab_size, at::Tensor* tied_weight)
    : tied_(tied_weight) {
  if (!tied_) own_weight_ = register_parameter("weight", at::empty({vocab_size, dim}));
}

at::Tensor OutputProjection::forward(const Inputs& inputs, const nn::Context&) {
  return at::linear(inputs[0], tied_ ? *tied_ : own_weight_);
}

Transformer::Transformer(const ModelArgs& args) : args_(args) {
  args_.check();
  tok_embeddings = register_module("tok_embeddings", std::make_shared<nn::Embedding>(args.vocab_size, args.dim));
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args.n_layers; ++i) {
    layers.push_back(std::make_shared<TransformerBlock>(i, args));
    list->push_back(layers.back());
  }
  norm = register_module("norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps));
  output = register_module("output", std::make_shared<OutputProjection>(
                                         args.dim, args.vocab_size, args.tie_word_embeddings ? &tok_embeddings->weight : nullptr));
  rope_ = precompute_rope(args.head_dim(), args.max_seq_len, args.rope_theta, args.rope_scaling);
}

void Transformer::init_weights() {
  at::NoGradGuard no_grad;
  tok_embeddings->weight.normal_(0.0, 1.0);
  for (auto& layer : layers) layer->init_weights();
  norm->reset_parameters();
  // The output projection's init; with tied embeddings it is the embedding too, which keeps initial logits at
  // unit scale instead of sqrt(dim).
  const double std = 1.0 / std::sqrt(static_cast<double>(args_.dim));
  nn::trunc_normal_(output->weight(), 0.0, std, -3 * std, 3 * std);
}

void Transformer::to_device(const at::Device& device, std::optional<at::ScalarType> dtype) {
  if (dtype) to(device, *dtype);
  else to(device);
  rope_ = rope_.to(device);
}

at::Tensor block_causal_mask(const at::Tensor& document_positions) {
  // A document starts where its position is 0; tokens see earlier tokens of their own document only.
  at::Tensor doc = at::cumsum(document_positions.eq(0).to(at::kInt), 1);
  const int64_t s = document_positions.size(1);
  at::Tensor same = doc.unsqueeze(2).eq(doc.unsqueeze(1));
  at::Tensor causal = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(doc.device())).tril();
  return same.logical_and(causal).unsqueeze(1);
}

at::Tensor Transformer::forward(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& document_positions) {
  nn::Context context;
  context.positions = positions;
  if (document_positions.defined()) context.attn_mask = block_causal_mask(document_positions);
  const int64_t seqlen = tokens.size(1);
  TORCH_CHECK(seqlen <= rope_.size(0), "sequence length ", seqlen, " exceeds the model's max_seq_len ", rope_.size(0));
  context.rope = rope_;
  at::Tensor h = (*tok_embeddings)(tokens, context);
  for (auto& layer : layers) h = (*layer)(h, context);
  h = (*norm)(h, context);
  return (*output)(h, context);
}

}  // namespace titan::llama3
