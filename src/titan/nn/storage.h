// Parameters whose storage comes and goes: a tensor keeps its shape, dtype, device and identity (the model's
// parameter object, its autograd hooks) while its memory is released or allocated. Models are built without
// storage so that parallelisms can shard them before any rank allocates more than its own pieces; FSDP releases
// gathered parameters between uses.
#pragma once
#include <ATen/ATen.h>

namespace titan::nn {

// How units create their parameters: `tensor` gives device and dtype; without `allocate` they have a shape and no
// memory until allocate_storage (or a parallelism) gives them some.
struct ParameterOptions {
  at::TensorOptions tensor = {};
  bool allocate = true;
};

// A tensor of `shape` with `options` whose storage holds no bytes.
at::Tensor without_storage(at::IntArrayRef shape, const at::TensorOptions& options);
at::Tensor new_parameter(at::IntArrayRef shape, const ParameterOptions& options);
// True when the tensor's storage holds all of its elements.
bool has_storage(const at::Tensor& t);
// Gives `t` fresh (uninitialised) storage of its own size, or releases it; `t` stays the same tensor object.
void allocate_storage(const at::Tensor& t);
void free_storage(const at::Tensor& t);

}  // namespace titan::nn
