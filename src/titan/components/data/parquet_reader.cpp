#include "titan/components/data/parquet_reader.h"

#include "titan/common/error.h"
#include "titan/common/strings.h"

#ifdef TITAN_WITH_PARQUET
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#endif

namespace titan::data {

#ifdef TITAN_WITH_PARQUET

bool parquet_supported() { return true; }

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
  impl_->column = schema->GetFieldIndex(column);
  if (impl_->column < 0) fail(quote(path), ": no column ", quote(column), "; its columns are [", join(schema->field_names(), ", "),
                              "]; set text_field to the one holding the text");
  const auto type = schema->field(impl_->column)->type()->id();
  if (type != arrow::Type::STRING && type != arrow::Type::LARGE_STRING && type != arrow::Type::STRING_VIEW)
    fail(quote(path), ": column ", quote(column), " has type ", schema->field(impl_->column)->type()->ToString(),
         "; expected a string column");
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
    is_null = chunk->IsNull(offset);
    text.clear();
    if (is_null) return true;
    switch (chunk->type_id()) {
      case arrow::Type::STRING: text = std::static_pointer_cast<arrow::StringArray>(chunk)->GetString(offset); break;
      case arrow::Type::LARGE_STRING: text = std::static_pointer_cast<arrow::LargeStringArray>(chunk)->GetString(offset); break;
      default: text = std::string(std::static_pointer_cast<arrow::StringViewArray>(chunk)->GetView(offset)); break;
    }
    return true;
  }
  fail(quote(impl_->path), ": row group ", group, " holds fewer rows than its metadata says");
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

#endif

}  // namespace titan::data
