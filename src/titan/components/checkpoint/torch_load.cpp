#include "titan/components/checkpoint/torch_load.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <variant>
#include <vector>

#include <zlib.h>

#include "titan/common/error.h"
#include "titan/common/strings.h"

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
  explicit ZipReader(const std::string& path) : path_(path) {
    file_ = std::fopen(path.c_str(), "rb");
    if (!file_) fail("cannot open ", quote(path), ": ", std::strerror(errno));
    fseeko(file_, 0, SEEK_END);
    const uint64_t size = static_cast<uint64_t>(ftello(file_));
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
    if (fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0 || std::fread(out, 1, n, file_) != n)
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
  uint64_t size_ = 0;
  FILE* file_ = nullptr;
  std::map<std::string, ZipRecord> records_;
};

// --- a pickle interpreter for torch.save's dicts of tensors ---
struct Value;
using ValuePtr = std::shared_ptr<Value>;
struct Global {
  std::string module, name;
};
struct TensorRef {
  std::string storage_key;
  at::ScalarType dtype;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
};
struct Storage {
  std::string key;
  at::ScalarType dtype;
};
struct Value {
  std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<ValuePtr>, Global, Storage, TensorRef,
               std::vector<std::pair<ValuePtr, ValuePtr>>>
      v;
  bool is_list = false;
};

ValuePtr make(auto x) {
  auto p = std::make_shared<Value>();
  p->v = std::move(x);
  return p;
}

at::ScalarType storage_dtype(const std::string& name, const std::string& path) {
  static const std::map<std::string, at::ScalarType> types = {
      {"FloatStorage", at::kFloat}, {"BFloat16Storage", at::kBFloat16}, {"HalfStorage", at::kHalf},
      {"DoubleStorage", at::kDouble}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt}, {"ByteStorage", at::kByte}};
  auto it = types.find(name);
  if (it == types.end()) fail(quote(path), ": unsupported storage type torch.", name);
  return it->second;
}

using Dict = std::vector<std::pair<ValuePtr, ValuePtr>>;
using Items = std::vector<ValuePtr>;

// The value's alternative T, or an error: malformed or hostile pickles must not reach std::get's exception.
template <typename T>
T& as(const ValuePtr& v, const std::string& path, const char* what) {
  if (!v || !std::holds_alternative<T>(v->v)) fail(quote(path), ": malformed pickle (expected ", what, ")");
  return std::get<T>(v->v);
}

std::vector<int64_t> int_tuple(const ValuePtr& v, const std::string& path) {
  std::vector<int64_t> out;
  for (const auto& item : as<Items>(v, path, "a tuple of sizes or strides")) out.push_back(as<int64_t>(item, path, "an integer size or stride"));
  return out;
}

