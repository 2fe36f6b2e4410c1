#include "titan/components/data/builtin.h"

#include <filesystem>

#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/data/source.h"
#include "titan/components/tokenizer/bpe_trainer.h"

namespace titan::data {

const char* const kBuiltinTokenizer = "builtin";

std::string ensure_builtin_tokenizer(const std::string& dump_folder, int64_t vocab_size) {
  namespace fs = std::filesystem;
  fs::path path = fs::path(dump_folder) / "builtin_tokenizer" / ("fortunes_bpe_" + std::to_string(vocab_size) + ".tiktoken");
  if (fs::exists(path)) return path.string();
  log::info("training the built-in tokenizer (byte-level BPE, ", vocab_size, " ids) on the built-in corpus ", kBuiltinCorpusDir);
  config::DatasetSource builtin;
  builtin.name = "fortunes";
  const SourceSpec corpus = resolve_source(builtin, "the built-in corpus");
  tokenizer::BpeTrainerOptions options;
  options.vocab_size = vocab_size;
  auto stats = tokenizer::train_bpe(
      [&](const std::function<void(std::string_view)>& emit) {
        RawRow row;
        for (uint32_t i = 0; i < corpus.shards.size(); ++i) {
          ShardRowReader reader(corpus.shards[i], i);
          while (reader.next(row)) emit(row.bytes);
        }
      },
      options, path.string());
  log::info("built-in tokenizer: ", stats.merges, " merges from ", with_thousands(stats.bytes), " bytes in ",
            strprintf("%.1f", stats.seconds), " s, saved to ", path.string());
  return path.string();
}

}  // namespace titan::data
