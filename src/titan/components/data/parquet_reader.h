// ParquetTextReader: one string column of a Parquet file (Hugging Face datasets' format), a row group at a time,
// through Apache Arrow C++ (the libraries and headers the PyPI pyarrow wheel ships). Builds without Arrow report
// that Parquet is unavailable.
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

}  // namespace titan::data
