#include "titan/components/checkpoint/torch_save.h"

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::checkpoint {

namespace {

constexpr uint32_t kMax32 = 0xFFFFFFFFu;

// ZIP64 records are used from 4 GiB on; TITAN_TORCH_SAVE_FORCE_ZIP64=1 uses them always (tests exercise the large-file
// layout without writing gigabytes).
uint64_t zip64_threshold() {
  static const uint64_t threshold = std::getenv("TITAN_TORCH_SAVE_FORCE_ZIP64") ? 0 : kMax32;
  return threshold;
}

// --- pickle (protocol 2), only the opcodes a tensor dict needs ---
class Pickler {
 public:
  std::string out = std::string("\x80\x02", 2);
  void op(char c) { out.push_back(c); }
  void global(const std::string& module, const std::string& name) { out += "c" + module + "\n" + name + "\n"; }
  void unicode(const std::string& s) {
    op('X');
    u32(static_cast<uint32_t>(s.size()));
    out += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
      return;
    }
    op('\x8a');  // LONG1: little-endian two's complement
    out.push_back(8);
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
  }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
  }
};

const char* storage_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "FloatStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kHalf: return "HalfStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kByte: return "ByteStorage";
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
  explicit ZipWriter(const std::string& path) : path_(path) {
    file_ = std::fopen(path.c_str(), "wb");
    if (!file_) fail("cannot create ", quote(path), ": ", std::strerror(errno));
  }
  ~ZipWriter() {
    if (file_) std::fclose(file_);
  }
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
    if (std::fclose(file_) != 0) {
      file_ = nullptr;
      fail("cannot write ", quote(path_), ": ", std::strerror(errno));
    }
    file_ = nullptr;
  }

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

}  // namespace

void save_torch(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<at::Tensor> cpu;
  Pickler p;
  p.op('}');  // EMPTY_DICT
  p.op('(');  // MARK
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i].second.detach().to(at::kCPU).contiguous();
    cpu.push_back(t);
    p.unicode(tensors[i].first);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.op('(');
    p.op('(');  // the persistent id: ('storage', <type>, key, location, numel)
    p.unicode("storage");
    p.global("torch", storage_type(t.scalar_type()));
    p.unicode(std::to_string(i));
    p.unicode("cpu");
    p.integer(t.numel());
    p.op('t');
    p.op('Q');  // BINPERSID
    p.integer(0);
    p.op('(');
    for (int64_t s : t.sizes()) p.integer(s);
    p.op('t');
    p.op('(');
    for (int64_t s : t.strides()) p.integer(s);
    p.op('t');
    p.op('\x89');  // requires_grad = False
    p.global("collections", "OrderedDict");
    p.op(')');
    p.op('R');
    p.op('t');
    p.op('R');
  }
  p.op('u');  // SETITEMS
  p.op('.');
  const std::string partial = path + ".partial";
  {
    ZipWriter zip(partial);
    const std::string prefix = std::filesystem::path(path).stem().string() + "/";
    zip.add(prefix + "data.pkl", p.out.data(), p.out.size());
    zip.add(prefix + "byteorder", "little", 6);
    for (size_t i = 0; i < cpu.size(); ++i) zip.add(prefix + "data/" + std::to_string(i), cpu[i].data_ptr(), cpu[i].nbytes());
    zip.add(prefix + "version", "3\n", 2);
    zip.finish();
  }
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) fail("cannot rename ", quote(partial), " to ", quote(path), ": ", ec.message());
}

}  // namespace titan::checkpoint
