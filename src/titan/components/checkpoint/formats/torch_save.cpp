#include "titan/components/checkpoint/formats/torch_save.h"

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/common/test_faults.h"
#include "titan/components/checkpoint/formats/pickle_writer.h"

namespace titan::checkpoint {

namespace {

constexpr uint32_t kMax32 = 0xFFFFFFFFu;

// ZIP64 records are used from 4 GiB on, or always for tests of the large-file layout (common/test_faults.h).
uint64_t zip64_threshold() {
  static const uint64_t threshold = test_faults::torch_save_force_zip64() ? 0 : kMax32;
  return threshold;
}

const char* storage_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "FloatStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kHalf: return "HalfStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kByte: return "ByteStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kBool: return "BoolStorage";
    default: fail("torch.save export: unsupported dtype ", c10::toString(t));
  }
}

// --- ZIP (stored entries) ---
struct Entry {
  std::string name;
  uint64_t offset = 0, size = 0;
  uint32_t crc = 0;
};

class ZipWriter {
 public:
  // Writes from `file`'s current position; offsets inside the archive count from there.
  ZipWriter(std::FILE* file, const std::string& path) : path_(path), file_(file) {}
  // Adds a record whose data starts on a 64-byte boundary (as torch.save aligns storages).
  void add(const std::string& name, const void* data, uint64_t size) {
    Entry e{name, position_, size, static_cast<uint32_t>(crc32_all(data, size))};
    const bool zip64 = size >= zip64_threshold() || position_ >= zip64_threshold();
    std::string extra;
    if (zip64) {
      put16(extra, 0x0001);
      put16(extra, 16);
      put64(extra, size);
      put64(extra, size);
    }
    const uint64_t header = 30 + name.size() + extra.size();
    const uint64_t pad = (64 - (position_ + header + 4) % 64) % 64;
    put16(extra, 0x4246);  // an unknown id: padding, as PyTorch's own writer does
    put16(extra, static_cast<uint16_t>(pad));
    extra.append(pad, 'Z');
    std::string h;
    put32(h, 0x04034b50);
    put16(h, zip64 ? 45 : 20);
    put16(h, 0);
    put16(h, 0);
    put16(h, 0);
    put16(h, 0x21);  // 1980-01-01
    put32(h, e.crc);
    put32(h, zip64 ? kMax32 : static_cast<uint32_t>(size));
    put32(h, zip64 ? kMax32 : static_cast<uint32_t>(size));
    put16(h, static_cast<uint16_t>(name.size()));
    put16(h, static_cast<uint16_t>(extra.size()));
    h += name;
    h += extra;
    write(h.data(), h.size());
    write(data, size);
    entries_.push_back(e);
  }
  void finish() {
    const uint64_t cd_offset = position_;
    for (const auto& e : entries_) {
      const bool zip64 = e.size >= zip64_threshold() || e.offset >= zip64_threshold();
      std::string extra;
      if (zip64) {
        put16(extra, 0x0001);
        put16(extra, 24);
        put64(extra, e.size);
        put64(extra, e.size);
        put64(extra, e.offset);
      }
      std::string h;
      put32(h, 0x02014b50);
      put16(h, zip64 ? 45 : 20);
      put16(h, zip64 ? 45 : 20);
      put16(h, 0);
      put16(h, 0);
      put16(h, 0);
      put16(h, 0x21);
      put32(h, e.crc);
      put32(h, zip64 ? kMax32 : static_cast<uint32_t>(e.size));
      put32(h, zip64 ? kMax32 : static_cast<uint32_t>(e.size));
      put16(h, static_cast<uint16_t>(e.name.size()));
      put16(h, static_cast<uint16_t>(extra.size()));
      put16(h, 0);
      put16(h, 0);
      put16(h, 0);
      put32(h, 0);
      put32(h, zip64 ? kMax32 : static_cast<uint32_t>(e.offset));
      h += e.name;
      h += extra;
      write(h.data(), h.size());
    }
    const uint64_t cd_size = position_ - cd_offset;
    const bool zip64 = cd_offset >= zip64_threshold() || cd_size >= zip64_threshold() || entries_.size() >= 0xFFFF;
    std::string end;
    if (zip64) {
      const uint64_t record = position_;
      put32(end, 0x06064b50);
      put64(end, 44);
      put16(end, 45);
      put16(end, 45);
      put32(end, 0);
      put32(end, 0);
      put64(end, entries_.size());
      put64(end, entries_.size());
      put64(end, cd_size);
      put64(end, cd_offset);
      put32(end, 0x07064b50);
      put32(end, 0);
      put64(end, record);
      put32(end, 1);
    }
    put32(end, 0x06054b50);
    put16(end, 0);
    put16(end, 0);
    put16(end, zip64 ? 0xFFFF : static_cast<uint16_t>(entries_.size()));
    put16(end, zip64 ? 0xFFFF : static_cast<uint16_t>(entries_.size()));
    put32(end, zip64 ? kMax32 : static_cast<uint32_t>(cd_size));
    put32(end, zip64 ? kMax32 : static_cast<uint32_t>(cd_offset));
    put16(end, 0);
    write(end.data(), end.size());
  }
  uint64_t size() const { return position_; }

