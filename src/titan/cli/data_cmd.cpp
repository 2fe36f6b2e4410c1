// `titan data tokenize|inspect`: converts text sources into pre-tokenized token shards on all cores, and describes
// token shards.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <future>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "titan/cli/commands.h"
#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/data/file_reader.h"
#include "titan/components/data/source.h"
#include "titan/components/data/token_shard.h"
#include "titan/components/tokenizer/tokenizer.h"

namespace titan::cli {
namespace {

const char* kDataUsage =
    "usage:\n"
    "  titan data tokenize --tokenizer PATH --input PATH [--input PATH ...] --output DIR\n"
    "                      [--format auto|text|lines|paragraphs|jsonl|fortune|parquet|arrow] [--text-field text] [--shard-tokens N]\n"
    "                      [--threads N] [--skip-malformed-rows]\n"
    "        Encodes every document (BOS + tokens + EOS, as training does) of the inputs, in file order, into\n"
    "        DIR/part-00000.tokens, part-00001.tokens, ... of about --shard-tokens tokens each (default 100000000).\n"
    "        An input is a file, a directory or a glob of .txt / .jsonl / .json files (optionally .gz / .zst), .parquet\n"
    "        or .arrow files (Hugging Face datasets' save_to_disk folders too).\n"
    "        Use DIR as a dataset path (format \"tokens\") with the same tokenizer.\n"
    "  titan data inspect PATH [PATH ...]\n"
    "        Header and counts of token shards (a directory: its .tokens files), as JSON.\n";

struct Options {
  std::string tokenizer, output, format = "auto", text_field = "text";
  std::vector<std::string> inputs;
  int64_t shard_tokens = 100'000'000;
  int64_t threads = 0;
  bool skip_malformed = false;
};

int64_t parse_int(const std::string& option, const std::string& v) {
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || x <= 0) fail(option, " expects a positive integer, got ", quote(v));
  return x;
}

Options parse(const std::vector<std::string>& args) {
  Options o;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    static const std::vector<std::string> with_value = {"--tokenizer", "--input", "--output", "--format", "--text-field",
                                                        "--shard-tokens", "--threads"};
    // An unknown option is named as such even at the end of the line (not as one that "expects a value").
    if (a != "--skip-malformed-rows" && std::find(with_value.begin(), with_value.end(), a) == with_value.end())
      fail("unknown option ", quote(a), " for `titan data tokenize`\n", kDataUsage);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) fail(a, " expects a value\n", kDataUsage);
      return args[++i];
    };
    if (a == "--tokenizer") o.tokenizer = value();
    else if (a == "--input") o.inputs.push_back(value());
    else if (a == "--output") o.output = value();
    else if (a == "--format") o.format = value();
    else if (a == "--text-field") o.text_field = value();
    else if (a == "--shard-tokens") o.shard_tokens = parse_int(a, value());
    else if (a == "--threads") o.threads = parse_int(a, value());
    else if (a == "--skip-malformed-rows") o.skip_malformed = true;
    else fail("unknown option ", quote(a), " for `titan data tokenize`\n", kDataUsage);
  }
  static const std::vector<std::string> formats = {"auto", "text", "lines", "paragraphs", "jsonl", "fortune", "parquet", "arrow"};
  if (std::find(formats.begin(), formats.end(), o.format) == formats.end())
    fail("--format must be one of {auto, text, lines, paragraphs, jsonl, fortune, parquet, arrow}, got ", quote(o.format));
  return o;
}

struct Chunk {
  std::vector<data::RawRow> rows;
  const data::SourceSpec* source = nullptr;
  uint64_t bytes = 0;
};

struct Encoded {
  std::vector<std::vector<int32_t>> documents;
  uint64_t skipped = 0;
};

