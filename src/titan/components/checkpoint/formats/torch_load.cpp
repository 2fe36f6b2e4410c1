#include "titan/components/checkpoint/formats/torch_load.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include <zlib.h>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/pickle.h"

namespace titan::checkpoint {

namespace {

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

struct ZipRecord {
  uint64_t data_offset = 0, size = 0;
  uint32_t crc32 = 0;
  std::string name;
};

class ZipReader {
 public:
  // The archive in bytes [base, base + length) of the file (a torch DCP data file holds one per item).
  explicit ZipReader(const std::string& file, uint64_t base = 0, uint64_t length = UINT64_MAX)
      : path_(base == 0 && length == UINT64_MAX ? file : cat(file, " at byte ", base)), base_(base) {
    const std::string& path = path_;
    file_ = std::fopen(file.c_str(), "rb");
    if (!file_) fail("cannot open ", quote(file), ": ", std::strerror(errno));
    fseeko(file_, 0, SEEK_END);
    const uint64_t file_size = static_cast<uint64_t>(ftello(file_));
    if (base > file_size || (length != UINT64_MAX && length > file_size - base))
      fail(quote(path), ": the file ends at byte ", file_size, ", before the ", length, "-byte archive expected there");
    const uint64_t size = length == UINT64_MAX ? file_size - base : length;
    size_ = size;
    if (size < 22) fail(quote(path), ": not a torch.save ZIP archive (", size, " bytes)");
    const uint64_t tail = std::min<uint64_t>(size, 65536 + 22);
    std::vector<unsigned char> end(tail);
    read_at(size - tail, end.data(), tail);
    int64_t eocd = -1;
    for (int64_t i = static_cast<int64_t>(tail) - 22; i >= 0; --i)
      if (le(&end[i], 4) == 0x06054b50) {
        eocd = i;
        break;
      }
    if (eocd < 0) fail(quote(path), ": not a torch.save ZIP archive (no end-of-central-directory record); files from "
                       "torch.save before PyTorch 1.6 are not supported");
    uint64_t entries = le(&end[eocd + 10], 2), cd_size = le(&end[eocd + 12], 4), cd_offset = le(&end[eocd + 16], 4);
    if (cd_offset == 0xFFFFFFFFu || entries == 0xFFFF) {  // ZIP64: the locator sits right before the record
      unsigned char locator[20];
      if (size - tail + static_cast<uint64_t>(eocd) < 20) fail(quote(path), ": malformed ZIP64 archive");
      read_at(size - tail + static_cast<uint64_t>(eocd) - 20, locator, 20);
      if (le(locator, 4) != 0x07064b50) fail(quote(path), ": malformed ZIP64 archive");
      unsigned char record[56];
      read_at(le(locator + 8, 8), record, 56);
      entries = le(record + 32, 8);
      cd_size = le(record + 40, 8);
      cd_offset = le(record + 48, 8);
    }
    if (cd_size > size || cd_offset > size - cd_size) fail(quote(path), ": corrupt ZIP central directory (past the file's end)");
    std::vector<unsigned char> cd(cd_size);
    read_at(cd_offset, cd.data(), cd_size);
    size_t p = 0;
    for (uint64_t e = 0; e < entries; ++e) {
      if (p + 46 > cd.size() || le(&cd[p], 4) != 0x02014b50) fail(quote(path), ": corrupt ZIP central directory");
      const uint64_t method = le(&cd[p + 10], 2), crc = le(&cd[p + 16], 4);
      uint64_t csize = le(&cd[p + 20], 4), usize = le(&cd[p + 24], 4), offset = le(&cd[p + 42], 4);
      const size_t name_len = le(&cd[p + 28], 2), extra_len = le(&cd[p + 30], 2), comment_len = le(&cd[p + 32], 2);
      if (p + 46 + name_len + extra_len + comment_len > cd.size()) fail(quote(path), ": corrupt ZIP central directory");
      std::string name(reinterpret_cast<const char*>(&cd[p + 46]), name_len);
      const size_t extra_end = p + 46 + name_len + extra_len;
      for (size_t x = p + 46 + name_len; x + 4 <= extra_end;) {
        const uint64_t id = le(&cd[x], 2), len = le(&cd[x + 2], 2);
        if (x + 4 + len > extra_end) fail(quote(path), ": corrupt ZIP extra field for ", quote(name));
        if (id == 0x0001) {
          size_t q = x + 4;
          auto field = [&] {
            if (q + 8 > x + 4 + len) fail(quote(path), ": corrupt ZIP64 extra field for ", quote(name));
            q += 8;
            return le(&cd[q - 8], 8);
          };
          if (usize == 0xFFFFFFFFu) usize = field();
          if (csize == 0xFFFFFFFFu) csize = field();
          if (offset == 0xFFFFFFFFu) offset = field();
        }
        x += 4 + len;
      }
      if (method != 0) fail(quote(path), ": ZIP entry ", quote(name), " is compressed; torch.save stores entries uncompressed");
      if (csize != usize) fail(quote(path), ": corrupt ZIP entry ", quote(name), " (stored sizes differ)");
      unsigned char local[30];
      if (offset > size || size - offset < 30) fail(quote(path), ": corrupt ZIP entry ", quote(name), " (offset past the end)");
      read_at(offset, local, 30);
      if (le(local, 4) != 0x04034b50) fail(quote(path), ": corrupt ZIP local header for ", quote(name));
      const uint64_t data_offset = offset + 30 + le(local + 26, 2) + le(local + 28, 2);
      if (data_offset > size || usize > size - data_offset)
        fail(quote(path), ": truncated: ZIP entry ", quote(name), " needs ", usize, " bytes at ", data_offset,
             ", the file has ", size);
      records_[name] = {data_offset, usize, static_cast<uint32_t>(crc), name};
      p += 46 + name_len + extra_len + comment_len;
    }
  }
  ~ZipReader() {
    if (file_) std::fclose(file_);
  }
  // The record named "<any prefix>/<suffix>" (torch.save puts everything under one top folder).
  const ZipRecord& find(const std::string& suffix) const {
    for (const auto& [name, r] : records_)
      if (name.size() > suffix.size() && name.ends_with("/" + suffix) &&
          name.find('/') == name.size() - suffix.size() - 1)
        return r;
    fail(quote(path_), ": no record ", quote(suffix), " in the archive");
  }
  void read_at(uint64_t offset, void* out, uint64_t n) const {
    if (offset > size_ || n > size_ - offset || fseeko(file_, static_cast<off_t>(base_ + offset), SEEK_SET) != 0 ||
        std::fread(out, 1, n, file_) != n)
      fail(quote(path_), ": truncated (cannot read ", n, " bytes at ", offset, ")");
  }
  // A record's bytes, checked against the CRC-32 its central directory entry holds.
  void read_record(const ZipRecord& r, void* out) const {
    read_at(r.data_offset, out, r.size);
    uLong crc = crc32(0L, Z_NULL, 0);
    for (uint64_t done = 0; done < r.size;) {
      const uInt n = static_cast<uInt>(std::min<uint64_t>(r.size - done, uint64_t{1} << 30));
      crc = crc32(crc, static_cast<const Bytef*>(out) + done, n);
      done += n;
    }
    if (static_cast<uint32_t>(crc) != r.crc32)
      fail(quote(path_), ": ZIP entry ", quote(r.name), " fails its CRC-32 check (stored ", r.crc32, ", computed ",
           static_cast<uint32_t>(crc), "); the file is damaged");
  }
  uint64_t size() const { return size_; }

