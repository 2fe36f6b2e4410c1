#include "titan/nn/model.h"

#include "titan/nn/storage.h"

namespace titan::nn {

void Model::init_weights(uint64_t seed) {
  at::NoGradGuard no_grad;
  const auto specs = init_specs();
  for (auto& item : named_parameters()) {
    at::Tensor p = item.value();
    allocate_storage(p);
    fill(p, specs.at(item.key()), seed, item.key());
  }
}

}  // namespace titan::nn