class Progress {
 public:
  explicit Progress(uint64_t total_bytes) : total_(total_bytes), tty_(isatty(STDERR_FILENO)), start_(now_seconds()) {}
  void update(uint64_t bytes, uint64_t docs, uint64_t tokens, bool final = false) {
    const double now = now_seconds();
    if (!final && now - last_ < (tty_ ? 0.2 : 5.0)) return;
    last_ = now;
    const double elapsed = std::max(1e-9, now - start_);
    const double share = total_ ? std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total_)) : 1.0;
    const int width = 30, filled = static_cast<int>(share * width);
    char bar[width + 3] = {};
    bar[0] = '[';
    for (int i = 0; i < width; ++i) bar[1 + i] = i < filled ? '#' : '.';
    bar[width + 1] = ']';
    std::fprintf(stderr, "%s%s %5.1f%%  %s docs  %s tokens  %s tokens/s%s", tty_ ? "\r" : "", bar, 100 * share,
                 with_thousands(static_cast<int64_t>(docs)).c_str(), with_thousands(static_cast<int64_t>(tokens)).c_str(),
                 with_thousands(static_cast<int64_t>(static_cast<double>(tokens) / elapsed)).c_str(),
                 tty_ && !final ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  uint64_t total_;
  bool tty_;
  double start_, last_ = 0;
};

int tokenize(const Options& o) {
  if (o.tokenizer.empty() || o.inputs.empty() || o.output.empty())
    fail("`titan data tokenize` needs --tokenizer, --input and --output\n", kDataUsage);
  auto tok = tokenizer::load(o.tokenizer);
  const std::vector<data::SourceSpec> sources = data::resolve_text_inputs(o.inputs, o.format, o.text_field);
  uint64_t total_bytes = 0;
  for (const auto& source : sources)
    for (const auto& shard : source.shards) total_bytes += std::filesystem::file_size(shard.path);
  namespace fs = std::filesystem;
  fs::create_directories(o.output);
  for (const auto& e : fs::directory_iterator(o.output))
    if (e.path().extension() == ".tokens")
      fail("--output ", quote(o.output), " already holds token shards (", e.path().filename().string(),
           "); choose an empty directory so no shard is overwritten");
  const int64_t threads = o.threads > 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  const double start = now_seconds();
  Progress progress(total_bytes);

  std::unique_ptr<data::TokenShardWriter> writer;
  int shard_index = 0;
  uint64_t docs = 0, tokens = 0, skipped = 0, bytes_done = 0;
  std::vector<std::string> written;
  auto write = [&](Encoded encoded, uint64_t chunk_bytes) {
    for (auto& d : encoded.documents) {
      if (!writer) {
        written.push_back((fs::path(o.output) / strprintf("part-%05d.tokens", shard_index++)).string());
        writer = std::make_unique<data::TokenShardWriter>(written.back(), tok->vocab_size(), tok->bos_id().value_or(-1),
                                                          tok->eos_id().value_or(-1));
      }
      writer->add(d);
      ++docs;
      tokens += d.size();
      if (static_cast<int64_t>(writer->num_tokens()) >= o.shard_tokens) {
        writer->finish();
        writer.reset();
      }
    }
    skipped += encoded.skipped;
    bytes_done += chunk_bytes;
    progress.update(bytes_done, docs, tokens);
  };

  // The reading thread (this one) fills chunks; `threads` workers encode them; results are written in order.
  std::deque<std::future<Encoded>> pending;
  auto encode_chunk = [&tok, &o](Chunk chunk) {
    Encoded out;
    for (const auto& row : chunk.rows) {
      std::string text;
      try {
        text = data::row_text(row, *chunk.source);
      } catch (const UserError&) {
        if (!o.skip_malformed) throw;
        ++out.skipped;
        continue;
      }
      out.documents.push_back(tok->encode_document(text));
    }
    return out;
  };
  std::vector<uint64_t> chunk_bytes;
  auto drain_one = [&] {
    write(pending.front().get(), chunk_bytes.front());
    pending.pop_front();
    chunk_bytes.erase(chunk_bytes.begin());
  };
  for (const auto& source : sources) {
    for (uint32_t i = 0; i < source.shards.size(); ++i) {
      data::ShardRowReader reader(source.shards[i], i, source.text_field);
      const uint64_t file_bytes = fs::file_size(source.shards[i].path);
      uint64_t read_offset = 0;
      Chunk chunk;
      chunk.source = &source;
      data::RawRow row;
      auto flush = [&](bool last) {
        if (chunk.rows.empty() && !last) return;
        // Progress counts compressed file bytes, spread over the file's chunks by uncompressed position.
        uint64_t done = last ? file_bytes : std::min<uint64_t>(file_bytes, reader.position().offset);
        if (data::compression_of(source.shards[i].path) != data::Compression::None && !last) done = read_offset;
        chunk_bytes.push_back(done - read_offset);
        read_offset = done;
        // One thread: encode here. More: that many chunks encode at once while this thread reads ahead.
        pending.push_back(std::async(threads == 1 ? std::launch::deferred : std::launch::async, encode_chunk,
                                     std::move(chunk)));
        chunk = Chunk{};
        chunk.source = &source;
        while (static_cast<int64_t>(pending.size()) >= 2 * threads) drain_one();
      };
      while (reader.next(row)) {
        chunk.bytes += row.bytes.size();
        chunk.rows.push_back(std::move(row));
        if (chunk.rows.size() >= 256 || chunk.bytes >= (1u << 20)) flush(false);
      }
      flush(true);
    }
  }
  while (!pending.empty()) drain_one();
  if (writer) writer->finish();
  // Training refuses a source that gives no document; so does this, rather than report an empty success.
  if (docs == 0)
    fail("no documents in ", join(o.inputs, ", "), " (", skipped ? cat(skipped, " malformed rows skipped") : std::string("the inputs are empty"),
         "): nothing was tokenized");
  progress.update(total_bytes, docs, tokens, true);
  const double seconds = now_seconds() - start;
  nlohmann::ordered_json summary;
  summary["output"] = o.output;
  summary["shards"] = written;
  summary["documents"] = docs;
  summary["tokens"] = tokens;
  summary["skipped_rows"] = skipped;
  summary["input_bytes"] = total_bytes;
  summary["seconds"] = seconds;
  summary["tokens_per_second"] = static_cast<double>(tokens) / std::max(1e-9, seconds);
  summary["threads"] = threads;
  summary["tokenizer"] = tok->description();
  std::cerr << "tokenized " << with_thousands(static_cast<int64_t>(docs)) << " documents into "
            << with_thousands(static_cast<int64_t>(tokens)) << " tokens in " << written.size() << " shard(s) in "
            << strprintf("%.2f", seconds) << " s ("
            << with_thousands(static_cast<int64_t>(static_cast<double>(tokens) / std::max(1e-9, seconds)))
            << " tokens/s, " << threads << " threads)" << (skipped ? cat("; skipped ", skipped, " malformed rows") : "")
            << "\n";
  std::cout << summary.dump(2) << "\n";
  return 0;
}

