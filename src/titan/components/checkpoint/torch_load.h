// Reading torch.save files (ZIP + pickle) that hold a dict of tensors, such as Meta's original consolidated.00.pth
// Llama checkpoints: a small ZIP reader (stored entries, ZIP64) and a pickle interpreter for the opcodes torch.save
// emits, without Python. Anything else in the pickle is refused with a clear error.
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <string>

namespace titan::checkpoint {

// Every tensor of the file's top-level dict (CPU, contiguous copies, stored dtype). Non-tensor values are skipped.
std::map<std::string, at::Tensor> load_torch(const std::string& path);

}  // namespace titan::checkpoint
