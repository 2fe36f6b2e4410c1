#include "titan/components/checkpoint/formats/torch_dcp.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/progress.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/pickle_writer.h"
#include "titan/components/checkpoint/formats/torch_load.h"
#include "titan/components/checkpoint/formats/torch_save.h"
#include "titan/config/dtypes.h"

namespace titan::checkpoint::torch_dcp {

namespace fs = std::filesystem;
using pickle::Ptr;
using Kind = pickle::Value::Kind;

namespace {

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kFilesystemModule = "torch.distributed.checkpoint.filesystem";

std::string dtype_name(at::ScalarType t) { return titan::config::dtype_name(t); }

// Reading the Metadata tree; every complaint names the file and what was expected.
struct Parser {
  std::string path;

  [[noreturn]] void bad(const std::string& what) const {
    fail(path, ": not a torch.distributed.checkpoint metadata file as expected (", what, ")");
  }
  // A dataclass written as NEWOBJ + BUILD(dict): its field.
  Ptr field(const Ptr& object, const char* name, bool required = true) const {
    if (!object || !object->is(Kind::object)) bad(cat("expected an object with field ", name));
    Ptr value = object->state ? object->state->get(name) : nullptr;
    if (!value && required) bad(cat(object->module, ".", object->name, " has no field ", name));
    return value;
  }
  // torch.Size(tuple) or a plain tuple of integers.
  std::vector<int64_t> ints(const Ptr& v, const char* what) const {
    const pickle::Value* tuple = v.get();
    if (v && v->is_object("torch", "Size")) tuple = v->items.empty() ? nullptr : v->items[0].get();
    if (!tuple || !(tuple->is(Kind::tuple) || tuple->is(Kind::list))) bad(cat(what, " is not a tuple of integers"));
    std::vector<int64_t> out;
    for (const auto& item : tuple->items) {
      if (!item->is(Kind::integer)) bad(cat(what, " holds ", item->describe(), ", not an integer"));
      out.push_back(item->integer);
    }
    return out;
  }
  int64_t integer(const Ptr& v, const char* what) const {
    if (!v || !v->is(Kind::integer) || v->integer < 0) bad(cat(what, " is not a non-negative integer"));
    return v->integer;
  }
  std::string text(const Ptr& v, const char* what) const {
    if (!v || !v->is(Kind::string)) bad(cat(what, " is not a string"));
    return v->text;
  }
  at::ScalarType dtype(const Ptr& properties) const {
    // TensorProperties keeps its fields as a tuple state (dtype first) or, in older versions, a dict.
    Ptr d;
    if (properties && properties->state && properties->state->is(Kind::tuple) && !properties->state->items.empty())
      d = properties->state->items[0];
    else
      d = field(properties, "dtype");
    if (!d || !d->is(Kind::global) || d->module != "torch") bad("a tensor's dtype is not a torch dtype");
    try {
      return titan::config::dtype_from_name(d->name, path);
    } catch (const UserError&) {
      fail(path, ": tensors of dtype torch.", d->name, " are not supported (float32, bfloat16, float16, float64 and integer types are)");
    }
  }
};

}  // namespace

bool is_checkpoint(const std::string& directory) { return fs::is_regular_file(fs::path(directory) / ".metadata"); }

bool has_training_state(const std::string& directory) {
  Reader reader(directory);
  return reader.objects().count("train_state.step") || reader.has_tensor("train_state.step");
}

Reader::Reader(const std::string& directory) : directory_(directory) {
  const std::string path = (fs::path(directory) / ".metadata").string();
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("no .metadata in ", quote(directory), "; expected a torch.distributed.checkpoint directory");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string data = buffer.str();
  const Parser p{path};
  const Ptr root = pickle::load(data, path);
  if (!root->is_object(kMetadataModule, "Metadata")) p.bad(cat("the top-level object is ", root->describe()));
  const Ptr entries = p.field(root, "state_dict_metadata");
  const Ptr storage = p.field(root, "storage_data");
  if (!entries->is(Kind::dict) || !storage->is(Kind::dict)) p.bad("state_dict_metadata or storage_data is not a dict");

  // Where each chunk (fqn, offsets) or value (fqn) lies.
  std::map<std::pair<std::string, std::vector<int64_t>>, Location> tensor_locations;
  std::map<std::string, Location> object_locations;
  for (const auto& [index, info] : storage->entries) {
    if (!index->is_object(kMetadataModule, "MetadataIndex")) p.bad(cat("a storage_data key is ", index->describe()));
    if (!info->is_object(kFilesystemModule, "_StorageInfo")) p.bad(cat("a storage_data value is ", info->describe()));
    const std::string fqn = p.text(p.field(index, "fqn"), "MetadataIndex.fqn");
    if (Ptr transforms = p.field(info, "transform_descriptors", false);
        transforms && !transforms->is(Kind::none) && !transforms->items.empty())
      fail(path, ": ", quote(fqn), " was written through stream transforms (compression, FileSystemWriter _extensions), "
           "which titan does not read; save without them");
    Location where{p.text(p.field(info, "relative_path"), "_StorageInfo.relative_path"),
                   static_cast<uint64_t>(p.integer(p.field(info, "offset"), "_StorageInfo.offset")),
                   static_cast<uint64_t>(p.integer(p.field(info, "length"), "_StorageInfo.length"))};
    if (where.file.find("..") != std::string::npos || where.file.find('/') != std::string::npos)
      p.bad(cat("a data file name ", quote(where.file), " points outside the directory"));
    Ptr offset = p.field(index, "offset", false);
    if (!offset || offset->is(Kind::none)) object_locations[fqn] = where;
    else tensor_locations[{fqn, p.ints(offset, "MetadataIndex.offset")}] = where;
  }

  for (const auto& [key, entry] : entries->entries) {
    const std::string fqn = p.text(key, "a state_dict_metadata key");
    if (entry->is_object(kMetadataModule, "BytesStorageMetadata")) {
      auto it = object_locations.find(fqn);
      if (it == object_locations.end()) p.bad(cat("no storage_data entry for value ", quote(fqn)));
      objects_[fqn] = it->second;
      continue;
    }
    if (!entry->is_object(kMetadataModule, "TensorStorageMetadata"))
      p.bad(cat(quote(fqn), " is described by ", entry->describe()));
    TensorItem item;
    item.dtype = p.dtype(p.field(entry, "properties"));
    item.shape = p.ints(p.field(entry, "size"), "a tensor's size");
    const Ptr chunks = p.field(entry, "chunks");
    if (!chunks->is(Kind::list)) p.bad(cat(quote(fqn), ": chunks is not a list"));
    // Every dimension and chunk box must lie inside the tensor and the chunks must tile it exactly: pairwise
    // disjoint, with volumes adding up to the tensor's (a gap would leave elements unread).
    constexpr __int128 kMaxElements = __int128{1} << 62;
    __int128 total = 1;
    for (int64_t d : item.shape) {
      if (d < 0) p.bad(cat(quote(fqn), " has a negative dimension in its shape [", join_ints(item.shape), "]"));
      total = std::min<__int128>(total * d, kMaxElements + 1);
    }
    if (total > kMaxElements) p.bad(cat(quote(fqn), " has more than 2^62 elements"));
    __int128 volume = 0;
    for (const auto& c : chunks->items) {
      Chunk chunk;
      chunk.offsets = p.ints(p.field(c, "offsets"), "a chunk's offsets");
      chunk.sizes = p.ints(p.field(c, "sizes"), "a chunk's sizes");
      if (chunk.offsets.size() != item.shape.size() || chunk.sizes.size() != item.shape.size())
        p.bad(cat(quote(fqn), ": a chunk has another number of dimensions than the tensor"));
      __int128 chunk_volume = 1;
      for (size_t d = 0; d < item.shape.size(); ++d) {
        if (chunk.offsets[d] < 0 || chunk.sizes[d] < 0 || chunk.offsets[d] > item.shape[d] ||
            chunk.sizes[d] > item.shape[d] - chunk.offsets[d])
          p.bad(cat(quote(fqn), ": a chunk at [", join_ints(chunk.offsets), "] of sizes [", join_ints(chunk.sizes),
                    "] lies outside the tensor's shape [", join_ints(item.shape), "]"));
        chunk_volume *= chunk.sizes[d];  // each factor is at most its dimension: no overflow past the total
      }
      volume += chunk_volume;
      auto it = tensor_locations.find({fqn, chunk.offsets});
      if (it == tensor_locations.end())
        p.bad(cat("no storage_data entry for the chunk of ", quote(fqn), " at [", join_ints(chunk.offsets), "]"));
      chunk.where = it->second;
      item.chunks.push_back(chunk);
    }
    auto empty = [](const Chunk& c) { return std::find(c.sizes.begin(), c.sizes.end(), 0) != c.sizes.end(); };
    for (size_t a = 0; a < item.chunks.size() && !item.shape.empty(); ++a)
      for (size_t b = a + 1; b < item.chunks.size(); ++b) {
        const Chunk &x = item.chunks[a], &y = item.chunks[b];
        if (empty(x) || empty(y)) continue;  // FSDP's empty shards lie anywhere and hold nothing
        bool overlap = true;
        for (size_t d = 0; d < item.shape.size() && overlap; ++d)
          overlap = x.offsets[d] < y.offsets[d] + y.sizes[d] && y.offsets[d] < x.offsets[d] + x.sizes[d];
        if (overlap) p.bad(cat(quote(fqn), ": chunks at [", join_ints(x.offsets), "] and [", join_ints(y.offsets), "] overlap"));
      }
    if (volume != total)
      p.bad(cat(quote(fqn), ": its chunks hold ", static_cast<int64_t>(volume), " elements, the tensor has ",
                static_cast<int64_t>(total)));
    tensors_[fqn] = std::move(item);
  }
}

void Reader::read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) const {
  auto it = tensors_.find(key);
  if (it == tensors_.end()) fail(quote(directory_), ": no tensor ", quote(key));
  const TensorItem& item = it->second;
  if (static_cast<int64_t>(offsets.size()) != out.dim() || out.dim() != static_cast<int64_t>(item.shape.size()))
    fail(quote(directory_), ": ", quote(key), " has shape [", join_ints(item.shape), "], read as a box of ", out.dim(), " dimensions");
  int64_t filled = 0;
  for (const Chunk& chunk : item.chunks) {
    // The overlap of the chunk and the wanted box, in global coordinates.
    std::vector<int64_t> begin(offsets.size()), length(offsets.size());
    bool empty = false;
    for (size_t d = 0; d < offsets.size(); ++d) {
      begin[d] = std::max(offsets[d], chunk.offsets[d]);
      const int64_t end = std::min(offsets[d] + out.size(static_cast<int64_t>(d)), chunk.offsets[d] + chunk.sizes[d]);
      length[d] = end - begin[d];
      empty = empty || length[d] <= 0;
    }
    if (empty && !offsets.empty()) continue;
    const std::string file = (fs::path(directory_) / chunk.where.file).string();
    at::Tensor saved = load_torch_tensor(file, chunk.where.offset, chunk.where.length);
    if (saved.sizes().vec() != chunk.sizes)
      fail(quote(file), " at byte ", chunk.where.offset, ": the chunk of ", quote(key), " has shape ", saved.sizes(),
           ", the metadata says [", join_ints(chunk.sizes), "]");
    at::Tensor source = saved, target = out;
    for (size_t d = 0; d < offsets.size(); ++d) {
      const auto dim = static_cast<int64_t>(d);
      source = source.narrow(dim, begin[d] - chunk.offsets[d], length[d]);
      target = target.narrow(dim, begin[d] - offsets[d], length[d]);
    }
    target.copy_(source);
    filled += source.numel();
  }
  if (filled != out.numel())
    fail(quote(directory_), ": the chunks of ", quote(key), " cover ", filled, " of the ", out.numel(),
         " elements asked for; the checkpoint is incomplete");
}