int inspect(const std::vector<std::string>& args) {
  if (args.size() < 2) fail("`titan data inspect` needs one or more token shard paths\n", kDataUsage);
  // A directory (what `titan data tokenize --output` wrote) stands for its .tokens files, in name order.
  std::vector<std::string> paths;
  for (size_t i = 1; i < args.size(); ++i) {
    if (!std::filesystem::is_directory(args[i])) {
      paths.push_back(args[i]);
      continue;
    }
    std::vector<std::string> shards;
    for (const auto& entry : std::filesystem::directory_iterator(args[i]))
      if (entry.is_regular_file() && entry.path().extension() == ".tokens") shards.push_back(entry.path().string());
    if (shards.empty()) fail(quote(args[i]), " is a directory without .tokens files (token shards, as `titan data tokenize` writes)");
    std::sort(shards.begin(), shards.end());
    paths.insert(paths.end(), shards.begin(), shards.end());
  }
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& path : paths) {
    data::TokenShardReader reader(path);
    const auto& h = reader.header();
    out.push_back({{"path", path},
                   {"version", h.version},
                   {"token_bytes", h.token_bytes},
                   {"vocab_size", h.vocab_size},
                   {"documents", h.num_docs},
                   {"tokens", h.num_tokens},
                   {"bos_id", h.bos_id},
                   {"eos_id", h.eos_id}});
  }
  std::cout << out.dump(2) << "\n";
  return 0;
}

}  // namespace

int run_data(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kDataUsage;
    return args.empty() ? 2 : 0;
  }
  // `titan data tokenize --help` (anywhere on the line): the usage, as the other commands give it.
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kDataUsage;
      return 0;
    }
  if (args[0] == "tokenize") return tokenize(parse(args));
  if (args[0] == "inspect") return inspect(args);
  fail("unknown data command ", quote(args[0]), "\n", kDataUsage);
}

}  // namespace titan::cli
