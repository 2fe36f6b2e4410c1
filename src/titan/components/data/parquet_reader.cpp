#include "titan/components/data/parquet_reader.h"

#include <algorithm>

#include "titan/common/error.h"
#include "titan/common/strings.h"

#ifdef TITAN_WITH_PARQUET
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/api.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#endif

namespace titan::data {

#ifdef TITAN_WITH_PARQUET

bool parquet_supported() { return true; }

namespace {

bool is_string_type(arrow::Type::type id) {
  return id == arrow::Type::STRING || id == arrow::Type::LARGE_STRING || id == arrow::Type::STRING_VIEW;
}

// The string column `column` of `schema`, or UserError naming the file, the columns there are, or the type found.
int string_column(const arrow::Schema& schema, const std::string& column, const std::string& path) {
  const int index = schema.GetFieldIndex(column);
  if (index < 0) fail(quote(path), ": no column ", quote(column), "; its columns are [", join(schema.field_names(), ", "),
                      "]; set text_field to the one holding the text");
  if (!is_string_type(schema.field(index)->type()->id()))
    fail(quote(path), ": column ", quote(column), " has type ", schema.field(index)->type()->ToString(),
         "; expected a string column");
  return index;
}

// Row `offset` of a string array into `text` (empty and `is_null` for a missing value).
void string_at(const arrow::Array& chunk, int64_t offset, std::string& text, bool& is_null) {
  is_null = chunk.IsNull(offset);
  text.clear();
  if (is_null) return;
  switch (chunk.type_id()) {
    case arrow::Type::STRING: text = static_cast<const arrow::StringArray&>(chunk).GetString(offset); break;
    case arrow::Type::LARGE_STRING: text = static_cast<const arrow::LargeStringArray&>(chunk).GetString(offset); break;
    default: text = std::string(static_cast<const arrow::StringViewArray&>(chunk).GetView(offset)); break;
  }
}

}  // namespace

struct ParquetTextReader::Impl {
  std::string path, column_name;
  std::unique_ptr<parquet::arrow::FileReader> reader;
  int column = -1;
  std::vector<uint64_t> group_start;  // first row of each row group, plus the total at the end
  int loaded_group = -1;
  std::shared_ptr<arrow::ChunkedArray> values;

  void load_group(int g) {
    auto table = reader->ReadRowGroup(g, {column});
    if (!table.ok()) fail(path, ": cannot read row group ", g, " (rows ", group_start[g], "..): ", table.status().ToString());
    values = (*table)->column(0);
    loaded_group = g;
  }
};

ParquetTextReader::ParquetTextReader(const std::string& path, const std::string& column) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->column_name = column;
  auto file = arrow::io::ReadableFile::Open(path);
  if (!file.ok()) fail("cannot open Parquet file ", quote(path), ": ", file.status().ToString());
  try {
    auto opened = parquet::arrow::OpenFile(*file, arrow::default_memory_pool());
    if (!opened.ok()) fail(quote(path), ": not a readable Parquet file: ", opened.status().ToString());
    impl_->reader = std::move(opened).ValueOrDie();
  } catch (const parquet::ParquetException& e) {
    fail(quote(path), ": not a readable Parquet file: ", e.what());
  }
  std::shared_ptr<arrow::Schema> schema;
  auto status = impl_->reader->GetSchema(&schema);
  if (!status.ok()) fail(quote(path), ": cannot read the Parquet schema: ", status.ToString());
  impl_->column = string_column(*schema, column, path);
  auto metadata = impl_->reader->parquet_reader()->metadata();
  uint64_t rows = 0;
  for (int g = 0; g < metadata->num_row_groups(); ++g) {
    impl_->group_start.push_back(rows);
    rows += static_cast<uint64_t>(metadata->RowGroup(g)->num_rows());
  }
  impl_->group_start.push_back(rows);
}

ParquetTextReader::~ParquetTextReader() = default;

uint64_t ParquetTextReader::num_rows() const { return impl_->group_start.back(); }

bool ParquetTextReader::read(uint64_t index, std::string& text, bool& is_null) {
  if (index >= num_rows()) return false;
  auto& g = impl_->group_start;
  const int group = static_cast<int>(std::upper_bound(g.begin(), g.end(), index) - g.begin()) - 1;
  if (group != impl_->loaded_group) impl_->load_group(group);
  int64_t offset = static_cast<int64_t>(index - g[group]);
  for (const auto& chunk : impl_->values->chunks()) {
    if (offset >= chunk->length()) {
      offset -= chunk->length();
      continue;
    }
    string_at(*chunk, offset, text, is_null);
    return true;
  }
  fail(quote(impl_->path), ": row group ", group, " holds fewer rows than its metadata says");
}

struct ArrowTextReader::Impl {
  std::shared_ptr<arrow::io::MemoryMappedFile> file;
  std::vector<std::shared_ptr<arrow::Array>> batches;  // the text column of each record batch (views into the mapping)
  std::vector<uint64_t> batch_start;                    // first row of each batch, plus the total at the end
  std::vector<bool> checked;                            // batches whose offsets were validated
  std::string path;
};

