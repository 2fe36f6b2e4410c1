#include "titan/models/common/decoder.h"

#include <cmath>
#include <limits>
#include <map>
#include <torch/nn/modules/container/modulelist.h>

#include "titan/nn/loss.h"
#include "titan/distributed/loss_parallel.h"
#include "titan/kernels/fused_ops.h"
#include "titan/models/common/moe.h"
#include "titan/nn/kept_ops.h"
#include "titan/nn/matmul.h"

namespace titan::models {

namespace {

// theta^(-2i / head_dim) for each rotary pair i, float32.
at::Tensor rope_frequencies(int64_t head_dim, double theta) {
  at::Tensor exponents = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / static_cast<double>(head_dim);
  return 1.0 / at::pow(theta, exponents);
}

// e^{i * position * frequency} for positions 0 .. end-1.
at::Tensor rotation_table(const at::Tensor& freqs, int64_t end) {
  at::Tensor angles = at::outer(at::arange(end, at::TensorOptions().dtype(at::kFloat)), freqs);
  return at::polar(at::ones_like(angles), angles);
}

}  // namespace

at::Tensor precompute_rope(int64_t head_dim, int64_t end, double theta, const RopeScaling& scaling) {
  at::Tensor freqs = rope_frequencies(head_dim, theta);
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
  return rotation_table(freqs, end);
}

at::Tensor precompute_yarn_rope(int64_t head_dim, int64_t end, double theta, const YarnScaling& yarn) {
  return precompute_yarn_rope(head_dim, end, theta, yarn, end > yarn.original_seq_len);
}

at::Tensor precompute_yarn_rope(int64_t head_dim, int64_t end, double theta, const YarnScaling& yarn, bool active) {
  at::Tensor freqs = rope_frequencies(head_dim, theta);
  if (active) {
    // The pair index at which a frequency turns `turns` times over the original context, and the ramp between the
    // beta_fast and beta_slow indices: kept below it, divided by `factor` above.
    const double d = static_cast<double>(head_dim), base = theta, original = static_cast<double>(yarn.original_seq_len);
    auto pair_index = [&](double turns) { return d * std::log(original / (turns * 2 * M_PI)) / (2 * std::log(base)); };
    const double low = std::max(std::floor(pair_index(yarn.beta_fast)), 0.0);
    double high = std::min(std::ceil(pair_index(yarn.beta_slow)), d - 1);
    if (low == high) high += 0.001;
    at::Tensor ramp = at::clamp((at::arange(head_dim / 2, at::TensorOptions().dtype(at::kFloat)) - low) / (high - low), 0, 1);
    at::Tensor kept = 1 - ramp;
    freqs = freqs / yarn.factor * (1 - kept) + freqs * kept;
  }
  return rotation_table(freqs, end);
}

at::Tensor precompute_rope(const DecoderArgs& args, int64_t end) {
  if (end < 0) end = args.max_seq_len;
  if (args.yarn) return precompute_yarn_rope(args.rope_dim(), end, args.rope_theta, *args.yarn, args.yarn_active());
  return precompute_rope(args.rope_dim(), end, args.rope_theta, args.rope_scaling);
}

Attention::Attention(const DecoderArgs& args, const nn::ParameterOptions& options)
    : n_heads_(args.n_heads), n_kv_heads_(args.kv_heads()), head_dim_(args.head_dim()), rope_layout_(args.rope_layout) {
  wq = register_module("wq", std::make_shared<nn::Linear>(args.dim, n_heads_ * head_dim_, options));
  wk = register_module("wk", std::make_shared<nn::Linear>(args.dim, n_kv_heads_ * head_dim_, options));
  wv = register_module("wv", std::make_shared<nn::Linear>(args.dim, n_kv_heads_ * head_dim_, options));
  wo = register_module("wo", std::make_shared<nn::Linear>(n_heads_ * head_dim_, args.dim, options));
  if (args.qk_norm) {
    q_norm = register_module("q_norm", std::make_shared<nn::RMSNorm>(head_dim_, args.norm_eps, options));
    k_norm = register_module("k_norm", std::make_shared<nn::RMSNorm>(head_dim_, args.norm_eps, options));
  }
  inner_attention = register_module("inner_attention", std::make_shared<InnerAttention>());
}

namespace {

// (..., head_dim) in the half-split layout [x0 .. x_{h/2-1}, y0 .. y_{h/2-1}] -> interleaved [x0, y0, x1, y1, ...].
at::Tensor halves_to_pairs(const at::Tensor& t) {
  auto shape = t.sizes().vec();
  const int64_t hd = shape.back();
  shape.back() = 2;
  shape.push_back(hd / 2);
  return t.reshape(shape).transpose(-1, -2).reshape(t.sizes());
}

at::Tensor pairs_to_halves(const at::Tensor& t) {
  auto shape = t.sizes().vec();
  const int64_t hd = shape.back();
  shape.back() = hd / 2;
  shape.push_back(2);
  return t.reshape(shape).transpose(-1, -2).reshape(t.sizes());
}

}  // namespace

at::Tensor InnerAttention::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor &q = inputs[0], &k = inputs[1], &v = inputs[2];
  const bool masked = context.attn_mask.defined();
  TORCH_CHECK(masked || !context.documents.defined(), "internal: block-causal documents over ", context.documents.size(1),
              " positions reached attention of ", q.size(2), " without context parallelism");
  if (kernels::fused_kernel_applies(kernels::Op::attention, {q, k, v}) && (!masked || context.documents.defined())) {
    const at::Tensor documents = masked ? context.documents : at::Tensor();
    // Op-level selective checkpointing keeps the kernel's output; LibTorch's attention below is recomputed.
    if (context.kept_ops) return context.kept_ops->attention(q, k, v, documents);
    return kernels::attention(q, k, v, documents);
  }
  return at::scaled_dot_product_attention(q, k, v, masked ? std::optional<at::Tensor>(context.attn_mask) : std::nullopt,
                                          /*dropout_p=*/0.0, /*is_causal=*/!masked,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != k.size(1));
}