at::Tensor Reader::read(const std::string& key) const {
  auto it = tensors_.find(key);
  if (it == tensors_.end()) fail(quote(directory_), ": no tensor ", quote(key));
  at::Tensor out = at::empty(it->second.shape, at::TensorOptions().dtype(it->second.dtype));
  read_box(key, std::vector<int64_t>(it->second.shape.size(), 0), out);
  return out;
}

pickle::Ptr Reader::read_object(const std::string& key) const {
  auto it = objects_.find(key);
  if (it == objects_.end()) fail(quote(directory_), ": no value ", quote(key));
  return load_torch_object((fs::path(directory_) / it->second.file).string(), it->second.offset, it->second.length);
}

std::optional<int64_t> Reader::read_integer(const std::string& key) const {
  if (objects_.count(key)) {
    const pickle::Ptr v = read_object(key);
    if (!v->is(Kind::integer) || v->integer < 0)
      fail("torch DCP checkpoint ", directory_, ": ", quote(key), " is ", v->describe(), ", expected a non-negative integer");
    return v->integer;
  }
  if (has_tensor(key)) {
    const at::Tensor t = read(key);
    if (t.numel() != 1 || at::isFloatingType(t.scalar_type()) || t.item<int64_t>() < 0)
      fail("torch DCP checkpoint ", directory_, ": ", quote(key), " is a tensor of shape ", t.sizes(), " and type ",
           c10::toString(t.scalar_type()), ", expected one non-negative integer");
    return t.item<int64_t>();
  }
  return std::nullopt;
}

