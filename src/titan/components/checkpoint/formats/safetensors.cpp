#include "titan/components/checkpoint/formats/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/strings.h"

namespace titan::safetensors {
namespace {

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<std::string, at::ScalarType>> table = {
      {"F64", at::kDouble}, {"F32", at::kFloat},   {"F16", at::kHalf},  {"BF16", at::kBFloat16}, {"I64", at::kLong},
      {"I32", at::kInt},    {"I16", at::kShort},   {"I8", at::kChar},   {"U8", at::kByte},       {"BOOL", at::kBool},
      {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2}};
  return table;
}

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& [name, t] : dtype_table())
    if (t == dtype) return name;
  fail("dtype ", c10::toString(dtype), " cannot be stored in safetensors");
}

File::File(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open safetensors file ", quote(path));
  const auto file_size = std::filesystem::file_size(path);
  uint64_t header_size = 0;
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(&header_size), 8))
    fail(path, ": too short to be a safetensors file");
  if (header_size > file_size - 8) fail(path, ": header size ", header_size, " exceeds the file (", file_size, " bytes); truncated?");
  std::string header(header_size, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_size));
  data_offset_ = 8 + header_size;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": header is not valid JSON: ", e.what());
  }
  const uint64_t data_size = file_size - data_offset_;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.items()) metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
      continue;
    }
    TensorInfo info;
    try {
      std::string dtype = entry.at("dtype").get<std::string>();
      auto it = std::find_if(dtype_table().begin(), dtype_table().end(), [&](const auto& p) { return p.first == dtype; });
      if (it == dtype_table().end()) fail(path, ": tensor ", quote(name), " has unsupported dtype ", quote(dtype));
      info.dtype = it->second;
      info.shape = entry.at("shape").get<std::vector<int64_t>>();
      auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2) fail(path, ": tensor ", quote(name), " needs two data_offsets");
      info.begin = offsets[0];
      info.end = offsets[1];
    } catch (const nlohmann::json::exception& e) {
      fail(path, ": malformed entry for tensor ", quote(name), ": ", e.what());
    }
    uint64_t numel = 1;
    for (auto d : info.shape) {
      if (d < 0 || (d > 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(d)))
        fail(path, ": tensor ", quote(name), " has an invalid shape entry ", d);
      numel *= static_cast<uint64_t>(d);
    }
    if (info.end < info.begin || info.end > data_size || info.end - info.begin != numel * c10::elementSize(info.dtype))
      fail(path, ": tensor ", quote(name), " byte range [", info.begin, ", ", info.end, ") does not match its shape or the file size; "
           "the file is truncated or corrupt");
    tensors_[name] = info;
  }
}

at::Tensor File::load(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, ": no tensor named ", quote(name));
  const TensorInfo& info = it->second;
  at::Tensor t = at::empty(info.shape, at::TensorOptions().dtype(info.dtype));
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_offset_ + info.begin));
  if (!in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(info.end - info.begin)))
    fail(path_, ": could not read tensor ", quote(name), "; the file is truncated");
  return t;
}

at::Tensor File::load_rows(const std::string& name, int64_t begin, int64_t count) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, ": no tensor named ", quote(name));
  const TensorInfo& info = it->second;
  if (info.shape.empty() || begin < 0 || count < 0 || begin + count > info.shape[0])
    fail(path_, ": rows ", begin, "..", begin + count, " of tensor ", quote(name), " are out of range");
  std::vector<int64_t> shape = info.shape;
  shape[0] = count;
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(info.dtype));
  const uint64_t row_bytes = info.shape[0] ? (info.end - info.begin) / static_cast<uint64_t>(info.shape[0]) : 0;
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_offset_ + info.begin + static_cast<uint64_t>(begin) * row_bytes));
  if (!in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(static_cast<uint64_t>(count) * row_bytes)))
    fail(path_, ": could not read tensor ", quote(name), "; the file is truncated");
  return t;
}

void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> cpu;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    cpu.push_back(t);
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // align the data section
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write ", quote(tmp));
    uint64_t size = text.size();
    out.write(reinterpret_cast<const char*>(&size), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : cpu) out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
    out.close();
    if (!out) {
      const int error = errno;
      std::filesystem::remove(tmp);
      fail("cannot write ", quote(path), describe_write_error(error));
    }
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace titan::safetensors