at::Tensor Attention::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  const auto bs = x.size(0), seqlen = x.size(1);
  at::Tensor q = (*wq)(x, context).view({bs, seqlen, -1, head_dim_});
  at::Tensor k = (*wk)(x, context).view({bs, seqlen, -1, head_dim_});
  at::Tensor v = (*wv)(x, context).view({bs, seqlen, -1, head_dim_});
  if (q_norm) {
    q = (*q_norm)(q, context);
    k = (*k_norm)(k, context);
  }
  // The rotation is applied in the interleaved layout; half-split heads are viewed as interleaved pairs and back.
  const bool half_split = rope_layout_ == RopeLayout::half_split;
  if (half_split) {
    q = halves_to_pairs(q);
    k = halves_to_pairs(k);
  }
  if (kernels::fused_kernel_applies(kernels::Op::rope, {q, k})) {
    std::tie(q, k) = kernels::rope(q, k, context.rope, context.positions);
  } else {
    q = kernels::rope_reference(q, context.rope, context.positions);
    k = kernels::rope_reference(k, context.rope, context.positions);
  }
  if (half_split) {
    q = pairs_to_halves(q);
    k = pairs_to_halves(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  // Heads come from the projections' widths, so a tensor-parallel rank sees its own heads only.
  at::Tensor out = inner_attention->call({q, k, v}, context);
  out = out.transpose(1, 2).contiguous().view({bs, seqlen, -1});
  return (*wo)(out, context);
}

LatentAttention::LatentAttention(const DecoderArgs& args, const nn::ParameterOptions& options)
    : mla_(*args.mla), query_scale_(args.attention_scale_factor()) {
  const int64_t h = args.n_heads, qk = mla_.qk_head_dim();
  if (mla_.q_lora_rank == 0) {
    wq = register_module("wq", std::make_shared<nn::Linear>(args.dim, h * qk, options));
  } else {
    wq_a = register_module("wq_a", std::make_shared<nn::Linear>(args.dim, mla_.q_lora_rank, options));
    q_norm = register_module("q_norm", std::make_shared<nn::RMSNorm>(mla_.q_lora_rank, mla_.norm_eps.value_or(args.norm_eps), options));
    wq_b = register_module("wq_b", std::make_shared<nn::Linear>(mla_.q_lora_rank, h * qk, options));
  }
  wkv_a = register_module("wkv_a", std::make_shared<nn::Linear>(args.dim, mla_.kv_lora_rank + mla_.qk_rope_head_dim, options));
  kv_norm = register_module("kv_norm", std::make_shared<nn::RMSNorm>(mla_.kv_lora_rank, mla_.norm_eps.value_or(args.norm_eps), options));
  wkv_b = register_module("wkv_b", std::make_shared<nn::Linear>(mla_.kv_lora_rank, h * (mla_.qk_nope_head_dim + mla_.v_head_dim), options));
  wo = register_module("wo", std::make_shared<nn::Linear>(h * mla_.v_head_dim, args.dim, options));
  inner_attention = register_module("inner_attention", std::make_shared<InnerAttention>());
}

std::vector<nn::Linear*> LatentAttention::linears() const {
  std::vector<nn::Linear*> out;
  for (const auto& l : {wq, wq_a, wq_b, wkv_a, wkv_b, wo})
    if (l) out.push_back(l.get());
  return out;
}

std::pair<at::Tensor, at::Tensor> LatentAttention::project(const at::Tensor& x, const nn::Context& context) const {
  const at::Tensor q = wq ? (*wq)(x, context) : (*wq_b)((*q_norm)((*wq_a)(x, context), context), context);
  return {q.view({x.size(0), x.size(1), -1, mla_.qk_head_dim()}), (*wkv_a)(x, context)};
}

at::Tensor LatentAttention::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  const auto bs = x.size(0), seqlen = x.size(1);
  const int64_t nope = mla_.qk_nope_head_dim, rope = mla_.qk_rope_head_dim, vd = mla_.v_head_dim;
  auto [q, kv] = project(x, context);
  const int64_t heads = q.size(2);
  at::Tensor latent = kv.narrow(-1, 0, mla_.kv_lora_rank);
  at::Tensor k_rope = kv.narrow(-1, mla_.kv_lora_rank, rope).unsqueeze(2);  // one rotary key for every head
  at::Tensor q_rope = kernels::rope_reference(q.narrow(-1, nope, rope), context.rope, context.positions);
  k_rope = kernels::rope_reference(k_rope, context.rope, context.positions);
  at::Tensor expanded = (*wkv_b)((*kv_norm)(latent, context), context).view({bs, seqlen, heads, nope + vd});
  at::Tensor k = at::cat({expanded.narrow(-1, 0, nope), k_rope.expand({bs, seqlen, heads, rope})}, -1);
  q = at::cat({q.narrow(-1, 0, nope), q_rope}, -1);
  // softmax(scale q.k) with scale = factor / sqrt(qk width): the factor goes into the queries.
  if (query_scale_ != 1.0) q = q * query_scale_;
  at::Tensor v = expanded.narrow(-1, nope, vd);
  if (vd < nope + rope) v = at::constant_pad_nd(v, {0, nope + rope - vd});
  at::Tensor out = inner_attention->call({q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)}, context);
  out = out.narrow(-1, 0, vd).transpose(1, 2).contiguous().view({bs, seqlen, -1});
  return (*wo)(out, context);
}