namespace {

void write_size(pickle::Writer& p, const std::vector<int64_t>& dims) {  // torch.Size(dims)
  p.global("torch", "Size");
  p.mark();
  p.tuple_of_ints(dims);
  p.op('t');
  p.op('R');
}

void write_string_tuple(pickle::Writer& p, const std::vector<std::string>& items) {
  p.mark();
  for (const auto& s : items) p.unicode(s);
  p.op('t');
}

}  // namespace

void write_checkpoint(const std::string& directory, const std::vector<TensorToWrite>& tensors,
                      const std::vector<ObjectToWrite>& objects) {
  if (fs::exists(directory)) fail(quote(directory), " exists; choose a new directory so nothing is overwritten");
  const std::string partial = directory + ".partial";
  fs::remove_all(partial);
  fs::create_directories(partial);
  const std::string data_name = "__0_0.distcp";
  const std::string data_path = (fs::path(partial) / data_name).string();
  std::FILE* file = std::fopen(data_path.c_str(), "wb");
  if (!file) fail("cannot create ", quote(data_path), ": ", std::strerror(errno));
  std::vector<Location> object_at, tensor_at;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::ScalarType> dtypes;
  try {
    uint64_t position = 0;
    // As FileSystemWriter orders them: values first, then tensors.
    for (const auto& o : objects) {
      const uint64_t n = append_torch_object(file, data_path, o.pickle);
      object_at.push_back({data_name, position, n});
      position += n;
    }
    int64_t bytes = 0;
    for (const auto& t : tensors) bytes += static_cast<int64_t>(t.tensor.nbytes());
    Progress progress("writing " + directory, bytes, "bytes");
    for (const auto& t : tensors) {
      progress.advance(static_cast<int64_t>(t.tensor.nbytes()));
      shapes.push_back(t.tensor.sizes().vec());
      dtypes.push_back(t.tensor.scalar_type());
      dtype_name(t.tensor.scalar_type());  // refuses what DCP metadata cannot name before writing it
      const uint64_t n = append_torch_tensor(file, data_path, t.tensor);
      tensor_at.push_back({data_name, position, n});
      position += n;
    }
  } catch (...) {
    std::fclose(file);
    throw;
  }
  if (std::fflush(file) != 0 || ::fsync(fileno(file)) != 0 || std::fclose(file) != 0)
    fail("cannot write ", quote(data_path), ": ", std::strerror(errno), errno == ENOSPC ? " (disk full)" : "");

  // The Metadata object, as pickle builds dataclasses: NEWOBJ, then BUILD with a dict of fields.
  pickle::Writer p;
  p.new_object(kMetadataModule, "Metadata");
  p.op('}');
  p.mark();
  p.unicode("state_dict_metadata");
  p.op('}');
  p.mark();
  for (size_t i = 0; i < tensors.size(); ++i) {
    p.unicode(tensors[i].key);
    p.new_object(kMetadataModule, "TensorStorageMetadata");
    p.op('}');
    p.mark();
    p.unicode("properties");
    p.new_object(kMetadataModule, "TensorProperties");
    p.mark();  // its __setstate__ tuple: dtype, layout, requires_grad, memory format, pin_memory (the 5-tuple every
               // PyTorch reads; newer ones add the strides, optional)
    p.global("torch", dtype_name(dtypes[i]));
    p.global("torch", "strided");
    p.boolean(false);
    p.global(kMetadataModule, "_MEM_FORMAT_ENCODING");
    p.mark();
    p.integer(0);  // torch.contiguous_format
    p.op('t');
    p.op('R');
    p.boolean(false);
    p.op('t');
    p.build();
    p.unicode("size");
    write_size(p, shapes[i]);
    p.unicode("chunks");
    p.op(']');
    p.new_object(kMetadataModule, "ChunkStorageMetadata");
    p.op('}');
    p.mark();
    p.unicode("offsets");
    write_size(p, std::vector<int64_t>(shapes[i].size(), 0));
    p.unicode("sizes");
    write_size(p, shapes[i]);
    p.op('u');
    p.build();
    p.op('a');
    p.op('u');
    p.build();
  }
  for (const auto& o : objects) {
    p.unicode(o.key);
    p.new_object(kMetadataModule, "BytesStorageMetadata");
  }
  p.op('u');
  p.unicode("planner_data");
  p.op('}');
  p.mark();
  for (const auto& t : tensors) {
    p.unicode(t.key);
    write_string_tuple(p, t.path);
  }
  for (const auto& o : objects) {
    p.unicode(o.key);
    write_string_tuple(p, o.path);
  }
  p.op('u');
  p.unicode("storage_data");
  p.op('}');
  p.mark();
  auto storage_entry = [&](const std::string& key, const std::vector<int64_t>* offsets, const Location& at) {
    p.new_object(kMetadataModule, "MetadataIndex");
    p.op('}');
    p.mark();
    p.unicode("fqn");
    p.unicode(key);
    if (offsets) {
      p.unicode("offset");
      write_size(p, *offsets);
      p.unicode("index");
      p.integer(0);
    }
    p.op('u');
    p.build();
    p.new_object(kFilesystemModule, "_StorageInfo");
    p.op('}');
    p.mark();
    p.unicode("relative_path");
    p.unicode(at.file);
    p.unicode("offset");
    p.integer(static_cast<int64_t>(at.offset));
    p.unicode("length");
    p.integer(static_cast<int64_t>(at.length));
    p.op('u');
    p.build();
  };
  for (size_t i = 0; i < objects.size(); ++i) storage_entry(objects[i].key, nullptr, object_at[i]);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::vector<int64_t> origin(shapes[i].size(), 0);
    storage_entry(tensors[i].key, &origin, tensor_at[i]);
  }
  p.op('u');
  p.unicode("version");
  p.unicode("1.0.0");
  p.op('u');
  p.build();
  p.stop();
  write_file((fs::path(partial) / ".metadata").string(), p.out, /*durable=*/true);
  std::error_code ec;
  fs::rename(partial, directory, ec);
  if (ec) fail("cannot rename ", quote(partial), " to ", quote(directory), ": ", ec.message());
}

std::string nested_model_prefix(const Reader& reader) {
  bool any = false;
  for (const auto& [key, item] : reader.tensors()) {
    if (starts_with(key, "optimizer.") || starts_with(key, "lr_scheduler.") || starts_with(key, "train_state.") ||
        starts_with(key, "dataloader."))
      continue;
    if (!starts_with(key, "model.")) return "";
    any = true;
  }
  return any ? "model." : "";
}

}  // namespace titan::checkpoint::torch_dcp
