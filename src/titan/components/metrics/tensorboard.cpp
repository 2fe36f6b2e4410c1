#include "titan/components/metrics/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/protobuf_wire.h"

namespace titan::metrics {

namespace {

using wire::fixed;
using wire::key;
using wire::length_delimited;

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// tensorflow.Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5 (Summary).
std::string event(double time, int64_t step, const std::string* file_version, const std::string* summary) {
  std::string e;
  wire::double_field(e, 1, time);
  wire::varint_field(e, 2, step);
  if (file_version) length_delimited(e, 3, *file_version);
  if (summary) length_delimited(e, 5, *summary);
  return e;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace

uint32_t crc32c(std::string_view data) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : data) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

EventFileWriter::EventFileWriter(const std::string& directory) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) fail("cannot create the TensorBoard folder ", quote(directory), ": ", ec.message(), " (metrics.save_tb_folder)");
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  path_ = (std::filesystem::path(directory) /
           strprintf("events.out.tfevents.%lld.%s.%d.0", static_cast<long long>(wall_time()), host, static_cast<int>(getpid())))
              .string();
  file_ = std::fopen(path_.c_str(), "ab");
  if (!file_) fail("cannot create TensorBoard event file ", quote(path_), ": ", std::strerror(errno));
  const std::string version = "brain.Event:2";
  write_record(event(wall_time(), 0, &version, nullptr));
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  // Summary { repeated Value value = 1 }; Value { string tag = 1; float simple_value = 2 }.
  std::string summary;
  for (const auto& [tag, number] : scalars) {
    std::string value;
    length_delimited(value, 1, tag);
    const float f = static_cast<float>(number);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    key(value, 2, 5);
    fixed(value, bits, 4);
    length_delimited(summary, 1, value);
  }
  write_record(event(wall_time(), step, nullptr, &summary));
}

void EventFileWriter::write_record(const std::string& data) {
  std::string record;
  std::string length;
  fixed(length, data.size(), 8);
  record += length;
  fixed(record, masked(crc32c(length)), 4);
  record += data;
  fixed(record, masked(crc32c(data)), 4);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0)
    fail("cannot write TensorBoard event file ", quote(path_), ": ", std::strerror(errno), errno == ENOSPC ? " (disk full)" : "");
}

}  // namespace titan::metrics
