// The distributed checkpoint format: one directory per step; every rank writes its own data file of raw tensor
// pieces; rank 0 writes metadata.json last (every tensor's dtype and global shape, which byte ranges of which file
// hold which n-dimensional box of it, and a CRC-32 and size per file) and only then renames the directory into
// place. A directory without metadata.json is incomplete and never loaded. Version 1 checkpoints (pieces of dim-0
// rows) still load. See docs/checkpoint.md.
#pragma once
#include <ATen/ATen.h>

#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "titan/distributed/placement.h"

namespace titan::checkpoint {

struct Piece {
  std::string file;
  uint64_t offset = 0, bytes = 0;
  distributed::Box box;  // the part of the global tensor held, stored contiguously (row-major) at offset
  std::optional<uint32_t> crc32;  // of its bytes (version 4; older checkpoints have one per file only)
};

struct TensorEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

std::string dtype_string(at::ScalarType dtype);
at::ScalarType parse_dtype(const std::string& name, const std::string& where);

// Writes one rank's data file: each piece's bytes (copied to the CPU first if they are elsewhere), with the piece's
// CRC-32 in its metadata and the whole file's in the file's entry.
class RankWriter {
 public:
  RankWriter(const std::string& directory, int rank);
  ~RankWriter();
  // `local` is the box of a tensor of `global_shape` that starts at `offsets` (its shape gives the lengths).
  void add(const std::string& key, const at::Tensor& local, const std::vector<int64_t>& offsets,
           const std::vector<int64_t>& global_shape);
  // Flushes and fsyncs; returns this rank's part of the metadata: {"files": {...}, "tensors": {...}}.
  nlohmann::json finish();

 private:
  void write(const void* data, size_t n);
  std::string directory_, name_, path_;
  int rank_ = 0;
  int fd_ = -1;
  uint64_t written_ = 0, started_ = 0;  // bytes written; bytes whose write-out was started
  uint32_t crc_ = 0;
  nlohmann::json tensors_ = nlohmann::json::object();
};

// The fields every checkpoint's metadata starts with (format name and version, step, layout, flavor).
nlohmann::json metadata_header(int64_t step, bool model_only, int world_size, const std::string& flavor);

// Merges ranks' parts into the metadata document (tensors' pieces concatenated, files listed).
nlohmann::json merge_rank_parts(const std::vector<nlohmann::json>& parts);

// Writes metadata.json into `partial_directory` (fsynced) and renames the directory to `final_directory`.
void commit(const std::string& partial_directory, const std::string& final_directory, const nlohmann::json& metadata);

// A complete checkpoint opened for reading. A file's size is checked when it is first opened; a piece's CRC-32 the
// first time it is read (files without per-piece CRCs, versions 1-3: the whole file's, then).
class Reader {
 public:
  // Throws UserError when the directory has no metadata.json (incomplete) or the metadata is malformed.
  explicit Reader(std::string directory);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;
  const nlohmann::json& metadata() const { return metadata_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  bool contains(const std::string& key) const { return tensors_.count(key) != 0; }
  // Fills `out` (any device and dtype; shaped like the box) with the box of `key` that starts at `offsets`, reading
  // only the pieces that overlap it. Throws UserError naming the tensor when part of the box is in no piece.
  void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out);
  const std::string& directory() const { return directory_; }

 private:
  int open_file(const std::string& file);  // once per file, its size checked
  void read_bytes(const std::string& file, uint64_t offset, uint64_t n, void* out);
  void verify(const std::string& file);  // the whole file's CRC-32
  std::string directory_;
  nlohmann::json metadata_;
  std::map<std::string, TensorEntry> tensors_;
  std::map<std::string, int> fds_;
  std::set<std::string> verified_;
  std::set<std::pair<std::string, uint64_t>> verified_pieces_;  // (file, offset)
};

}  // namespace titan::checkpoint
