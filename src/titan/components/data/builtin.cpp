#include "titan/components/data/builtin.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/data/source.h"
#include "titan/components/tokenizer/bpe_trainer.h"

namespace titan::data {

const char* const kBuiltinTokenizer = "builtin";

namespace {

std::string read_whole(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read ", quote(path.string()));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

}  // namespace

std::string ensure_builtin_tokenizer(const std::string& dump_folder, int64_t vocab_size) {
  namespace fs = std::filesystem;
  fs::path path = fs::path(dump_folder) / "builtin_tokenizer" / ("fortunes_bpe_" + std::to_string(vocab_size) + ".tiktoken");
  if (fs::exists(path)) return path.string();
  config::DatasetSource builtin;
  builtin.name = "fortunes";
  const SourceSpec corpus = resolve_source(builtin, "the built-in corpus");
  // Training is deterministic: the same build on the same corpus files gives the same merges, so a copy kept in the
  // user's cache (keyed by both) spares the next run's half second.
  std::string key = cat(binary_identity(), " | ", vocab_size);
  for (const auto& shard : corpus.shards) {
    std::error_code error;
    const auto size = fs::file_size(shard.path, error);
    const auto mtime = fs::last_write_time(shard.path, error).time_since_epoch().count();
    key += cat(" | ", shard.path, " ", size, " ", mtime);
  }
  const fs::path cache_dir = user_cache_dir();
  const fs::path cached = cache_dir.empty() ? fs::path()
                                            : cache_dir / "builtin_tokenizer" /
                                                  strprintf("fortunes_bpe_%lld_%016zx.tiktoken", static_cast<long long>(vocab_size),
                                                            std::hash<std::string>{}(key));
  if (!cached.empty() && fs::exists(cached)) {
    fs::create_directories(path.parent_path());
    write_file(path.string(), read_whole(cached));
    log::info("built-in tokenizer (byte-level BPE, ", vocab_size, " ids): as trained earlier by this build on the same corpus, from ",
              cached.string(), ", saved to ", path.string());
    return path.string();
  }
  log::info("training the built-in tokenizer (byte-level BPE, ", vocab_size, " ids) on the built-in corpus ", kBuiltinCorpusDir);
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
  if (!cached.empty()) {
    try {
      fs::create_directories(cached.parent_path());
      write_file(cached.string(), read_whole(path));
    } catch (const std::exception& e) {
      log::warn("could not keep the built-in tokenizer in the cache ", quote(cached.string()), ": ", e.what());
    }
  }
  return path.string();
}

}  // namespace titan::data