at::Tensor LatentAttention::forward_cached(const at::Tensor& x, const nn::Context& context, at::Tensor& cache, int64_t start,
                                           int64_t capacity, const at::Tensor& mask) {
  const auto bs = x.size(0), count = x.size(1), end = start + count;
  const int64_t nope = mla_.qk_nope_head_dim, rope = mla_.qk_rope_head_dim, vd = mla_.v_head_dim, r = mla_.kv_lora_rank;
  const auto [q, kv] = project(x, context);
  const int64_t heads = q.size(2);
  const at::ScalarType dtype = q.scalar_type();
  const at::Tensor latent = (*kv_norm)(kv.narrow(-1, 0, r), context).to(dtype);
  const at::Tensor k_rope =
      kernels::rope_reference(kv.narrow(-1, r, rope).unsqueeze(2), context.rope, context.positions).squeeze(2).to(dtype);
  const at::Tensor q_rope = kernels::rope_reference(q.narrow(-1, nope, rope), context.rope, context.positions);
  TORCH_CHECK(end <= capacity, "internal: the latent cache holds ", capacity, " positions, ", end, " asked for");
  if (!cache.defined()) cache = at::zeros({bs, capacity, r + rope}, latent.options());
  cache.narrow(1, start, count).narrow(-1, 0, r).copy_(latent);
  cache.narrow(1, start, count).narrow(-1, r, rope).copy_(k_rope);
  // wkv_b's rows, head by head: qk_nope_head_dim key rows, then v_head_dim value rows, each reading the latent. A
  // key is k_h = W_kh c, so q_h . k_h = (W_kh^T q_h) . c; a head's output is W_vh (sum_s p_s c_s).
  const at::Tensor w = wkv_b->weight.to(dtype).view({heads, nope + vd, r});
  // Head by head (one product per head over every token of the batch): (heads, bs x count, r).
  const at::Tensor q_latent = at::bmm(q.narrow(-1, 0, nope).permute({2, 0, 1, 3}).reshape({heads, bs * count, nope}), w.narrow(1, 0, nope));
  // The softmax scale of the expanded form, 1 / sqrt(qk width), with YaRN's factor.
  const at::Tensor query = at::cat({q_latent.view({heads, bs, count, r}).transpose(0, 1), q_rope.transpose(1, 2)}, -1) *
                           (query_scale_ / std::sqrt(static_cast<double>(nope + rope)));
  // Every head reads the same cached rows: (heads x tokens) query rows against the positions, one product per row
  // of the batch, the cache read in place.
  const at::Tensor keys = cache.narrow(1, 0, end);
  at::Tensor scores = at::bmm(query.reshape({bs, heads * count, r + rope}), keys.transpose(1, 2)).view({bs, heads, count, end});
  scores = at::softmax(scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity()), -1, at::kFloat).to(dtype);
  at::Tensor out = at::bmm(scores.view({bs, heads * count, end}), keys.narrow(-1, 0, r)).view({bs, heads, count, r});
  out = at::bmm(out.permute({1, 0, 2, 3}).reshape({heads, bs * count, r}), w.narrow(1, nope, vd).transpose(1, 2));  // (heads, bs x count, vd)
  return (*wo)(out.view({heads, bs, count, vd}).permute({1, 2, 0, 3}).reshape({bs, count, heads * vd}), context);
}

