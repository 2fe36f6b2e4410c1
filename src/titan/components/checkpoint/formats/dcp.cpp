#include "titan/components/checkpoint/formats/dcp.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "titan/common/checksum.h"
#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/strings.h"
#include "titan/common/test_faults.h"
#include "titan/config/dtypes.h"

namespace titan::checkpoint {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "titan-dcp";
constexpr const char* kChecksumKey = "metadata_crc32";
// Version 4 gives every piece its own CRC-32 ("crc32"), so that a reader checks exactly the bytes it reads, once.
// Version 3 adds metadata_crc32, the CRC-32 of the metadata's compact key-sorted JSON without that key. Version 2:
// pieces are boxes ({"offsets": [...], "lengths": [...]}); version 1 had dim-0 rows ("rows": [a, b]).
constexpr int kVersion = 4;

// Crash tests kill a rank at chosen points of a save (common/test_faults.h: TITAN_TEST_CHECKPOINT_CRASH).
void crash_now() {
  std::fflush(nullptr);
  std::raise(SIGKILL);
}


}  // namespace

std::string dtype_string(at::ScalarType dtype) { return titan::config::dtype_name(dtype); }

at::ScalarType parse_dtype(const std::string& name, const std::string& where) { return titan::config::dtype_from_name(name, where); }

RankWriter::RankWriter(const std::string& directory, int rank)
    : directory_(directory), name_(strprintf("rank-%05d.bin", rank)), path_(directory + "/" + name_), rank_(rank) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create checkpoint file ", quote(path_), ": ", std::strerror(errno));
}

RankWriter::~RankWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void RankWriter::write(const void* data, size_t n) {
  const auto& plan = test_faults::checkpoint_crash();
  if (plan.after_bytes >= 0 && plan.applies_to(rank_) && written_ + n > static_cast<uint64_t>(plan.after_bytes)) {
    const size_t part = static_cast<size_t>(static_cast<uint64_t>(plan.after_bytes) - written_);
    if (part > 0 && ::write(fd_, data, part) < 0) std::perror("checkpoint crash test");
    crash_now();
  }
  const char* p = static_cast<const char*>(data);
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::write(fd_, p + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      fail("cannot write checkpoint file ", quote(path_), ": ", w < 0 ? std::strerror(errno) : "no progress",
           w < 0 && (errno == ENOSPC || errno == EDQUOT) ? " (the disk is full; the previous checkpoint is untouched)" : "");
    done += static_cast<size_t>(w);
  }
  written_ += n;
#ifdef __linux__
  // Start writing the file out while the rest is still being produced, so that the fsync in finish() waits for
  // the last few megabytes only instead of the whole file. A hint: file systems that refuse it lose nothing.
  constexpr uint64_t kWriteBehind = 32ull << 20;
  if (written_ - started_ >= kWriteBehind) {
    ::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(written_ - started_), SYNC_FILE_RANGE_WRITE);
    started_ = written_;
  }
#endif
}

void RankWriter::add(const std::string& key, const at::Tensor& local, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& global_shape) {
  at::Tensor cpu = local.detach().to(at::kCPU).contiguous();
  if (cpu.dim() != static_cast<int64_t>(global_shape.size()) || offsets.size() != global_shape.size())
    fail("checkpoint: piece of ", key, " has ", cpu.dim(), " dimensions, the tensor ", global_shape.size());
  Piece piece{name_, written_, static_cast<uint64_t>(cpu.nbytes()), distributed::Box{offsets, cpu.sizes().vec()}, {}};
  // Written in slices of 8 MiB (a crash test can stop inside one), each added to the piece's CRC-32 while it is
  // still in the cache; the file's CRC-32 is the pieces' combined.
  const auto* bytes = static_cast<const char*>(cpu.data_ptr());
  uint32_t crc = crc32_update(0, nullptr, 0);
  for (uint64_t done = 0; done < piece.bytes;) {
    const uint64_t n = std::min<uint64_t>(piece.bytes - done, 8ull << 20);
    crc = crc32_update(crc, bytes + done, n);
    write(bytes + done, n);
    done += n;
  }
  crc_ = crc32_concat(crc_, crc, piece.bytes);
  auto& entry = tensors_[key];
  entry["dtype"] = dtype_string(cpu.scalar_type());
  entry["shape"] = global_shape;
  entry["pieces"].push_back({{"file", piece.file}, {"offset", piece.offset}, {"bytes", piece.bytes}, {"crc32", crc},
                             {"box", {{"offsets", piece.box.offsets}, {"lengths", piece.box.lengths}}}});
}

