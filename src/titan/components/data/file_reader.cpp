#include "titan/components/data/file_reader.h"

#include <zlib.h>
#include <zstd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::data {

namespace {
constexpr size_t kChunk = 1 << 18;

std::string lower_extension(const std::string& path) {
  auto slash = path.find_last_of('/');
  auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  return to_lower(path.substr(dot));
}
}  // namespace

Compression compression_of(const std::string& path) {
  std::string ext = lower_extension(path);
  if (ext == ".gz" || ext == ".dz") return Compression::Gzip;
  if (ext == ".zst" || ext == ".zstd") return Compression::Zstd;
  return Compression::None;
}

std::string strip_compression_extension(const std::string& path) {
  if (compression_of(path) == Compression::None) return path;
  return path.substr(0, path.find_last_of('.'));
}

// A file named as compressed must start with its format's magic bytes: zlib would otherwise read a plain file named
// x.txt.gz as plain text without a word. An empty file passes (it holds no data either way).
static void check_magic(const std::string& path, Compression compression) {
  if (compression == Compression::None) return;
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open data file ", quote(path), ": ", std::strerror(errno));
  unsigned char head[4] = {0, 0, 0, 0};
  in.read(reinterpret_cast<char*>(head), 4);
  const std::streamsize got = in.gcount();
  if (got == 0) return;
  auto hex = [&] {
    std::string out;
    for (std::streamsize i = 0; i < got; ++i) out += strprintf("%s%02x", i ? " " : "", head[i]);
    return out;
  };
  if (compression == Compression::Gzip && !(got >= 2 && head[0] == 0x1f && head[1] == 0x8b))
    fail("data file ", quote(path), " is named as gzip but does not start with gzip's magic bytes 1f 8b (it starts with ",
         hex(), "); rename it if it is not compressed");
  // A zstd frame starts 28 b5 2f fd; a skippable frame 5X 2a 4d 18.
  const bool zstd_frame = got == 4 && head[0] == 0x28 && head[1] == 0xb5 && head[2] == 0x2f && head[3] == 0xfd;
  const bool skippable = got == 4 && (head[0] & 0xf0) == 0x50 && head[1] == 0x2a && head[2] == 0x4d && head[3] == 0x18;
  if (compression == Compression::Zstd && !zstd_frame && !skippable)
    fail("data file ", quote(path), " is named as zstd but does not start with a zstd frame's magic bytes 28 b5 2f fd (it starts ",
         "with ", hex(), "); rename it if it is not compressed");
}

struct FileReader::Impl {
  Compression compression = Compression::None;
  FILE* file = nullptr;         // plain and zstd
  gzFile gz = nullptr;
  ZSTD_DCtx* zstd = nullptr;
  std::vector<char> zstd_in;
  ZSTD_inBuffer in{nullptr, 0, 0};
  size_t zstd_last = 0;         // last ZSTD_decompressStream result: 0 when a frame just ended
  uint64_t compressed_read = 0;

