#include "titan/components/checkpoint/formats/gguf.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/strings.h"

namespace titan::gguf {
namespace {

constexpr uint64_t kAlignment = 32;
// GGUF's metadata value types.
constexpr uint32_t kUint32 = 4, kInt32 = 5, kFloat32 = 6, kBool = 7, kString = 8, kArray = 9;

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

uint64_t padded(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

TensorType parse_tensor_type(const std::string& name, const std::string& where) {
  if (name == "f32") return TensorType::f32;
  if (name == "f16") return TensorType::f16;
  if (name == "bf16") return TensorType::bf16;
  if (name == "q8_0") return TensorType::q8_0;
  fail(where, " ", quote(name), ": expected f32, f16, bf16 or q8_0");
}

const char* tensor_type_name(TensorType type) {
  switch (type) {
    case TensorType::f32: return "F32";
    case TensorType::f16: return "F16";
    case TensorType::bf16: return "BF16";
    case TensorType::q8_0: return "Q8_0";
  }
  return "?";
}

std::string quantize_q8_0(const float* values, int64_t count) {
  TORCH_CHECK(count % 32 == 0, "internal: Q8_0 needs a multiple of 32 values, got ", count);
  std::string out;
  out.reserve(static_cast<size_t>(count / 32 * 34));
  for (int64_t b = 0; b < count; b += 32) {
    float largest = 0;
    for (int64_t i = 0; i < 32; ++i) largest = std::max(largest, std::fabs(values[b + i]));
    const float scale = largest / 127.0f;
    const float inverse = scale != 0 ? 1.0f / scale : 0.0f;
    const c10::Half stored(scale);
    put<uint16_t>(out, stored.x);
    for (int64_t i = 0; i < 32; ++i) put<int8_t>(out, static_cast<int8_t>(std::lround(values[b + i] * inverse)));
  }
  return out;
}

void Writer::key(const std::string& name, uint32_t type) {
  put_string(metadata_, name);
  put<uint32_t>(metadata_, type);
  ++metadata_count_;
}

void Writer::add_uint32(const std::string& name, uint32_t value) {
  key(name, kUint32);
  put<uint32_t>(metadata_, value);
}

void Writer::add_float32(const std::string& name, float value) {
  key(name, kFloat32);
  put<float>(metadata_, value);
}

void Writer::add_bool(const std::string& name, bool value) {
  key(name, kBool);
  put<uint8_t>(metadata_, value ? 1 : 0);
}

void Writer::add_string(const std::string& name, const std::string& value) {
  key(name, kString);
  put_string(metadata_, value);
}

void Writer::add_strings(const std::string& name, const std::vector<std::string>& values) {
  key(name, kArray);
  put<uint32_t>(metadata_, kString);
  put<uint64_t>(metadata_, values.size());
  for (const auto& v : values) put_string(metadata_, v);
}

void Writer::add_int32s(const std::string& name, const std::vector<int32_t>& values) {
  key(name, kArray);
  put<uint32_t>(metadata_, kInt32);
  put<uint64_t>(metadata_, values.size());
  for (int32_t v : values) put<int32_t>(metadata_, v);
}

void Writer::add_tensor(const std::string& name, const at::Tensor& tensor, TensorType type) {
  Tensor t{name, {}, type, {}};
  for (int64_t d = tensor.dim() - 1; d >= 0; --d) t.dims.push_back(tensor.size(d));
  at::Tensor values;
  switch (type) {
    case TensorType::f32: values = tensor.to(at::kFloat).contiguous(); break;
    case TensorType::f16: values = tensor.to(at::kHalf).contiguous(); break;
    case TensorType::bf16: values = tensor.to(at::kBFloat16).contiguous(); break;
    case TensorType::q8_0: {
      TORCH_CHECK(tensor.size(-1) % 32 == 0, "internal: ", name, " cannot be Q8_0 (rows of ", tensor.size(-1), ")");
      const at::Tensor f = tensor.to(at::kFloat).contiguous();
      t.data = quantize_q8_0(f.data_ptr<float>(), f.numel());
      break;
    }
  }
  if (values.defined()) t.data.assign(static_cast<const char*>(values.data_ptr()), values.nbytes());
  tensors_.push_back(std::move(t));
}

void Writer::write(const std::string& path) const {
  namespace fs = std::filesystem;
  if (fs::exists(path)) fail("--to ", quote(path), " exists; choose a new file name so nothing is overwritten");
  std::string head;
  head += "GGUF";
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors_.size());
  put<uint64_t>(head, metadata_count_);
  head += metadata_;
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    put_string(head, t.name);
    put<uint32_t>(head, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) put<uint64_t>(head, static_cast<uint64_t>(d));
    put<uint32_t>(head, static_cast<uint32_t>(t.type));
    put<uint64_t>(head, offset);
    offset = padded(offset + t.data.size());
  }
  head.resize(padded(head.size()), '\0');
  const std::string partial = path + ".partial";
  std::FILE* out = std::fopen(partial.c_str(), "wb");
  if (!out) fail("cannot write ", quote(partial), describe_write_error(errno));
  auto put_bytes = [&](const char* data, size_t size) {
    if (size && std::fwrite(data, 1, size, out) != size) {
      const int error = errno;
      std::fclose(out);
      fs::remove(partial);
      fail("cannot write ", quote(partial), describe_write_error(error));
    }
  };
  put_bytes(head.data(), head.size());
  const std::string zeros(kAlignment, '\0');
  for (const auto& t : tensors_) {
    put_bytes(t.data.data(), t.data.size());
    put_bytes(zeros.data(), padded(t.data.size()) - t.data.size());
  }
  if (std::fflush(out) != 0 || ::fsync(fileno(out)) != 0) {
    const int error = errno;
    std::fclose(out);
    fs::remove(partial);
    fail("cannot write ", quote(partial), describe_write_error(error));
  }
  std::fclose(out);
  fs::rename(partial, path);
  fsync_path(fs::absolute(path).parent_path().string(), true);
}

}  // namespace titan::gguf
