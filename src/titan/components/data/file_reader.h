// FileReader: sequential reading of plain, gzip (.gz, dictzip .dz) and zstd (.zst) files, by lines or whole,
// with the line number and uncompressed byte offset of each line for error messages and fast resume.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace titan::data {

enum class Compression { None, Gzip, Zstd };

// From the file name's last extension: .gz / .dz -> Gzip, .zst / .zstd -> Zstd, else None.
Compression compression_of(const std::string& path);
// The name without a compression extension ("a.jsonl.zst" -> "a.jsonl").
std::string strip_compression_extension(const std::string& path);

class FileReader {
 public:
  // Throws UserError when the file cannot be opened.
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  // The next line without its '\n' (a trailing '\r' is kept); false at the end of the file. Throws UserError on
  // corrupt or truncated compressed data, naming the file and the compressed byte offset.
  bool next_line(std::string& line);
  // Everything from the current position to the end.
  std::string read_rest();
  // Line number (1-based) and uncompressed byte offset of the line last returned by next_line().
  uint64_t line_number() const { return line_number_; }
  uint64_t line_offset() const { return line_offset_; }
  // Position after the last returned line (where the next line starts).
  uint64_t offset() const { return consumed_; }
  // Continues at an uncompressed byte offset / line number recorded earlier. Plain files seek; compressed files
  // decompress and discard up to the offset.
  void seek(uint64_t offset, uint64_t line_number);
  const std::string& path() const { return path_; }

 private:
  bool fill();  // reads more decompressed bytes into buffer_; false at the end
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  std::string buffer_;
  size_t buffer_pos_ = 0;
  uint64_t consumed_ = 0;  // uncompressed bytes handed out (lines + newlines)
  uint64_t line_number_ = 0, line_offset_ = 0;
  bool eof_ = false;
};

}  // namespace titan::data
