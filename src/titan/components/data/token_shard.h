// Pre-tokenized token shards (".tokens" files): a 64-byte versioned header, the documents' tokens (uint16 or
// uint32, little-endian) back to back, then num_docs + 1 uint64 document start offsets. See docs/data.md.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace titan::data {

struct TokenShardHeader {
  static constexpr char kMagic[8] = {'T', 'I', 'T', 'A', 'N', 'T', 'O', 'K'};
  static constexpr uint32_t kVersion = 1;
  uint32_t version = kVersion;
  uint32_t token_bytes = 4;  // 2 or 4
  uint64_t vocab_size = 0;
  uint64_t num_docs = 0;
  uint64_t num_tokens = 0;
  int64_t bos_id = -1, eos_id = -1;  // of the tokenizer that wrote the shard; -1 = none
};

// Writes a shard; the file appears under its final name only when finish() succeeds (written as "<path>.partial",
// then renamed), so an interrupted run never leaves a shard that looks complete.
class TokenShardWriter {
 public:
  TokenShardWriter(std::string path, uint64_t vocab_size, int64_t bos_id, int64_t eos_id);
  ~TokenShardWriter();
  void add(const std::vector<int32_t>& document);
  void finish();
  uint64_t num_docs() const { return offsets_.size() - 1; }
  uint64_t num_tokens() const { return offsets_.back(); }

 private:
  std::string path_, partial_;
  FILE* file_ = nullptr;
  TokenShardHeader header_;
  std::vector<uint64_t> offsets_{0};
};

// Reads documents of one shard. The header and the offsets table are validated on open against the file size, so
// a truncated shard is reported before any of it is used.
class TokenShardReader {
 public:
  explicit TokenShardReader(std::string path);
  ~TokenShardReader();
  TokenShardReader(const TokenShardReader&) = delete;
  TokenShardReader& operator=(const TokenShardReader&) = delete;
  const TokenShardHeader& header() const { return header_; }
  uint64_t num_docs() const { return header_.num_docs; }
  std::vector<int32_t> document(uint64_t index);

 private:
  std::string path_;
  FILE* file_ = nullptr;
  TokenShardHeader header_;
  std::vector<uint64_t> offsets_;
};

}  // namespace titan::data