FeedForward::FeedForward(int64_t dim, int64_t hidden_dim, const nn::ParameterOptions& options) {
  w1 = register_module("w1", std::make_shared<nn::Linear>(dim, hidden_dim, options));
  w2 = register_module("w2", std::make_shared<nn::Linear>(hidden_dim, dim, options));
  w3 = register_module("w3", std::make_shared<nn::Linear>(dim, hidden_dim, options));
  gate = register_module("gate", std::make_shared<nn::SwiGLU>());
}

at::Tensor FeedForward::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  return (*w2)(gate->call({(*w1)(x, context), (*w3)(x, context)}, context), context);
}

TransformerBlock::TransformerBlock(int64_t layer_id, const DecoderArgs& args, const nn::ParameterOptions& options) {
  if (args.mla)
    latent_attention = register_module("attention", std::make_shared<LatentAttention>(args, options));
  else
    attention = register_module("attention", std::make_shared<Attention>(args, options));
  if (args.is_moe_layer(layer_id))
    moe = register_module("moe", std::make_shared<MoE>(args.dim, *args.moe, options));
  else
    feed_forward = register_module("feed_forward", std::make_shared<FeedForward>(args.dim, args.ffn_hidden_dim(), options));
  attention_norm = register_module("attention_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  ffn_norm = register_module("ffn_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  const double depth = args.depth_init ? static_cast<double>(layer_id + 1) : static_cast<double>(args.n_layers);
  weight_init_std_ = 0.02 / std::sqrt(2.0 * depth);
}

InnerAttention& TransformerBlock::inner_attention() const {
  return latent_attention ? *latent_attention->inner_attention : *attention->inner_attention;
}

std::vector<nn::Linear*> TransformerBlock::attention_linears() const {
  if (latent_attention) return latent_attention->linears();
  return {attention->wq.get(), attention->wk.get(), attention->wv.get(), attention->wo.get()};
}

at::Tensor TransformerBlock::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  const at::Tensor normed_x = (*attention_norm)(x, context);
  at::Tensor h = x + (latent_attention ? (*latent_attention)(normed_x, context) : (*attention)(normed_x, context));
  const at::Tensor normed = (*ffn_norm)(h, context);
  return h + (feed_forward ? (*feed_forward)(normed, context) : (*moe)(normed, context));
}

