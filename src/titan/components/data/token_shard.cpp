#include "titan/components/data/token_shard.h"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::data {

namespace {
constexpr size_t kHeaderBytes = 64;

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

void write_all(FILE* f, const void* data, size_t n, const std::string& path) {
  if (n && std::fwrite(data, 1, n, f) != n) fail("cannot write ", quote(path), ": ", std::strerror(errno));
}
}  // namespace

TokenShardWriter::TokenShardWriter(std::string path, uint64_t vocab_size, int64_t bos_id, int64_t eos_id)
    : path_(std::move(path)), partial_(path_ + ".partial") {
  header_.vocab_size = vocab_size;
  header_.token_bytes = vocab_size <= 65536 ? 2 : 4;
  header_.bos_id = bos_id;
  header_.eos_id = eos_id;
  std::error_code ec;
  const auto parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  file_ = std::fopen(partial_.c_str(), "wb");
  if (!file_) fail("cannot create ", quote(partial_), ": ", std::strerror(errno));
  unsigned char zeros[kHeaderBytes] = {};
  write_all(file_, zeros, kHeaderBytes, partial_);
}

TokenShardWriter::~TokenShardWriter() {
  if (file_) {
    std::fclose(file_);
    std::remove(partial_.c_str());
  }
}

void TokenShardWriter::add(const std::vector<int32_t>& document) {
  if (header_.token_bytes == 2) {
    std::vector<uint16_t> narrow(document.size());
    for (size_t i = 0; i < document.size(); ++i) narrow[i] = static_cast<uint16_t>(document[i]);
    write_all(file_, narrow.data(), narrow.size() * 2, partial_);
  } else {
    write_all(file_, document.data(), document.size() * 4, partial_);
  }
  offsets_.push_back(offsets_.back() + document.size());
}

void TokenShardWriter::finish() {
  write_all(file_, offsets_.data(), offsets_.size() * 8, partial_);
  header_.num_docs = offsets_.size() - 1;
  header_.num_tokens = offsets_.back();
  unsigned char h[kHeaderBytes] = {};
  std::memcpy(h, TokenShardHeader::kMagic, 8);
  put_u32(h + 8, header_.version);
  put_u32(h + 12, header_.token_bytes);
  put_u64(h + 16, header_.vocab_size);
  put_u64(h + 24, header_.num_docs);
  put_u64(h + 32, header_.num_tokens);
  put_u64(h + 40, static_cast<uint64_t>(header_.bos_id));
  put_u64(h + 48, static_cast<uint64_t>(header_.eos_id));
  if (std::fseek(file_, 0, SEEK_SET) != 0) fail("cannot seek in ", quote(partial_));
  write_all(file_, h, kHeaderBytes, partial_);
  if (std::fflush(file_) != 0 || std::fclose(file_) != 0) {
    file_ = nullptr;
    std::remove(partial_.c_str());
    fail("cannot write ", quote(partial_), ": ", std::strerror(errno));
  }
  file_ = nullptr;
  std::error_code ec;
  std::filesystem::rename(partial_, path_, ec);
  if (ec) fail("cannot rename ", quote(partial_), " to ", quote(path_), ": ", ec.message());
}

TokenShardReader::TokenShardReader(std::string path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "rb");
  if (!file_) fail("cannot open token shard ", quote(path_), ": ", std::strerror(errno));
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path_, ec);
  unsigned char h[kHeaderBytes];
  if (ec || size < kHeaderBytes || std::fread(h, 1, kHeaderBytes, file_) != kHeaderBytes)
    fail(quote(path_), ": not a token shard: shorter than its ", kHeaderBytes, "-byte header");
  if (std::memcmp(h, TokenShardHeader::kMagic, 8) != 0)
    fail(quote(path_), ": not a token shard (bad magic at byte 0; expected \"TITANTOK\", written by `titan data tokenize`)");
  header_.version = get_u32(h + 8);
  if (header_.version != TokenShardHeader::kVersion)
    fail(quote(path_), ": token shard version ", header_.version, " at byte 8; this build reads version ",
         TokenShardHeader::kVersion);
  header_.token_bytes = get_u32(h + 12);
  if (header_.token_bytes != 2 && header_.token_bytes != 4)
    fail(quote(path_), ": token width ", header_.token_bytes, " at byte 12; expected 2 or 4");
  header_.vocab_size = get_u64(h + 16);
  header_.num_docs = get_u64(h + 24);
  header_.num_tokens = get_u64(h + 32);
  header_.bos_id = static_cast<int64_t>(get_u64(h + 40));
  header_.eos_id = static_cast<int64_t>(get_u64(h + 48));
  const uint64_t tokens_end = kHeaderBytes + header_.num_tokens * header_.token_bytes;
  const uint64_t expected = tokens_end + (header_.num_docs + 1) * 8;
  if (header_.num_docs > size || header_.num_tokens > size || size != expected)
    fail(quote(path_), ": truncated or corrupt token shard: ", size, " bytes, but its header (", header_.num_docs,
         " documents, ", header_.num_tokens, " tokens of ", header_.token_bytes, " bytes) needs ", expected);
  offsets_.resize(header_.num_docs + 1);
  if (std::fseek(file_, static_cast<long>(tokens_end), SEEK_SET) != 0 ||
      std::fread(offsets_.data(), 8, offsets_.size(), file_) != offsets_.size())
    fail(quote(path_), ": cannot read the document offsets at byte ", tokens_end);
  for (size_t i = 0; i + 1 < offsets_.size(); ++i)
    if (offsets_[i] > offsets_[i + 1] || offsets_[i + 1] > header_.num_tokens)
      fail(quote(path_), ": corrupt document offset table at byte ", tokens_end + 8 * (i + 1));
  if (offsets_.front() != 0 || offsets_.back() != header_.num_tokens)
    fail(quote(path_), ": corrupt document offset table at byte ", tokens_end);
}

TokenShardReader::~TokenShardReader() {
  if (file_) std::fclose(file_);
}

std::vector<int32_t> TokenShardReader::document(uint64_t index) {
  const uint64_t begin = offsets_.at(index), end = offsets_.at(index + 1);
  std::vector<int32_t> out(end - begin);
  if (std::fseek(file_, static_cast<long>(kHeaderBytes + begin * header_.token_bytes), SEEK_SET) != 0)
    fail("cannot seek in ", quote(path_));
  if (header_.token_bytes == 2) {
    std::vector<uint16_t> narrow(out.size());
    if (std::fread(narrow.data(), 2, narrow.size(), file_) != narrow.size()) fail("cannot read ", quote(path_));
    for (size_t i = 0; i < narrow.size(); ++i) out[i] = narrow[i];
  } else if (std::fread(out.data(), 4, out.size(), file_) != out.size()) {
    fail("cannot read ", quote(path_));
  }
  // An id past the vocabulary would index past the embedding table: name where it is.
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i] < 0 || static_cast<uint64_t>(out[i]) >= header_.vocab_size)
      fail(quote(path_), ": token id ", static_cast<uint32_t>(out[i]), " at byte offset ",
           kHeaderBytes + (begin + i) * header_.token_bytes, " (document ", index, ") is outside the shard's vocabulary of ",
           header_.vocab_size, " ids; the file is damaged or was not written by `titan data tokenize`");
  return out;
}

}  // namespace titan::data
