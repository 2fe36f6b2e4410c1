// ShardedParameter: one model parameter as the optimizer, gradient clipping and checkpoints see it after the
// parallelisms were applied: its global name, the tensor this rank updates, and where that tensor lies in the
// global parameter (a TensorLayout). The list of them is what the trainer works on, whatever the layout.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/placement.h"
#include "titan/nn/init.h"

namespace titan::distributed {

struct ShardedParameter {
  std::string name;         // global name, e.g. "layers.3.attention.wq.weight"
  at::Tensor module_param;  // the model's parameter (TP-local shape; FSDP frees its storage between uses)
  at::Tensor local;         // what the optimizer updates: the module parameter, or FSDP's padded shard of it
  TensorLayout layout;      // how `local` lies in the global tensor

  // `local` without padding: exactly the elements of layout.local_box().
  at::Tensor piece() const;
};

// `padded` (shaped layout.padded_local_shape(), or the box itself) narrowed to the box's lengths.
at::Tensor unpadded(const at::Tensor& padded, const TensorLayout& layout);

// Every parameter of `model`, whole and unsharded (the starting point of the parallelisms), in parameter order.
std::vector<ShardedParameter> describe_parameters(torch::nn::Module& model);
// The entry whose module parameter is `param` (the same tensor object), or null.
ShardedParameter* find_parameter(std::vector<ShardedParameter>& params, const at::Tensor& param);
// The tensors the optimizer updates, in order.
std::vector<at::Tensor> local_tensors(const std::vector<ShardedParameter>& params);

// Gives parameters built without storage (nn/storage.h) their memory (values undefined; see initialize).
void materialize(std::vector<ShardedParameter>& params);
// Fills every rank's pieces from `seed` (nn/init.h) and zeroes padding: the global weights depend on the seed only,
// not on the layout. `specs` maps each name to its distribution.
void initialize(std::vector<ShardedParameter>& params, const std::map<std::string, nn::InitSpec>& specs, uint64_t seed);

// Collective over `world` (every rank of the job must call it): each parameter's full value, in `dtype`, on every
// rank. For tools and tests; it moves the whole model through every rank.
std::vector<std::pair<std::string, at::Tensor>> gather_full(const std::vector<ShardedParameter>& params, Communicator& world,
                                                            at::ScalarType dtype = at::kFloat);

// Bytes this rank holds for the parameters (local tensors, padding included).
int64_t local_parameter_bytes(const std::vector<ShardedParameter>& params);

}  // namespace titan::distributed