OutputProjection::OutputProjection(int64_t dim, int64_t vocab_size, at::Tensor* tied_weight, const nn::ParameterOptions& options)
    : tied_(tied_weight) {
  if (!tied_) own_weight_ = register_parameter("weight", nn::new_parameter({vocab_size, dim}, options));
}

at::Tensor OutputProjection::forward(const Inputs& inputs, const nn::Context& context) {
  if (context.labels.defined())
    return distributed::linear_cross_entropy_sum(inputs[0], weight(), context.labels, 0, nullptr, kIgnoreIndex);
  return nn::linear(inputs[0], weight());
}

Decoder::Decoder(const DecoderArgs& args, const nn::ParameterOptions& options) : args_(args) {
  args_.check();
  tok_embeddings = register_module("tok_embeddings", std::make_shared<nn::Embedding>(args.vocab_size, args.dim, options));
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args.n_layers; ++i) {
    layers.push_back(std::make_shared<TransformerBlock>(i, args, options));
    list->push_back(layers.back());
  }
  norm = register_module("norm", std::make_shared<nn::RMSNorm>(args.dim, args.final_norm_dtype_eps ? -1.0 : args.norm_eps, options));
  output = register_module("output", std::make_shared<OutputProjection>(
                                         args.dim, args.vocab_size, args.tie_word_embeddings ? &tok_embeddings->weight : nullptr,
                                         options));
  rope_ = precompute_rope(args);
}

void Decoder::extend_positions(int64_t length) {
  if (length <= rope_.size(0)) return;
  rope_ = precompute_rope(args_, length).to(rope_.device());
}

void Decoder::move_buffers(const at::Device& device) {
  rope_ = rope_.to(device);
  for (auto& block : layers)
    if (block->moe) block->moe->move_buffers(device);
}

std::map<std::string, nn::InitSpec> Decoder::init_specs() const {
  using nn::InitSpec;
  std::map<std::string, InitSpec> out;
  // The output projection's init; with tied embeddings it is the embedding too, which keeps initial logits at
  // unit scale instead of sqrt(dim).
  const double output_std = 1.0 / std::sqrt(static_cast<double>(args_.dim));
  const InitSpec output_init = InitSpec::truncated_normal(0.0, output_std, -3 * output_std, 3 * output_std);
  out.emplace("tok_embeddings.weight", args_.tie_word_embeddings ? output_init : InitSpec::normal(0.0, 1.0));
  const InitSpec input_init = InitSpec::truncated_normal(0.0, 0.02, -2.0, 2.0);
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    const double std = layers[i]->output_init_std();
    const InitSpec residual_init = InitSpec::truncated_normal(0.0, std, -2.0, 2.0);
    if (args_.mla) {
      // torchtitan's DeepSeek-V3: every input projection at 0.02, the output at the block's residual std.
      std::vector<std::string> inputs = {"wkv_a", "wkv_b"};
      if (args_.mla->q_lora_rank == 0) inputs.push_back("wq");
      else inputs.insert(inputs.end(), {"wq_a", "wq_b"});
      for (const auto& w : inputs) out.emplace(p + "attention." + w + ".weight", input_init);
      if (args_.mla->q_lora_rank > 0) out.emplace(p + "attention.q_norm.weight", InitSpec::ones());
      out.emplace(p + "attention.kv_norm.weight", InitSpec::ones());
      out.emplace(p + "attention.wo.weight", residual_init);
    } else {
      out.emplace(p + "attention.wq.weight", input_init);
      out.emplace(p + "attention.wk.weight", input_init);
      out.emplace(p + "attention.wv.weight", input_init);
      out.emplace(p + "attention.wo.weight", residual_init);
    }
    if (args_.qk_norm) {
      out.emplace(p + "attention.q_norm.weight", InitSpec::ones());
      out.emplace(p + "attention.k_norm.weight", InitSpec::ones());
    }
    if (layers[i]->moe) {
      // torchtitan's MoE init: the router and w2/w3 at the block's residual std, w1 at 0.02.
      out.emplace(p + "moe.router.gate.weight", residual_init);
      out.emplace(p + "moe.experts.w1", input_init);
      out.emplace(p + "moe.experts.w2", residual_init);
      out.emplace(p + "moe.experts.w3", residual_init);
      if (args_.moe->num_shared_experts > 0) {
        out.emplace(p + "moe.shared_experts.w1.weight", input_init);
        out.emplace(p + "moe.shared_experts.w2.weight", residual_init);
        out.emplace(p + "moe.shared_experts.w3.weight", residual_init);
      }
    } else {
      out.emplace(p + "feed_forward.w1.weight", input_init);
      out.emplace(p + "feed_forward.w2.weight", residual_init);
      out.emplace(p + "feed_forward.w3.weight", residual_init);
    }
    out.emplace(p + "attention_norm.weight", InitSpec::ones());
    out.emplace(p + "ffn_norm.weight", InitSpec::ones());
  }
  out.emplace("norm.weight", InitSpec::ones());
  if (!args_.tie_word_embeddings) out.emplace("output.weight", output_init);
  return out;
}