ValuePtr unpickle(const std::string& data, const std::string& path) {
  std::vector<ValuePtr> stack;
  std::vector<size_t> marks;
  std::map<uint64_t, ValuePtr> memo;
  size_t p = 0;
  auto malformed = [&](const char* what) { fail(quote(path), ": malformed pickle (", what, " at byte ", p, ")"); };
  auto need = [&](size_t n) {
    if (n > data.size() - p) fail(quote(path), ": truncated pickle");
  };
  auto pop = [&] {
    if (stack.empty() || (!marks.empty() && stack.size() <= marks.back())) malformed("stack underflow");
    ValuePtr v = stack.back();
    stack.pop_back();
    return v;
  };
  auto top = [&]() -> ValuePtr& {
    if (stack.empty()) malformed("stack underflow");
    return stack.back();
  };
  auto pop_mark = [&] {
    if (marks.empty()) malformed("no mark");
    size_t m = marks.back();
    marks.pop_back();
    std::vector<ValuePtr> items(stack.begin() + static_cast<std::ptrdiff_t>(m), stack.end());
    stack.resize(m);
    return items;
  };
  auto line = [&] {
    size_t end = data.find('\n', p);
    if (end == std::string::npos) fail(quote(path), ": truncated pickle");
    std::string s = data.substr(p, end - p);
    p = end + 1;
    return s;
  };
  auto u = [&](int n) {
    need(static_cast<size_t>(n));
    uint64_t v = le(reinterpret_cast<const unsigned char*>(data.data() + p), n);
    p += static_cast<size_t>(n);
    return v;
  };
  auto str = [&](uint64_t n) {
    need(n);
    std::string s = data.substr(p, n);
    p += n;
    return s;
  };
  auto memo_get = [&](uint64_t key) {
    auto it = memo.find(key);
    if (it == memo.end()) malformed("memo key never stored");
    return it->second;
  };
  while (true) {
    need(1);
    const unsigned char op = static_cast<unsigned char>(data[p++]);
    switch (op) {
      case 0x80: u(1); break;                   // PROTO
      case 0x95: u(8); break;                   // FRAME
      case '.': {                               // STOP
        if (stack.size() != 1 || !marks.empty()) malformed("STOP with a stack other than one value");
        return stack.back();
      }
      case '}': stack.push_back(make(Dict{})); break;
      case ']': {
        auto v = make(Items{});
        v->is_list = true;
        stack.push_back(v);
        break;
      }
      case ')': stack.push_back(make(Items{})); break;
      case '(': marks.push_back(stack.size()); break;
      case 'N': stack.push_back(make(std::monostate{})); break;
      case 0x88: stack.push_back(make(true)); break;
      case 0x89: stack.push_back(make(false)); break;
      case 'J': stack.push_back(make(static_cast<int64_t>(static_cast<int32_t>(u(4))))); break;
      case 'K': stack.push_back(make(static_cast<int64_t>(u(1)))); break;
      case 'M': stack.push_back(make(static_cast<int64_t>(u(2)))); break;
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes
        const size_t n = u(1);
        if (n > 8) malformed("an integer wider than 64 bits");
        need(n);
        uint64_t v = 0;
        for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(data[p + i])) << (8 * i);
        if (n > 0 && n < 8 && (static_cast<unsigned char>(data[p + n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
        p += n;
        stack.push_back(make(static_cast<int64_t>(v)));
        break;
      }
      case 'G': {
        need(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<unsigned char>(data[p + i]);
        p += 8;
        double d;
        std::memcpy(&d, &bits, 8);
        stack.push_back(make(d));
        break;
      }
      case 'X': stack.push_back(make(str(u(4)))); break;
      case 0x8c: stack.push_back(make(str(u(1)))); break;
      case 'c': {
        std::string module = line();
        std::string name = line();
        stack.push_back(make(Global{module, name}));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = pop(), module = pop();
        stack.push_back(make(Global{as<std::string>(module, path, "a module name"), as<std::string>(name, path, "a name")}));
        break;
      }
      case 'q': memo[u(1)] = top(); break;
      case 'r': memo[u(4)] = top(); break;
      case 0x94: memo[memo.size()] = top(); break;
      case 'h': stack.push_back(memo_get(u(1))); break;
      case 'j': stack.push_back(memo_get(u(4))); break;
      case 't': stack.push_back(make(pop_mark())); break;
      case 0x85: {
        auto a = pop();
        stack.push_back(make(Items{a}));
        break;
      }
      case 0x86: {
        auto b = pop(), a = pop();
        stack.push_back(make(Items{a, b}));
        break;
      }
      case 0x87: {
        auto c = pop(), b = pop(), a = pop();
        stack.push_back(make(Items{a, b, c}));
        break;
      }
      case 'a': {
        auto v = pop();
        as<Items>(top(), path, "a list to append to").push_back(v);
        break;
      }
      case 'e': {
        auto items = pop_mark();
        auto& list = as<Items>(top(), path, "a list to extend");
        list.insert(list.end(), items.begin(), items.end());
        break;
      }
      case 's': {
        auto value = pop(), key = pop();
        as<Dict>(top(), path, "a dict to set an item of").emplace_back(key, value);
        break;
      }
      case 'u': {
        auto items = pop_mark();
        if (items.size() % 2) malformed("SETITEMS with an odd number of values");
        auto& dict = as<Dict>(top(), path, "a dict to set items of");
        for (size_t i = 0; i + 1 < items.size(); i += 2) dict.emplace_back(items[i], items[i + 1]);
        break;
      }
      case 'Q': {  // BINPERSID: ('storage', <storage type>, key, location, numel)
        auto& id = as<Items>(pop(), path, "a persistent id tuple");
        if (id.size() < 3 || !std::holds_alternative<Global>(id[1]->v)) fail(quote(path), ": unexpected persistent id");
        stack.push_back(make(Storage{as<std::string>(id[2], path, "a storage key"), storage_dtype(std::get<Global>(id[1]->v).name, path)}));
        break;
      }
      case 'R': {  // REDUCE
        auto args = pop();
        auto callable = pop();
        if (!std::holds_alternative<Global>(callable->v)) fail(quote(path), ": unsupported pickle (REDUCE on a non-global)");
        const Global g = std::get<Global>(callable->v);
        const auto& a = as<Items>(args, path, "an argument tuple");
        if (g.module == "torch._utils" && g.name == "_rebuild_tensor_v2") {
          if (a.size() < 4 || !std::holds_alternative<Storage>(a[0]->v)) fail(quote(path), ": malformed tensor record");
          const Storage& s = std::get<Storage>(a[0]->v);
          stack.push_back(make(TensorRef{s.key, s.dtype, as<int64_t>(a[1], path, "a storage offset"), int_tuple(a[2], path),
                                         int_tuple(a[3], path)}));
        } else if (g.module == "collections" && g.name == "OrderedDict") {
          stack.push_back(make(Dict{}));
        } else {
          fail(quote(path), ": unsupported object ", g.module, ".", g.name,
               " in the pickle; expected a dict of tensors (a state dict)");
        }
        break;
      }
      case 'b': pop(); break;  // BUILD (OrderedDict metadata): ignored
      default:
        fail(quote(path), ": unsupported pickle opcode 0x", strprintf("%02x", op), " at byte ", p - 1,
             "; expected a torch.save state dict");
    }
  }
}

}  // namespace

std::map<std::string, at::Tensor> load_torch(const std::string& path) {
  ZipReader zip(path);
  const ZipRecord& pkl = zip.find("data.pkl");
  std::string data(pkl.size, '\0');
  zip.read_record(pkl, data.data());
  ValuePtr root = unpickle(data, path);
  if (!std::holds_alternative<Dict>(root->v))
    fail(quote(path), ": the pickle's top-level object is not a dict (a state dict was expected)");
  std::map<std::string, at::Tensor> out;
  std::map<std::string, at::Tensor> storages;  // each storage read (and CRC-checked) once, however many views it has
  for (const auto& [key, value] : std::get<Dict>(root->v)) {
    if (!std::holds_alternative<std::string>(key->v) || !std::holds_alternative<TensorRef>(value->v)) continue;
    const std::string& name = std::get<std::string>(key->v);
    const TensorRef& t = std::get<TensorRef>(value->v);
    const ZipRecord& record = zip.find("data/" + t.storage_key);
    const int64_t element = static_cast<int64_t>(c10::elementSize(t.dtype));
    if (record.size % static_cast<uint64_t>(element) != 0)
      fail(quote(path), ": storage ", quote(t.storage_key), " of tensor ", quote(name), " has ", record.size,
           " bytes, not a whole number of ", c10::toString(t.dtype), " elements");
    at::Tensor& storage = storages[t.storage_key];
    if (!storage.defined() || storage.scalar_type() != t.dtype) {
      storage = at::empty({static_cast<int64_t>(record.size) / element}, at::TensorOptions().dtype(t.dtype));
      zip.read_record(record, storage.data_ptr());
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
      fail(quote(path), ": tensor ", quote(name), " (sizes [", join_ints(t.sizes), "], strides [", join_ints(t.strides),
           "], offset ", t.offset, ") reaches past its storage of ", storage.numel(), " elements");
    out[name] = storage.as_strided(t.sizes, t.strides, t.offset).clone();
  }
  return out;
}

}  // namespace titan::checkpoint
