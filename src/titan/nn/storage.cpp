#include "titan/nn/storage.h"

#include <c10/core/CPUAllocator.h>

namespace titan::nn {

at::Tensor without_storage(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options.requires_grad(false));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

at::Tensor new_parameter(at::IntArrayRef shape, const ParameterOptions& options) {
  return options.allocate ? at::empty(shape, options.tensor) : without_storage(shape, options.tensor);
}

bool has_storage(const at::Tensor& t) {
  return t.storage().nbytes() >= static_cast<size_t>(t.numel()) * t.element_size() + t.storage_offset() * t.element_size();
}

void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == nbytes) return;
  c10::Allocator* allocator = s->allocator() ? s->allocator() : c10::GetAllocator(s->device_type());
  s->set_data_ptr_noswap(allocator->allocate(nbytes));
  s->set_nbytes(nbytes);
}

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

}  // namespace titan::nn