at::Tensor document_ids(const at::Tensor& document_positions) {
  // A document starts where its position is 0.
  return at::cumsum(document_positions.eq(0).to(at::kInt), 1, at::kInt);
}

at::Tensor block_causal_mask(const at::Tensor& document_positions) {
  // Tokens see earlier tokens of their own document only.
  at::Tensor doc = document_ids(document_positions);
  const int64_t s = document_positions.size(1);
  at::Tensor same = doc.unsqueeze(2).eq(doc.unsqueeze(1));
  at::Tensor causal = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(doc.device())).tril();
  return same.logical_and(causal).unsqueeze(1);
}

std::vector<std::string> Decoder::module_names() const {
  std::vector<std::string> out = {"tok_embeddings"};
  for (size_t i = 0; i < layers.size(); ++i) out.push_back("layers." + std::to_string(i));
  out.push_back("norm");
  out.push_back("output");
  return out;
}

int64_t Decoder::module_of(const std::string& name) const {
  const int64_t n = static_cast<int64_t>(layers.size());
  auto starts = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  if (starts("tok_embeddings.")) return 0;
  if (starts("layers.")) return std::stoll(name.substr(7, name.find('.', 7) - 7)) + 1;
  if (starts("norm.")) return n + 1;
  if (starts("output.")) return n + 2;
  TORCH_CHECK(false, "internal: parameter ", name, " belongs to no module of the decoder's forward order");
}

at::Tensor Decoder::forward_modules(const at::Tensor& input, int64_t begin, int64_t end, int64_t seq_len,
                                        const at::Tensor& positions, const at::Tensor& document_positions,
                                        const at::Tensor& labels) {
  TORCH_CHECK(0 <= begin && begin < end && end <= module_count(), "module range [", begin, ", ", end, ") outside 0..", module_count());
  nn::Context context;
  context.positions = positions;
  if (document_positions.defined()) {
    context.documents = document_ids(document_positions);
    // Under context parallelism the positions cover the whole sequence, of which this rank holds chunks: its
    // attention masks chunk pair by chunk pair, and no whole-sequence mask is built. (The input's length says
    // nothing: a later pipeline stage's input under tensor parallelism is a sequence shard too.)
    if (!chunked_attention) context.attn_mask = block_causal_mask(document_positions);
  }
  TORCH_CHECK(seq_len <= rope_.size(0), "sequence length ", seq_len, " exceeds the model's max_seq_len ", rope_.size(0));
  context.rope = rope_;
  const int64_t n = static_cast<int64_t>(layers.size());
  at::Tensor h = input;
  for (int64_t i = begin; i < end; ++i) {
    if (i == 0) h = (*tok_embeddings)(h, context);
    else if (i <= n) h = (*layers[static_cast<size_t>(i - 1)])(h, context);
    else if (i == n + 1) h = (*norm)(h, context);
    else {
      context.labels = labels;
      h = (*output)(h, context);
    }
  }
  return h;
}

}  // namespace titan::models