ArrowTextReader::ArrowTextReader(const std::string& path, const std::string& column) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  auto file = arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ);
  if (!file.ok()) fail("cannot open Arrow file ", quote(path), ": ", file.status().ToString());
  impl_->file = *file;
  auto size = impl_->file->GetSize();
  if (!size.ok()) fail("cannot read Arrow file ", quote(path), ": ", size.status().ToString());
  // The file format begins with "ARROW1"; the stream format (what `datasets` writes) with a message.
  std::string magic(6, '\0');
  if (*size >= 6) {
    auto got = impl_->file->ReadAt(0, 6, magic.data());
    if (!got.ok()) fail("cannot read Arrow file ", quote(path), ": ", got.status().ToString());
  }
  auto not_arrow = [&](const arrow::Status& status) {
    fail(quote(path), ": not an Arrow IPC file (the stream format Hugging Face datasets writes, or the file format): ",
         status.ToString());
  };
  impl_->batch_start.push_back(0);
  if (magic == "ARROW1") {
    auto reader = arrow::ipc::RecordBatchFileReader::Open(impl_->file);
    if (!reader.ok()) not_arrow(reader.status());
    const int index = string_column(*(*reader)->schema(), column, path);
    for (int b = 0; b < (*reader)->num_record_batches(); ++b) {
      auto batch = (*reader)->ReadRecordBatch(b);
      if (!batch.ok()) fail(quote(path), ": cannot read record batch ", b, ": ", batch.status().ToString());
      impl_->batches.push_back((*batch)->column(index));
      impl_->batch_start.push_back(impl_->batch_start.back() + static_cast<uint64_t>((*batch)->num_rows()));
    }
  } else {
    auto reader = arrow::ipc::RecordBatchStreamReader::Open(impl_->file);
    if (!reader.ok()) not_arrow(reader.status());
    const int index = string_column(*(*reader)->schema(), column, path);
    for (int b = 0;; ++b) {
      std::shared_ptr<arrow::RecordBatch> batch;
      auto status = (*reader)->ReadNext(&batch);
      if (!status.ok()) fail(quote(path), ": cannot read record batch ", b, ": ", status.ToString());
      if (!batch) break;
      impl_->batches.push_back(batch->column(index));
      impl_->batch_start.push_back(impl_->batch_start.back() + static_cast<uint64_t>(batch->num_rows()));
    }
  }
  impl_->checked.assign(impl_->batches.size(), false);
}

ArrowTextReader::~ArrowTextReader() = default;

uint64_t ArrowTextReader::num_rows() const { return impl_->batch_start.back(); }

bool ArrowTextReader::read(uint64_t index, std::string& text, bool& is_null) {
  if (index >= num_rows()) return false;
  const auto& s = impl_->batch_start;
  const size_t batch = static_cast<size_t>(std::upper_bound(s.begin(), s.end(), index) - s.begin()) - 1;
  if (!impl_->checked[batch]) {
    // IPC data is not checked when it is mapped: a batch's offsets are, before its first row is read (viewed as
    // bytes: each row's UTF-8 is checked as it is read, so that a bad row is one row, which skip_malformed_rows skips).
    const auto& column = impl_->batches[batch];
    const auto type = column->type_id() == arrow::Type::STRING        ? arrow::binary()
                      : column->type_id() == arrow::Type::LARGE_STRING ? arrow::large_binary()
                                                                        : arrow::binary_view();
    auto bytes = column->View(type);
    auto status = bytes.ok() ? (*bytes)->ValidateFull() : bytes.status();
    if (!status.ok())
      fail(quote(impl_->path), ": record batch ", batch, " (rows ", s[batch], "..", s[batch + 1], ") is malformed: ", status.ToString());
    impl_->checked[batch] = true;
  }
  string_at(*impl_->batches[batch], static_cast<int64_t>(index - s[batch]), text, is_null);
  return true;
}

#else

bool parquet_supported() { return false; }

struct ParquetTextReader::Impl {};

ParquetTextReader::ParquetTextReader(const std::string& path, const std::string&) {
  fail(quote(path), " is Parquet, but this build has no Parquet support (pyarrow's Arrow C++ was not found when it was "
       "configured; scripts/setup.sh installs it); convert the data to JSONL or token shards");
}
ParquetTextReader::~ParquetTextReader() = default;
uint64_t ParquetTextReader::num_rows() const { return 0; }
bool ParquetTextReader::read(uint64_t, std::string&, bool&) { return false; }

struct ArrowTextReader::Impl {};

ArrowTextReader::ArrowTextReader(const std::string& path, const std::string&) {
  fail(quote(path), " is Arrow IPC, but this build has no Arrow support (pyarrow's Arrow C++ was not found when it was "
       "configured; scripts/setup.sh installs it); convert the data to JSONL or token shards");
}
ArrowTextReader::~ArrowTextReader() = default;
uint64_t ArrowTextReader::num_rows() const { return 0; }
bool ArrowTextReader::read(uint64_t, std::string&, bool&) { return false; }

#endif

}  // namespace titan::data
