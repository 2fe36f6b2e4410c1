// Writing PyTorch's torch.save format: a ZIP archive (stored, ZIP64 when large) holding data.pkl -- a pickle
// (protocol 2) of a dict of tensors rebuilt through torch._utils._rebuild_tensor_v2 -- and one raw storage record
// per tensor. Python's torch.load (weights_only=True, the default) reads it.
#pragma once
#include <ATen/ATen.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace titan::checkpoint {

// Writes `tensors` (copied to the CPU, contiguous) as a torch.save file: via "<path>.partial", then renamed.
void save_torch(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors);

// Append one torch.save archive at `file`'s current position and return its size in bytes (torch DCP data files
// hold one per item): a tensor (copied to the CPU, contiguous), or a pickled Python value (`program`, a whole
// pickle). `path` names the file in errors.
uint64_t append_torch_tensor(std::FILE* file, const std::string& path, const at::Tensor& tensor);
uint64_t append_torch_object(std::FILE* file, const std::string& path, const std::string& program);

}  // namespace titan::checkpoint
