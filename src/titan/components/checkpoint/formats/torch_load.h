// Reading torch.save archives (ZIP + pickle) without Python: files that hold a dict of tensors, such as Meta's
// original consolidated.00.pth Llama checkpoints, and the single tensors and small Python objects that torch
// DCP's data files hold, one archive per item. A small ZIP reader (stored entries, ZIP64, every record's CRC-32
// checked) and the general pickle reader (pickle.h); unknown objects are refused with a clear error.
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <string>

#include "titan/components/checkpoint/formats/pickle.h"

namespace titan::checkpoint {

// Every tensor of the file's top-level dict (CPU, contiguous copies, stored dtype). Non-tensor values are skipped.
// A dict without tensors of its own that holds exactly one dict of tensors under a string key (torch.save({"model":
// model.state_dict(), "step": 10})) is read one level down, and `unwrapped` (when given) is set to that key; two
// or more such dicts are refused by name, since which one is the model cannot be told.
std::map<std::string, at::Tensor> load_torch(const std::string& path, std::string* unwrapped = nullptr);

// The torch.save archive in bytes [offset, offset + length) of `path`: a tensor (a contiguous CPU copy) or any
// pickled object, as a value tree.
at::Tensor load_torch_tensor(const std::string& path, uint64_t offset, uint64_t length);
pickle::Ptr load_torch_object(const std::string& path, uint64_t offset, uint64_t length);

}  // namespace titan::checkpoint
