// The distributed checkpoint format: one directory per step; every rank writes its own data file of raw tensor
// rows; rank 0 writes metadata.json last (every tensor's dtype and global shape, which byte ranges of which file
// hold which rows, and a CRC-32 and size per file) and only then renames the directory into place. A directory
// without metadata.json is incomplete and never loaded. See docs/checkpoint.md.
#pragma once
#include <ATen/ATen.h>

#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace titan::checkpoint {

struct Piece {
  std::string file;
  uint64_t offset = 0, bytes = 0;
  int64_t row_begin = 0, row_end = 0;  // global rows held (dim 0; a 0-d tensor is one row)
};

struct TensorEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

std::string dtype_string(at::ScalarType dtype);
at::ScalarType parse_dtype(const std::string& name, const std::string& where);

// Writes one rank's data file. Tensors are copied to the CPU and written row range by row range.
class RankWriter {
 public:
  RankWriter(const std::string& directory, int rank);
  ~RankWriter();
  // `local` holds global rows [row_begin, row_begin + local.size(0)) of a tensor of `global_shape`.
  void add(const std::string& key, const at::Tensor& local, int64_t row_begin, const std::vector<int64_t>& global_shape);
  // Flushes and fsyncs; returns this rank's part of the metadata: {"files": {...}, "tensors": {...}}.
  nlohmann::json finish();

 private:
  void write(const void* data, size_t n);
  std::string directory_, name_, path_;
  int rank_ = 0;
  FILE* file_ = nullptr;
  uint64_t written_ = 0;
  uint32_t crc_ = 0;
  nlohmann::json tensors_ = nlohmann::json::object();
};

// The fields every checkpoint's metadata starts with (format name and version, step, layout, flavor).
nlohmann::json metadata_header(int64_t step, bool model_only, int world_size, const std::string& flavor);

// Merges ranks' parts into the metadata document (tensors' pieces concatenated, files listed).
nlohmann::json merge_rank_parts(const std::vector<nlohmann::json>& parts);

// Writes metadata.json into `partial_directory` (fsynced) and renames the directory to `final_directory`.
void commit(const std::string& partial_directory, const std::string& final_directory, const nlohmann::json& metadata);

// A complete checkpoint opened for reading. Files are checked (size and CRC-32) the first time they are read.
class Reader {
 public:
  // Throws UserError when the directory has no metadata.json (incomplete) or the metadata is malformed.
  explicit Reader(std::string directory);
  const nlohmann::json& metadata() const { return metadata_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  bool contains(const std::string& key) const { return tensors_.count(key) != 0; }
  // Fills `out` (any device) with global rows [row_begin, row_begin + out.size(0)) of `key`; the dtype and the
  // trailing shape must match. Throws UserError naming the tensor when rows are missing.
  void read_rows(const std::string& key, int64_t row_begin, at::Tensor out);
  const std::string& directory() const { return directory_; }

 private:
  void verify(const std::string& file);
  std::string directory_;
  nlohmann::json metadata_;
  std::map<std::string, TensorEntry> tensors_;
  std::set<std::string> verified_;
};

}  // namespace titan::checkpoint
