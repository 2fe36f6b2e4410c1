// One string column of a columnar file, through Apache Arrow C++ (the libraries and headers the PyPI pyarrow wheel
// ships): ParquetTextReader reads Parquet (the Hugging Face Hub's format) a row group at a time; ArrowTextReader
// reads Arrow IPC files (Hugging Face `datasets`' save_to_disk folders and cache: the stream format; and the file
// format), memory-mapped. Builds without Arrow report that these formats are unavailable.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace titan::data {

// Whether this build can read Parquet.
bool parquet_supported();

class ParquetTextReader {
 public:
  // Throws UserError when the file is not Parquet or has no string column `column` (listing the columns).
  ParquetTextReader(const std::string& path, const std::string& column);
  ~ParquetTextReader();
  uint64_t num_rows() const;
  // Row `index` into `text`; `is_null` when the value is missing. Sequential reads load each row group once;
  // a jump loads only the row group holding the row. False past the last row.
  bool read(uint64_t index, std::string& text, bool& is_null);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Arrow IPC, stream or file format (told apart by the file format's "ARROW1" magic), memory-mapped: the record
// batches' metadata is read at open, the text is read from the mapping only when a row is asked for.
class ArrowTextReader {
 public:
  // Throws UserError when the file is not Arrow IPC or has no string column `column` (listing the columns).
  ArrowTextReader(const std::string& path, const std::string& column);
  ~ArrowTextReader();
  uint64_t num_rows() const;
  bool read(uint64_t index, std::string& text, bool& is_null);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace titan::data