 private:
  std::string path_;
  uint64_t base_ = 0, size_ = 0;
  FILE* file_ = nullptr;
  std::map<std::string, ZipRecord> records_;
};

// --- torch.save's pickle: tensors are torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, ...) calls
// whose storage is a persistent id ('storage', <dtype>Storage, key, location, numel) naming the record data/<key>.
struct TensorRecord {
  std::string storage_key;
  at::ScalarType dtype;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
};

at::ScalarType storage_dtype(const std::string& name, const std::string& path) {
  static const std::map<std::string, at::ScalarType> types = {
      {"FloatStorage", at::kFloat}, {"BFloat16Storage", at::kBFloat16}, {"HalfStorage", at::kHalf},
      {"DoubleStorage", at::kDouble}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt}, {"ShortStorage", at::kShort},
      {"CharStorage", at::kChar}, {"ByteStorage", at::kByte}, {"BoolStorage", at::kBool}};
  auto it = types.find(name);
  if (it == types.end()) fail(quote(path), ": unsupported storage type torch.", name);
  return it->second;
}

using pickle::Value;
using Kind = pickle::Value::Kind;

int64_t integer(const pickle::Ptr& v, const std::string& path, const char* what) {
  if (!v || !v->is(Kind::integer)) fail(quote(path), ": malformed tensor record (expected ", what, ")");
  return v->integer;
}

std::vector<int64_t> int_tuple(const pickle::Ptr& v, const std::string& path) {
  if (!v || !v->is(Kind::tuple)) fail(quote(path), ": malformed tensor record (expected a tuple of sizes or strides)");
  std::vector<int64_t> out;
  for (const auto& item : v->items) out.push_back(integer(item, path, "an integer size or stride"));
  return out;
}

// The tensor `v` stands for, or nothing when it is not a tensor.
std::optional<TensorRecord> tensor_record(const Value& v, const std::string& path) {
  if (!v.is_object("torch._utils", "_rebuild_tensor_v2")) return std::nullopt;
  const auto& a = v.items;
  if (a.size() < 4 || !a[0]->is(Kind::persistent)) fail(quote(path), ": malformed tensor record");
  const pickle::Ptr& id = a[0]->items.at(0);
  if (!id->is(Kind::tuple) || id->items.size() < 3 || !id->items[1]->is(Kind::global) || !id->items[2]->is(Kind::string))
    fail(quote(path), ": unexpected persistent id (expected ('storage', <type>, key, location, numel))");
  return TensorRecord{id->items[2]->text, storage_dtype(id->items[1]->name, path), integer(a[1], path, "a storage offset"),
                      int_tuple(a[2], path), int_tuple(a[3], path)};
}

// Reads tensors out of one archive; each storage is read (and CRC-checked) once, however many views it has.
class TensorMaterializer {
 public:
  TensorMaterializer(const ZipReader& zip, const std::string& path) : zip_(zip), path_(path) {}
  at::Tensor operator()(const TensorRecord& t, const std::string& name) {
    const ZipRecord& record = zip_.find("data/" + t.storage_key);
    const int64_t element = static_cast<int64_t>(c10::elementSize(t.dtype));
    if (record.size % static_cast<uint64_t>(element) != 0)
      fail(quote(path_), ": storage ", quote(t.storage_key), " of tensor ", quote(name), " has ", record.size,
           " bytes, not a whole number of ", c10::toString(t.dtype), " elements");
    at::Tensor& storage = storages_[t.storage_key];
    if (!storage.defined() || storage.scalar_type() != t.dtype) {
      storage = at::empty({static_cast<int64_t>(record.size) / element}, at::TensorOptions().dtype(t.dtype));
      zip_.read_record(record, storage.data_ptr());
    }
    // The view must lie inside its storage and repeat none of it (state dicts hold no expanded views): sizes and
    // strides from the file are checked before as_strided, in 128 bits so that no product overflows.
    bool ok = t.sizes.size() == t.strides.size() && t.offset >= 0;
    __int128 last = t.offset, count = 1;
    const __int128 limit = storage.numel();
    for (size_t d = 0; ok && d < t.sizes.size(); ++d) {
      ok = t.sizes[d] >= 0 && t.strides[d] >= 0;
      count = std::min<__int128>(count * t.sizes[d], limit + 1);
      if (t.sizes[d] > 0) last = std::min<__int128>(last + static_cast<__int128>(t.sizes[d] - 1) * t.strides[d], limit);
    }
    if (!ok || (count > 0 && (count > limit || last >= limit)))
      fail(quote(path_), ": tensor ", quote(name), " (sizes [", join_ints(t.sizes), "], strides [", join_ints(t.strides),
           "], offset ", t.offset, ") reaches past its storage of ", storage.numel(), " elements");
    return storage.as_strided(t.sizes, t.strides, t.offset).clone();
  }