 private:
  static uLong crc32_all(const void* data, uint64_t size) {
    uLong crc = crc32(0L, Z_NULL, 0);
    const auto* p = static_cast<const Bytef*>(data);
    while (size > 0) {
      const uInt n = static_cast<uInt>(std::min<uint64_t>(size, 1u << 30));
      crc = crc32(crc, p, n);
      p += n;
      size -= n;
    }
    return crc;
  }
  static void put16(std::string& s, uint16_t v) {
    for (int i = 0; i < 2; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
  }
  static void put32(std::string& s, uint32_t v) {
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
  }
  static void put64(std::string& s, uint64_t v) {
    for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
  }
  void write(const void* data, uint64_t n) {
    if (n && std::fwrite(data, 1, n, file_) != n)
      fail("cannot write ", quote(path_), ": ", std::strerror(errno), errno == ENOSPC ? " (disk full)" : "");
    position_ += n;
  }
  std::string path_;
  FILE* file_ = nullptr;
  uint64_t position_ = 0;
  std::vector<Entry> entries_;
};

// torch._utils._rebuild_tensor_v2(storage, 0, sizes, strides, False, OrderedDict()) for a contiguous CPU tensor
// whose storage is the archive's record data/<key>.
void pickle_tensor(pickle::Writer& p, const at::Tensor& t, const std::string& key) {
  p.global("torch._utils", "_rebuild_tensor_v2");
  p.mark();
  p.mark();  // the persistent id: ('storage', <type>, key, location, numel)
  p.unicode("storage");
  p.global("torch", storage_type(t.scalar_type()));
  p.unicode(key);
  p.unicode("cpu");
  p.integer(t.numel());
  p.op('t');
  p.op('Q');  // BINPERSID
  p.integer(0);
  p.tuple_of_ints(t.sizes());
  p.tuple_of_ints(t.strides());
  p.boolean(false);  // requires_grad
  p.global("collections", "OrderedDict");
  p.op(')');
  p.op('R');
  p.op('t');
  p.op('R');
}

// One archive: data.pkl, byteorder, the storages as data/0, data/1, ..., version.
uint64_t write_archive(std::FILE* file, const std::string& path, const std::string& prefix, const std::string& program,
                       const std::vector<at::Tensor>& storages) {
  ZipWriter zip(file, path);
  zip.add(prefix + "data.pkl", program.data(), program.size());
  zip.add(prefix + "byteorder", "little", 6);
  for (size_t i = 0; i < storages.size(); ++i)
    zip.add(prefix + "data/" + std::to_string(i), storages[i].data_ptr(), storages[i].nbytes());
  zip.add(prefix + "version", "3\n", 2);
  zip.finish();
  return zip.size();
}

}  // namespace

void save_torch(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<at::Tensor> cpu;
  pickle::Writer p;
  p.op('}');  // EMPTY_DICT
  p.mark();
  for (size_t i = 0; i < tensors.size(); ++i) {
    cpu.push_back(tensors[i].second.detach().to(at::kCPU).contiguous());
    p.unicode(tensors[i].first);
    pickle_tensor(p, cpu.back(), std::to_string(i));
  }
  p.op('u');  // SETITEMS
  p.stop();
  const std::string partial = path + ".partial";
  std::FILE* file = std::fopen(partial.c_str(), "wb");
  if (!file) fail("cannot create ", quote(partial), ": ", std::strerror(errno));
  try {
    write_archive(file, partial, std::filesystem::path(path).stem().string() + "/", p.out, cpu);
  } catch (...) {
    std::fclose(file);
    throw;
  }
  if (std::fclose(file) != 0) fail("cannot write ", quote(partial), ": ", std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) fail("cannot rename ", quote(partial), " to ", quote(path), ": ", ec.message());
}

uint64_t append_torch_tensor(std::FILE* file, const std::string& path, const at::Tensor& tensor) {
  at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
  pickle::Writer p;
  pickle_tensor(p, t, "0");
  p.stop();
  return write_archive(file, path, "archive/", p.out, {t});
}

uint64_t append_torch_object(std::FILE* file, const std::string& path, const std::string& program) {
  return write_archive(file, path, "archive/", program, {});
}

}  // namespace titan::checkpoint