nlohmann::json RankWriter::finish() {
  if (::fsync(fd_) != 0)
    fail("cannot write checkpoint file ", quote(path_), ": ", std::strerror(errno),
         errno == ENOSPC || errno == EDQUOT ? " (the disk is full; the previous checkpoint is untouched)" : "");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("cannot write checkpoint file ", quote(path_), ": ", std::strerror(errno));
  nlohmann::json out;
  out["files"][name_] = {{"bytes", written_}, {"crc32", crc_}};
  out["tensors"] = tensors_;
  return out;
}

nlohmann::json metadata_header(int64_t step, bool model_only, int world_size, const std::string& flavor) {
  return {{"format", kFormat}, {"version", kVersion}, {"step", step}, {"model_only", model_only},
          {"world_size", world_size}, {"flavor", flavor}};
}

nlohmann::json merge_rank_parts(const std::vector<nlohmann::json>& parts) {
  nlohmann::json merged;
  merged["files"] = nlohmann::json::object();
  merged["tensors"] = nlohmann::json::object();
  for (const auto& part : parts) {
    for (const auto& [name, info] : part.at("files").items()) merged["files"][name] = info;
    for (const auto& [key, entry] : part.at("tensors").items()) {
      auto& m = merged["tensors"][key];
      if (m.is_null()) {
        m = entry;
      } else {
        for (const auto& piece : entry.at("pieces")) m["pieces"].push_back(piece);
      }
    }
  }
  return merged;
}

namespace {

uint32_t metadata_checksum(const nlohmann::json& metadata) {
  nlohmann::json rest = metadata;
  rest.erase(kChecksumKey);
  const std::string canonical = rest.dump();  // compact, keys sorted, UTF-8 unescaped
  return static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(canonical.data()),
                                     static_cast<uInt>(canonical.size())));
}

}  // namespace

void commit(const std::string& partial_directory, const std::string& final_directory, const nlohmann::json& metadata) {
  if (test_faults::checkpoint_crash().at == "before_metadata" && test_faults::checkpoint_crash().applies_to(0)) crash_now();
  nlohmann::json sealed = metadata;
  sealed[kChecksumKey] = metadata_checksum(metadata);
  write_file(partial_directory + "/metadata.json", sealed.dump(1) + "\n", /*durable=*/true);
  fsync_path(partial_directory, true);
  if (test_faults::checkpoint_crash().at == "before_rename" && test_faults::checkpoint_crash().applies_to(0)) crash_now();
  std::error_code ec;
  fs::rename(partial_directory, final_directory, ec);
  if (ec) fail("cannot rename ", quote(partial_directory), " to ", quote(final_directory), ": ", ec.message());
  fsync_path(fs::path(final_directory).parent_path().string(), true);
}

