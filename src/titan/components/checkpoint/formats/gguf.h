// Writing GGUF (version 3), llama.cpp's model file: a header, typed key-value metadata, tensor descriptions and
// 32-byte aligned tensor data, little-endian. Tensors are stored as F32, F16, BF16 or Q8_0 (blocks of 32 values:
// a float16 scale max|x| / 127 and 32 signed bytes round(x / scale)).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace titan::gguf {

enum class TensorType : uint32_t { f32 = 0, f16 = 1, q8_0 = 8, bf16 = 30 };

// The type named "f32", "f16", "bf16" or "q8_0"; UserError naming `where` otherwise.
TensorType parse_tensor_type(const std::string& name, const std::string& where);
const char* tensor_type_name(TensorType type);

// Q8_0 blocks of `values` (a multiple of 32): 34 bytes per 32 values.
std::string quantize_q8_0(const float* values, int64_t count);

class Writer {
 public:
  void add_uint32(const std::string& key, uint32_t value);
  void add_float32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string(const std::string& key, const std::string& value);
  void add_strings(const std::string& key, const std::vector<std::string>& values);
  void add_int32s(const std::string& key, const std::vector<int32_t>& values);
  // `tensor` in PyTorch's (rows, columns) order; GGUF records the dimensions innermost first. Q8_0 needs the last
  // dimension to be a multiple of 32.
  void add_tensor(const std::string& name, const at::Tensor& tensor, TensorType type);
  // Writes `path` through "<path>.partial", fsynced and renamed; refuses to overwrite.
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;  // innermost first
    TensorType type;
    std::string data;
  };
  void key(const std::string& name, uint32_t type);
  std::string metadata_;
  uint64_t metadata_count_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace titan::gguf
