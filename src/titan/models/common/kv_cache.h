// KvCache: the keys and values of every block's attention kept between forwards, so that sampling runs each new
// token through the model once (titan generate). It wraps each block's attention core (InnerAttention) and replaces
// its computation: the new keys and values are written at their positions, and the queries attend to every cached
// position up to their own, skipping the left padding of shorter prompts. Latent attention (DeepSeek-V3) is wrapped
// whole instead and keeps each position's latent and shared rotary key (LatentAttention::forward_cached).
#pragma once
#include <ATen/ATen.h>

#include <memory>

#include "titan/models/common/decoder.h"

namespace titan::models {

class KvCache {
 public:
  // Installs the cache on `model`'s blocks (for the model's lifetime: build a model for sampling). `padding` is
  // int64 (batch): how many positions each row's prompt is left-padded by; `capacity` the positions to keep.
  KvCache(Decoder& model, const at::Tensor& padding, int64_t capacity);
  // The positions the next forward's tokens take: [start, start + count) of the cache.
  void advance_to(int64_t start);
  // Each row's RoPE positions for tokens [start, start + count): the cache index less the row's padding.
  at::Tensor positions(int64_t start, int64_t count) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace titan::models