namespace {

// What a path without metadata.json is, and what to do with it: the formats users bring, named with the command or
// key that reads them.
[[noreturn]] void refuse_non_titan(const std::string& where) {
  const fs::path p(where);
  std::error_code ec;
  if (!fs::exists(p, ec)) fail("checkpoint ", quote(where), " does not exist");
  auto has = [&](auto&& predicate) {
    for (const auto& entry : fs::directory_iterator(p, ec))
      if (predicate(entry.path())) return true;
    return false;
  };
  const std::string convert = cat("`titan convert --from ", where, " --to <folder> --flavor <flavor>` converts it into a "
                                  "titan checkpoint to load from");
  if (fs::is_regular_file(p, ec)) {
    const std::string ext = p.extension().string();
    if (ext == ".safetensors")
      fail(quote(where), " is a safetensors file, not a titan checkpoint folder; for Hugging Face weights set "
           "checkpoint.initial_load_in_hf = true with the folder that holds it (and its config.json)");
    std::ifstream f(where, std::ios::binary);
    char magic[4] = {};
    f.read(magic, 4);
    if (ext == ".pt" || ext == ".pth" || std::string(magic, 4) == std::string("PK\x03\x04", 4))
      fail(quote(where), " is a torch.save file (a state dict), not a titan checkpoint folder; ", convert);
    fail(quote(where), " is a file, not a titan checkpoint folder (step-N/ with metadata.json)");
  }
  if (!fs::exists(p / ".metadata") && has([](const fs::path& f) { return f.extension() == ".distcp"; }))
    fail(quote(where), " holds torch.distributed.checkpoint (DCP) data files (*.distcp) but no ", quote((p / ".metadata").string()),
         ", the index DCP writes last: an incomplete save, or a copy that left out the hidden file");
  if (fs::exists(p / ".metadata") || has([](const fs::path& f) { return f.extension() == ".distcp"; }))
    fail(quote(where), " is a torch.distributed.checkpoint (DCP) folder, as torchtitan saves; titan loads it as "
         "checkpoint.initial_load_path, or as a step-N folder in checkpoint.folder, or `titan convert --from ", where,
         " --to <folder> --flavor <flavor>` converts its weights");
  if (fs::exists(p / "config.json") && has([](const fs::path& f) { return f.extension() == ".safetensors"; }))
    fail(quote(where), " is a Hugging Face model folder; set checkpoint.initial_load_in_hf = true to start from it, or ", convert);
  if (has([](const fs::path& f) { return f.extension() == ".pth" || f.extension() == ".pt"; }))
    fail(quote(where), " holds torch.save files (Meta's consolidated.*.pth layout?), not a titan checkpoint; ", convert);
  if (has([](const fs::path& f) { return f.filename().string().rfind("step-", 0) == 0; }))
    fail(quote(where), " is a folder of checkpoints; name one of its step-N folders (or set checkpoint.folder to load the newest)");
  if (has([](const fs::path& f) { return f.filename().string().rfind("rank-", 0) == 0; }))
    fail("checkpoint ", quote(where), " is incomplete: it has no metadata.json (a save that did not finish)");
  fail(quote(where), " is not a titan checkpoint: it has no metadata.json (expected a step-N folder that titan saved)");
}

}  // namespace

