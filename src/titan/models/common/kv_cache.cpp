#include "titan/models/common/kv_cache.h"

#include <vector>

#include "titan/common/error.h"

namespace titan::models {

struct KvCache::State {
  int64_t start = 0, capacity = 0;
  at::Tensor padding;                     // int64 (batch)
  std::vector<at::Tensor> keys, values;   // per block: (batch, kv heads, capacity, head width), made at first use
  // Latent attention's blocks instead: (batch, capacity, kv_lora_rank + qk_rope_head_dim).
  std::vector<at::Tensor> latents;
};

namespace {

// Query i (cache index start + i) sees keys j <= start + i that are not padding; a padding query sees itself, so
// that no row of the softmax is empty (its output is never read). Shape (batch, 1, count, start + count).
at::Tensor attention_mask(const KvCache::State& s, int64_t batch, int64_t count, const at::Device& device) {
  const int64_t end = s.start + count;
  const auto index_options = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor key_index = at::arange(end, index_options).view({1, 1, 1, end});
  const at::Tensor query_index = at::arange(s.start, end, index_options).view({1, 1, count, 1});
  const at::Tensor not_padding = key_index >= s.padding.to(device).view({batch, 1, 1, 1});
  return (key_index <= query_index).logical_and(not_padding).logical_or(key_index == query_index);
}

at::Tensor attend(KvCache::State& s, size_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t batch = q.size(0), count = q.size(2), end = s.start + count;
  TORCH_CHECK(end <= s.capacity, "internal: the KV cache holds ", s.capacity, " positions, ", end, " asked for");
  if (!s.keys[layer].defined()) {
    s.keys[layer] = at::zeros({batch, k.size(1), s.capacity, k.size(3)}, k.options());
    s.values[layer] = at::zeros({batch, v.size(1), s.capacity, v.size(3)}, v.options());
  }
  s.keys[layer].narrow(2, s.start, count).copy_(k);
  s.values[layer].narrow(2, s.start, count).copy_(v);
  const at::Tensor keys = s.keys[layer].narrow(2, 0, end), values = s.values[layer].narrow(2, 0, end);
  const at::Tensor mask = attention_mask(s, batch, count, q.device());
  return at::scaled_dot_product_attention(q, keys, values, mask, /*dropout_p=*/0.0, /*is_causal=*/false,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != keys.size(1));
}

}  // namespace

KvCache::KvCache(Decoder& model, const at::Tensor& padding, int64_t capacity) : state_(std::make_shared<State>()) {
  state_->capacity = capacity;
  state_->padding = padding.to(at::kLong);
  state_->keys.resize(model.layers.size());
  state_->values.resize(model.layers.size());
  state_->latents.resize(model.layers.size());
  for (size_t i = 0; i < model.layers.size(); ++i) {
    std::shared_ptr<State> state = state_;
    if (auto& latent = model.layers[i]->latent_attention) {
      // Latent attention keeps its latent, not the keys and values it expands to (LatentAttention::forward_cached).
      LatentAttention* unit = latent.get();
      unit->add_innermost_wrapper("kv_cache", [state, i, unit](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                               const nn::Unit::Next&) {
        const at::Tensor& x = inputs[0];
        return unit->forward_cached(x, context, state->latents[i], state->start, state->capacity,
                                    attention_mask(*state, x.size(0), x.size(1), x.device()));
      });
      continue;
    }
    model.layers[i]->inner_attention().add_innermost_wrapper(
        "kv_cache", [state, i](const nn::Unit::Inputs& inputs, const nn::Context&, const nn::Unit::Next&) {
          return attend(*state, i, inputs[0], inputs[1], inputs[2]);
        });
  }
}

void KvCache::advance_to(int64_t start) { state_->start = start; }

at::Tensor KvCache::positions(int64_t start, int64_t count) const {
  // On the padding's device (the model's): a host index beside a GPU padding tensor would not subtract.
  const at::Tensor index = at::arange(start, start + count, state_->padding.options()).view({1, count});
  return at::clamp_min(index - state_->padding.view({-1, 1}), 0);
}

}  // namespace titan::models
