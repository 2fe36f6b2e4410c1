// Reading and writing the safetensors format (8-byte little-endian header size, JSON header with dtype, shape and
// byte offsets per tensor, then raw little-endian data), as Hugging Face model files use.
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace titan::safetensors {

struct TensorInfo {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

class File {
 public:
  // Reads and validates the header (offsets inside the file, sizes matching shapes). Throws UserError.
  explicit File(const std::string& path);
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Copies one tensor into a new CPU tensor.
  at::Tensor load(const std::string& name) const;
  // Rows [begin, begin + count) of dimension 0 of one tensor (only those bytes are read).
  at::Tensor load_rows(const std::string& name, int64_t begin, int64_t count) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  uint64_t data_offset_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (any device; copied to CPU, contiguous) to `path` via a temporary file and rename.
void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata = {});

std::string dtype_name(at::ScalarType dtype);  // "F32", "BF16", ...

}  // namespace titan::safetensors
