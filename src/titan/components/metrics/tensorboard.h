// TensorBoard event files written without TensorFlow: TFRecord framing (length, masked CRC-32C of the length, the
// record, masked CRC-32C of the record) around hand-encoded tensorflow.Event protobufs whose summaries hold
// scalar values (simple_value), the form TensorBoard's EventAccumulator reads as scalars.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace titan::metrics {

// CRC-32C (Castagnoli), as TFRecord uses it.
uint32_t crc32c(std::string_view data);

class EventFileWriter {
 public:
  // Creates `directory` and an events.out.tfevents.<time>.<host>.<pid> file in it (starting with its version event).
  explicit EventFileWriter(const std::string& directory);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One event at `step` with every (tag, value) as a scalar; flushed to the file at once.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace titan::metrics