Reader::Reader(std::string directory) : directory_(std::move(directory)) {
  const std::string path = directory_ + "/metadata.json";
  std::ifstream in(path);
  if (!in) refuse_non_titan(directory_);
  try {
    metadata_ = nlohmann::json::parse(in);
    const int version = metadata_.at("version").get<int>();
    if (metadata_.at("format").get<std::string>() != kFormat || version < 1 || version > kVersion)
      fail(path, ": not a titan.cpp checkpoint of version 1 to ", kVersion, " (format ", metadata_.at("format").dump(),
           ", version ", version, "); a newer titan wrote it, or it is not a titan checkpoint");
    // Versions before 3 carry no checksum of their own; their data files are still checked by CRC-32.
    if (version >= 3) {
      if (!metadata_.contains(kChecksumKey)) fail(path, ": the metadata has no ", kChecksumKey, " (version ", version, ")");
      const auto stored = metadata_.at(kChecksumKey).get<uint32_t>();
      const uint32_t computed = metadata_checksum(metadata_);
      if (stored != computed)
        fail(path, ": the metadata fails its checksum (", kChecksumKey, " ", stored, ", computed ", computed,
             "): it was changed or damaged after titan wrote it, so its offsets and shapes cannot be trusted; "
             "load an older step-N (checkpoint.load_step) or restore the file");
    }
    for (const auto& [key, entry] : metadata_.at("tensors").items()) {
      TensorEntry t;
      t.dtype = parse_dtype(entry.at("dtype").get<std::string>(), path + " (" + key + ")");
      t.shape = entry.at("shape").get<std::vector<int64_t>>();
      for (const auto& p : entry.at("pieces")) {
        Piece piece{p.at("file").get<std::string>(), p.at("offset").get<uint64_t>(), p.at("bytes").get<uint64_t>(), {}, {}};
        if (p.contains("crc32")) piece.crc32 = p["crc32"].get<uint32_t>();
        if (p.contains("box")) {
          piece.box.offsets = p["box"].at("offsets").get<std::vector<int64_t>>();
          piece.box.lengths = p["box"].at("lengths").get<std::vector<int64_t>>();
        } else {
          // Version 1: rows [a, b) of dim 0 (a 0-d tensor is one row).
          auto rows = p.at("rows").get<std::vector<int64_t>>();
          if (!t.shape.empty()) {
            piece.box = distributed::Box::whole(t.shape);
            piece.box.offsets[0] = rows.at(0);
            piece.box.lengths[0] = rows.at(1) - rows.at(0);
          }
        }
        if (piece.box.offsets.size() != t.shape.size() || piece.box.lengths.size() != t.shape.size())
          fail(path, ": a piece of ", key, " does not have one offset and length per dimension");
        for (size_t d = 0; d < t.shape.size(); ++d)
          if (piece.box.offsets[d] < 0 || piece.box.lengths[d] < 0 || piece.box.offsets[d] + piece.box.lengths[d] > t.shape[d])
            fail(path, ": a piece of ", key, " lies outside the tensor's shape");
        const uint64_t expected = static_cast<uint64_t>(piece.box.numel()) * c10::elementSize(t.dtype);
        if (piece.bytes != expected) fail(path, ": a piece of ", key, " has ", piece.bytes, " bytes, its box needs ", expected);
        t.pieces.push_back(std::move(piece));
      }
      tensors_[key] = std::move(t);
    }
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": malformed checkpoint metadata: ", e.what());
  }
}

Reader::~Reader() {
  for (const auto& [file, fd] : fds_) ::close(fd);
}

int Reader::open_file(const std::string& file) {
  auto it = fds_.find(file);
  if (it != fds_.end()) return it->second;
  const std::string path = directory_ + "/" + file;
  const auto& info = metadata_.at("files").contains(file) ? metadata_["files"][file] : nlohmann::json();
  if (info.is_null()) fail("checkpoint ", quote(directory_), ": metadata names no file ", quote(file));
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) fail("checkpoint file ", quote(path), " is missing");
  if (size != info.at("bytes").get<uint64_t>())
    fail("checkpoint file ", quote(path), " has ", size, " bytes, but the metadata says ", info["bytes"].get<uint64_t>(),
         " (truncated or changed)");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open checkpoint file ", quote(path), ": ", std::strerror(errno));
#ifdef __linux__
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a larger read-ahead: pieces are read front to back
#endif
  fds_[file] = fd;
  return fd;
}

