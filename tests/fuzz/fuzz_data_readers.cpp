// libFuzzer harness: the dataset readers. The first byte picks the format (text, JSONL plain / gzip / zstd, token
// shard, Parquet, fortune, Arrow IPC); the rest is the file. Every row is read and, for text formats, its text extracted.
#include <string>

#include "fuzz_util.h"
#include "titan/components/data/source.h"

using titan::data::Format;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  struct Kind {
    const char* name;
    Format format;
  };
  static const Kind kinds[] = {{"d.txt", Format::Text},      {"d.jsonl", Format::Jsonl},    {"d.jsonl.gz", Format::Jsonl},
                               {"d.jsonl.zst", Format::Jsonl}, {"d.tokens", Format::Tokens},  {"d.parquet", Format::Parquet},
                               {"d.fortune", Format::Fortune}, {"d.arrow", Format::Arrow}};
  const Kind& kind = kinds[data[0] % (sizeof(kinds) / sizeof(kinds[0]))];
  titan::data::SourceSpec spec;
  spec.name = "fuzz";
  spec.shards = {{titan_fuzz::write_file(kind.name, data + 1, size - 1), kind.format}};
  titan_fuzz::refusals_allowed([&] {
    titan::data::ShardRowReader reader(spec.shards[0], 0, spec.text_field);
    titan::data::RawRow row;
    for (int rows = 0; rows < 100000 && reader.next(row); ++rows)
      if (kind.format != Format::Tokens) titan_fuzz::refusals_allowed([&] { titan::data::row_text(row, spec); });
  });
  return 0;
}