  ~Impl() { close(); }
  void close() {
    if (file) std::fclose(file);
    if (gz) gzclose(gz);
    if (zstd) ZSTD_freeDCtx(zstd);
    file = nullptr;
    gz = nullptr;
    zstd = nullptr;
  }
  void open(const std::string& path) {
    close();
    compression = compression_of(path);
    check_magic(path, compression);
    if (compression == Compression::Gzip) {
      gz = gzopen(path.c_str(), "rb");
      if (!gz) fail("cannot open data file ", quote(path), ": ", std::strerror(errno));
      gzbuffer(gz, kChunk);
      return;
    }
    file = std::fopen(path.c_str(), "rb");
    if (!file) fail("cannot open data file ", quote(path), ": ", std::strerror(errno));
    if (compression == Compression::Zstd) {
      zstd = ZSTD_createDCtx();
      zstd_in.resize(ZSTD_DStreamInSize());
      in = {zstd_in.data(), 0, 0};
      zstd_last = 0;
      compressed_read = 0;
    }
  }
  // Appends up to `want` decompressed bytes to out; returns how many (0 = end of file).
  size_t read(const std::string& path, std::string& out, size_t want) {
    const size_t old = out.size();
    out.resize(old + want);
    char* dst = out.data() + old;
    size_t got = 0;
    if (compression == Compression::None) {
      got = std::fread(dst, 1, want, file);
      if (got == 0 && std::ferror(file)) fail("error reading ", quote(path), ": ", std::strerror(errno));
    } else if (compression == Compression::Gzip) {
      int n = gzread(gz, dst, static_cast<unsigned>(want));
      int errnum = Z_OK;
      const char* message = gzerror(gz, &errnum);
      if (n < 0 || (errnum != Z_OK && errnum != Z_STREAM_END))
        fail(path, ": corrupt or truncated gzip data near compressed byte ", gzoffset(gz), ": ", message);
      got = static_cast<size_t>(n);
    } else {
      ZSTD_outBuffer output{dst, want, 0};
      while (output.pos == 0) {
        if (in.pos == in.size) {
          in.size = std::fread(zstd_in.data(), 1, zstd_in.size(), file);
          in.pos = 0;
          if (in.size == 0) {
            if (std::ferror(file)) fail("error reading ", quote(path), ": ", std::strerror(errno));
            if (zstd_last != 0)
              fail(path, ": truncated zstd data: the file ends inside a frame at compressed byte ", compressed_read);
            break;
          }
          compressed_read += in.size;
        }
        const uint64_t frame_start = compressed_read - in.size + in.pos;
        zstd_last = ZSTD_decompressStream(zstd, &output, &in);
        if (ZSTD_isError(zstd_last))
          fail(path, ": corrupt zstd data near compressed byte ", frame_start, ": ", ZSTD_getErrorName(zstd_last));
      }
      got = output.pos;
    }
    out.resize(old + got);
    return got;
  }
};

FileReader::FileReader(std::string path) : impl_(std::make_unique<Impl>()), path_(std::move(path)) {
  impl_->open(path_);
}

FileReader::~FileReader() = default;

bool FileReader::fill() {
  if (eof_) return false;
  if (buffer_pos_ > 0) {
    buffer_.erase(0, buffer_pos_);
    buffer_pos_ = 0;
  }
  if (impl_->read(path_, buffer_, kChunk) == 0) eof_ = true;
  return !eof_;
}

bool FileReader::next_line(std::string& line) {
  size_t search_from = buffer_pos_;
  while (true) {
    const char* start = buffer_.data() + search_from;
    const void* nl = std::memchr(start, '\n', buffer_.size() - search_from);
    if (nl) {
      const size_t end = static_cast<size_t>(static_cast<const char*>(nl) - buffer_.data());
      line.assign(buffer_, buffer_pos_, end - buffer_pos_);
      line_offset_ = consumed_;
      consumed_ += end - buffer_pos_ + 1;
      buffer_pos_ = end + 1;
      ++line_number_;
      return true;
    }
    const size_t scanned = buffer_.size() - buffer_pos_;
    if (!fill()) break;
    search_from = buffer_pos_ + scanned;
  }
  if (buffer_pos_ >= buffer_.size()) return false;
  line.assign(buffer_, buffer_pos_, std::string::npos);  // last line without a newline
  line_offset_ = consumed_;
  consumed_ += line.size();
  buffer_pos_ = buffer_.size();
  ++line_number_;
  return true;
}

std::string FileReader::read_rest() {
  while (fill()) {
  }
  std::string out = buffer_.substr(buffer_pos_);
  consumed_ += out.size();
  buffer_pos_ = buffer_.size();
  return out;
}

void FileReader::seek(uint64_t offset, uint64_t line_number) {
  impl_->open(path_);
  buffer_.clear();
  buffer_pos_ = 0;
  eof_ = false;
  consumed_ = 0;
  if (impl_->compression == Compression::None) {
    if (fseeko(impl_->file, static_cast<off_t>(offset), SEEK_SET) != 0)
      fail("cannot seek to byte ", offset, " of ", quote(path_), ": ", std::strerror(errno));
    consumed_ = offset;
  } else {
    while (consumed_ < offset) {
      if (buffer_pos_ >= buffer_.size() && !fill())
        fail(quote(path_), " is shorter than the resume position (byte ", offset, "): the file changed since the checkpoint");
      const uint64_t take = std::min<uint64_t>(offset - consumed_, buffer_.size() - buffer_pos_);
      buffer_pos_ += take;
      consumed_ += take;
    }
  }
  line_number_ = line_number;
}

}  // namespace titan::data