void Reader::read_bytes(const std::string& file, uint64_t offset, uint64_t n, void* out) {
  const int fd = open_file(file);
  auto* p = static_cast<char*>(out);
  for (uint64_t done = 0; done < n;) {
    const ssize_t r = ::pread(fd, p + done, static_cast<size_t>(std::min<uint64_t>(n - done, 1ull << 30)),
                              static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      fail("cannot read ", n, " bytes at ", offset, " of checkpoint file ", quote(directory_ + "/" + file), ": ",
           r < 0 ? std::strerror(errno) : "the file ends first");
    done += static_cast<uint64_t>(r);
  }
}

void Reader::verify(const std::string& file) {
  if (verified_.count(file)) return;
  const uint64_t size = metadata_["files"][file].at("bytes").get<uint64_t>();
  open_file(file);
  std::vector<char> buffer(4u << 20);
  uint32_t crc = crc32_update(0, nullptr, 0);
  for (uint64_t done = 0; done < size;) {
    const uint64_t n = std::min<uint64_t>(size - done, buffer.size());
    read_bytes(file, done, n, buffer.data());
    crc = crc32_update(crc, buffer.data(), n);
    done += n;
  }
  if (crc != metadata_["files"][file].at("crc32").get<uint32_t>())
    fail("checkpoint file ", quote(directory_ + "/" + file), " fails its CRC-32 check (corrupt); the checkpoint cannot be loaded");
  verified_.insert(file);
}

void Reader::read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) {
  auto it = tensors_.find(key);
  if (it == tensors_.end()) fail("checkpoint ", quote(directory_), " has no tensor ", quote(key));
  const TensorEntry& t = it->second;
  const distributed::Box want{offsets, out.sizes().vec()};
  if (want.offsets.size() != t.shape.size() || want.lengths.size() != t.shape.size())
    fail("checkpoint tensor ", quote(key), " has ", t.shape.size(), " dimensions; asked for a box of ", want.lengths.size());
  for (size_t d = 0; d < t.shape.size(); ++d)
    if (want.offsets[d] < 0 || want.offsets[d] + want.lengths[d] > t.shape[d])
      fail("checkpoint tensor ", quote(key), " of shape [", join_ints(t.shape), "]: box ", want.str(), " is out of range");
  if (want.empty()) return;
  // Bytes go straight into `out` when a read covers exactly its box in its dtype on the CPU; otherwise through a
  // block on the CPU from which the overlap is copied (and converted).
  const bool out_direct = out.is_cpu() && out.is_contiguous() && out.scalar_type() == t.dtype;
  const int64_t element = static_cast<int64_t>(c10::elementSize(t.dtype));
  int64_t covered = 0;
  for (const Piece& p : t.pieces) {
    auto common = want.intersect(p.box);
    if (!common && !t.shape.empty()) continue;
    // A piece with its own CRC-32 (version 4) is checked the first time it is read, whole; older checkpoints'
    // files are checked whole the first time any piece of them is read.
    const bool check_piece = p.crc32 && !verified_pieces_.count({p.file, p.offset});
    if (!p.crc32) verify(p.file);
    // The piece's dim-0 rows that hold the overlap are one contiguous byte range (all of them when checking).
    distributed::Box block_box = p.box;
    uint64_t offset = p.offset, n = p.bytes;
    if (!t.shape.empty() && !check_piece) {
      const int64_t row_bytes = p.box.numel() / std::max<int64_t>(p.box.lengths[0], 1) * element;
      offset += static_cast<uint64_t>((common->offsets[0] - p.box.offsets[0]) * row_bytes);
      n = static_cast<uint64_t>(common->lengths[0] * row_bytes);
      block_box.offsets[0] = common->offsets[0];
      block_box.lengths[0] = common->lengths[0];
    }
    const bool direct = out_direct && block_box.offsets == want.offsets && block_box.lengths == want.lengths;
    at::Tensor block = direct ? out : at::empty(block_box.lengths, at::TensorOptions().dtype(t.dtype));
    read_bytes(p.file, offset, n, block.data_ptr());
    if (check_piece) {
      if (crc32_update(0, block.data_ptr(), n) != *p.crc32)
        fail("checkpoint file ", quote(directory_ + "/" + p.file), " fails its CRC-32 check (corrupt) in the ", n,
             " bytes at ", offset, " that hold ", quote(key), "; the checkpoint cannot be loaded");
      verified_pieces_.insert({p.file, p.offset});
    }
    if (t.shape.empty()) {
      if (!direct) out.copy_(block);
      covered = 1;
      break;
    }
    if (!direct) {
      at::Tensor source = block, target = out;
      for (size_t d = 0; d < t.shape.size(); ++d) {
        const auto dim = static_cast<int64_t>(d);
        source = source.narrow(dim, common->offsets[d] - block_box.offsets[d], common->lengths[d]);
        target = target.narrow(dim, common->offsets[d] - want.offsets[d], common->lengths[d]);
      }
      target.copy_(source);
    }
    covered += common->numel();
  }
  if (covered != want.numel())
    fail("checkpoint tensor ", quote(key), ": box ", want.str(), " is not all in the checkpoint (", covered, " of ",
         want.numel(), " elements found)");
}

}  // namespace titan::checkpoint
