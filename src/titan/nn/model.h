// What every model family's module is to the generic machinery (trainer, pipeline stages, initialisation): a
// torch::nn::Module whose forward is an ordered list of top-level modules that a pipeline stage can run a
// contiguous part of.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "titan/nn/init.h"

namespace titan::nn {

class Model : public torch::nn::Module {
 public:
  // The modules [begin, end) of the forward order (module_names()) on `input`: tokens when begin is 0, else the hidden
  // state the module before produced. `seq_len` is the whole sequence's length (the input may be a shard of it).
  // positions: optional int64 (batch or 1, seq) RoPE positions; document_positions (batch, seq): each token's index
  // in its document (block-causal attention when given; under context parallelism those of the whole sequence, of
  // which the input holds this rank's chunks); labels (batch, seq): when the range ends with the output,
  // the summed cross-entropy (float32 scalar, labels of -100 ignored) instead of the logits.
  virtual at::Tensor forward_modules(const at::Tensor& input, int64_t begin, int64_t end, int64_t seq_len,
                                     const at::Tensor& positions = {}, const at::Tensor& document_positions = {},
                                     const at::Tensor& labels = {}) = 0;
  // The whole forward order: tokens (batch, seq) -> logits (batch, seq, vocab), or the summed loss given labels.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions = {}, const at::Tensor& document_positions = {},
                     const at::Tensor& labels = {}) {
    return forward_modules(tokens, 0, module_count(), tokens.size(1), positions, document_positions, labels);
  }
  // The forward order's module names ("tok_embeddings", "layers.0", ..., "norm", "output" for the decoders).
  virtual std::vector<std::string> module_names() const = 0;
  virtual int64_t module_count() const = 0;
  // Which module of the forward order a parameter (by its name) belongs to.
  virtual int64_t module_of(const std::string& parameter_name) const = 0;
  // The family's initial distribution of every parameter, by name.
  virtual std::map<std::string, InitSpec> init_specs() const = 0;
  // Moves what the model holds besides parameters (RoPE tables) to `device`.
  virtual void move_buffers(const at::Device& device) = 0;
  // The longest sequence the model's position tables cover.
  virtual int64_t max_seq_len() const = 0;

  // Initialises every parameter from `seed` (nn/init.h: the same values as any sharded initialisation with that
  // seed); parameters built without storage are allocated first.
  void init_weights(uint64_t seed = 0);
};

}  // namespace titan::nn