 private:
  const ZipReader& zip_;
  const std::string& path_;
  std::map<std::string, at::Tensor> storages_;
};

pickle::Ptr read_pickle(const ZipReader& zip, const std::string& path) {
  const ZipRecord& pkl = zip.find("data.pkl");
  std::string data(pkl.size, '\0');
  zip.read_record(pkl, data.data());
  return pickle::load(data, quote(path));
}

}  // namespace

std::map<std::string, at::Tensor> load_torch(const std::string& path, std::string* unwrapped) {
  ZipReader zip(path);
  pickle::Ptr root = read_pickle(zip, path);
  if (!root->is(Kind::dict)) fail(quote(path), ": the pickle's top-level object is not a dict (a state dict was expected)");
  auto holds_tensors = [&](const Value& dict) {
    for (const auto& [key, value] : dict.entries)
      if (key->is(Kind::string) && tensor_record(*value, path)) return true;
    return false;
  };
  const Value* state = root.get();
  if (!holds_tensors(*root)) {
    // One wrapping level: {"model": state_dict, ...} with exactly one dict of tensors among the values.
    std::vector<std::string> wrapped;
    for (const auto& [key, value] : root->entries)
      if (key->is(Kind::string) && value->is(Kind::dict) && holds_tensors(*value)) {
        wrapped.push_back(key->text);
        state = value.get();
      }
    if (wrapped.size() > 1) {
      for (auto& key : wrapped) key = quote(key);
      fail(quote(path), ": holds several dicts of tensors (", join(wrapped, ", "),
           "); titan cannot tell which is the model's state dict. Save that one alone: torch.save(checkpoint[KEY], PATH)");
    }
    if (wrapped.size() == 1 && unwrapped) *unwrapped = wrapped[0];
  }
  std::map<std::string, at::Tensor> out;
  TensorMaterializer materialize(zip, path);
  for (const auto& [key, value] : state->entries) {
    if (!key->is(Kind::string)) continue;
    if (auto t = tensor_record(*value, path)) out[key->text] = materialize(*t, key->text);
    else if (value->is(Kind::object))  // anything else is a non-tensor value, skipped; unknown objects are refused
      if (!value->is_object("collections", "OrderedDict"))
        fail(quote(path), ": unsupported object ", value->module, ".", value->name,
             " in the pickle; expected a dict of tensors (a state dict)");
  }
  return out;
}

at::Tensor load_torch_tensor(const std::string& path, uint64_t offset, uint64_t length) {
  ZipReader zip(path, offset, length);
  const std::string where = cat(path, " at byte ", offset);
  pickle::Ptr root = read_pickle(zip, where);
  auto t = tensor_record(*root, where);
  if (!t) fail(quote(where), ": expected a torch.save'd tensor, found ", root->describe());
  return TensorMaterializer(zip, where)(*t, "item");
}

pickle::Ptr load_torch_object(const std::string& path, uint64_t offset, uint64_t length) {
  ZipReader zip(path, offset, length);
  return read_pickle(zip, cat(path, " at byte ", offset));
}

}  // namespace titan::checkpoint
