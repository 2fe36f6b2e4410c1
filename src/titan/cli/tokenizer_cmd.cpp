// `titan tokenizer encode|decode|info|train`: tokenizers from the command line, reading stdin.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "titan/cli/commands.h"
#include "titan/components/data/source.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/tokenizer/bpe_trainer.h"
#include "titan/components/tokenizer/tokenizer.h"

namespace titan::cli {
namespace {

const char* kTokenizerUsage =
    "usage:\n"
    "  titan tokenizer encode --tokenizer PATH [--document] [--jsonl]\n"
    "                        UTF-8 text on stdin -> JSON array of ids on stdout; with --jsonl every input line is a\n"
    "                        JSON string (or an object with a \"text\" field) and every output line an array\n"
    "  titan tokenizer decode --tokenizer PATH [--skip-special] JSON array of ids on stdin -> text on stdout\n"
    "  titan tokenizer info --tokenizer PATH                    vocabulary size and special tokens\n"
    "  titan tokenizer speed --tokenizer PATH --input FILE [--repeat N]\n"
    "                        encoding speed on one thread: JSON with tokens, bytes, seconds, tokens_per_second\n"
    "  titan tokenizer train --input PATH [--input PATH ...] --vocab-size N --output FILE [--text-field F] [--format F]\n"
    "                        learn a byte-level BPE (Llama 3 pre-tokenizer, tiktoken format, Llama 3 special tokens)\n"
    "                        from the documents training reads: files, directories or globs of .txt, .jsonl (its\n"
    "                        text field, default \"text\"), .parquet or .arrow, optionally .gz/.zst\n"
    "\n"
    "PATH is a tokenizer file (tokenizer.json, tokenizer.model, *.tiktoken) or a directory holding one.\n"
    "--document adds BOS and EOS as the training data pipeline does.\n";

struct Options {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string output;
  std::string text_field = "text", format = "auto";  // train: how the inputs are read (as `titan data tokenize`)
  int64_t vocab_size = 0;
  int64_t repeat = 3;
  bool document = false, skip_special = false, jsonl = false;
};

Options parse(const std::vector<std::string>& args, size_t first) {
  Options o;
  for (size_t i = first; i < args.size(); ++i) {
    const std::string& a = args[i];
    static const std::vector<std::string> flags = {"--tokenizer", "--input", "--output", "--text-field", "--format", "--repeat",
                                                   "--vocab-size", "--document", "--jsonl", "--skip-special"};
    // An unknown option is named as such even at the end of the line (not as one that "expects a value").
    if (std::find(flags.begin(), flags.end(), a) == flags.end())
      fail("unknown option ", quote(a), " for `titan tokenizer ", args[0], "`\n", kTokenizerUsage);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) fail(a, " expects a value\n", kTokenizerUsage);
      return args[++i];
    };
    if (a == "--tokenizer") o.tokenizer = value();
    else if (a == "--input") o.inputs.push_back(value());
    else if (a == "--output") o.output = value();
    else if (a == "--text-field") o.text_field = value();
    else if (a == "--format") o.format = value();
    else if (a == "--repeat") {
      std::string v = value();
      char* end = nullptr;
      o.repeat = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end || o.repeat < 1) fail("--repeat expects a positive integer, got ", quote(v));
    } else if (a == "--vocab-size") {
      std::string v = value();
      char* end = nullptr;
      o.vocab_size = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end) fail("--vocab-size expects an integer, got ", quote(v));
    } else if (a == "--document") o.document = true;
    else if (a == "--jsonl") o.jsonl = true;
    else if (a == "--skip-special") o.skip_special = true;
    else fail("unknown option ", quote(a), " for `titan tokenizer ", args[0], "`\n", kTokenizerUsage);
  }
  return o;
}

std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

}  // namespace

int run_tokenizer(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kTokenizerUsage;
    return args.empty() ? 2 : 0;
  }
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kTokenizerUsage;
      return 0;
    }
  const std::string& verb = args[0];
  Options o = parse(args, 1);
  if (verb == "train") {
    if (o.inputs.empty() || o.output.empty() || o.vocab_size <= 0)
      fail("`titan tokenizer train` needs --input, --vocab-size and --output\n", kTokenizerUsage);
    // As `titan data tokenize`: an existing file is never replaced (a tokenizer in use would change under its shards).
    if (std::filesystem::exists(o.output)) fail("--output ", quote(o.output), " already exists; remove it or choose another path");
    tokenizer::BpeTrainerOptions options;
    options.vocab_size = o.vocab_size;
    // The documents training would read from these inputs: JSONL's text field, Parquet and Arrow columns, .gz/.zst,
    // directories and globs (components/data/source.h), not the files' raw bytes.
    const std::vector<data::SourceSpec> sources = data::resolve_text_inputs(o.inputs, o.format, o.text_field);
    auto stats = tokenizer::train_bpe(
        [&](const std::function<void(std::string_view)>& document) {
          for (const auto& source : sources)
            for (uint32_t i = 0; i < source.shards.size(); ++i) {
              data::ShardRowReader reader(source.shards[i], i, source.text_field);
              data::RawRow row;
              while (reader.next(row)) document(data::row_text(row, source));
            }
        },
        options, o.output);
    std::cerr << "trained " << stats.merges << " merges on " << with_thousands(stats.bytes) << " bytes ("
              << with_thousands(stats.unique_words) << " distinct pieces) in " << strprintf("%.2f", stats.seconds)
              << " s -> " << o.output << "\n";
    // 256 byte tokens, the merges, 256 special tokens.
    if (const int64_t ids = 512 + stats.merges; ids < o.vocab_size)
      std::cerr << "warning: the corpus has no more pairs that occur twice: the vocabulary has " << with_thousands(ids)
                << " ids, not the " << with_thousands(o.vocab_size) << " asked for (a model's vocab_size may be larger)\n";
    return 0;
  }
  if (verb == "speed") {
    if (o.tokenizer.empty() || o.inputs.size() != 1) fail("`titan tokenizer speed` needs --tokenizer and one --input\n", kTokenizerUsage);
    auto tok = tokenizer::load(o.tokenizer);
    std::ifstream in(o.inputs[0], std::ios::binary);
    if (!in) fail("cannot read ", quote(o.inputs[0]));
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t tokens = tok->encode(text).size();  // warm-up (JIT, caches)
    double best = 1e30;
    for (int64_t r = 0; r < o.repeat; ++r) {
      auto start = std::chrono::steady_clock::now();
      tokens = tok->encode(text).size();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    nlohmann::ordered_json j;
    j["tokens"] = tokens;
    j["bytes"] = text.size();
    j["seconds"] = best;
    j["tokens_per_second"] = static_cast<double>(tokens) / best;
    std::cout << j.dump() << "\n";
    return 0;
  }
  if (verb != "encode" && verb != "decode" && verb != "info") fail("unknown tokenizer command ", quote(verb), "\n", kTokenizerUsage);
  if (o.tokenizer.empty()) fail("`titan tokenizer ", verb, "` needs --tokenizer PATH");
  auto tok = tokenizer::load(o.tokenizer);
  if (verb == "info") {
    nlohmann::ordered_json j;
    j["description"] = tok->description();
    j["vocab_size"] = tok->vocab_size();
    j["bos_id"] = tok->bos_id() ? nlohmann::ordered_json(*tok->bos_id()) : nlohmann::ordered_json(nullptr);
    j["eos_id"] = tok->eos_id() ? nlohmann::ordered_json(*tok->eos_id()) : nlohmann::ordered_json(nullptr);
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  if (verb == "encode" && o.jsonl) {
    std::ios::sync_with_stdio(false);
    std::string line;
    size_t line_no = 0;
    while (std::getline(std::cin, line)) {
      ++line_no;
      if (trim(line).empty()) continue;
      std::string text;
      try {
        auto j = nlohmann::json::parse(line);
        text = j.is_object() ? j.at("text").get<std::string>() : j.get<std::string>();
      } catch (const nlohmann::json::exception&) {
        fail("stdin line ", line_no, ": expected a JSON string or an object with a \"text\" string");
      }
      auto ids = o.document ? tok->encode_document(text) : tok->encode(text);
      std::cout << nlohmann::json(ids).dump() << "\n";
    }
    return 0;
  }
  std::string input = read_stdin();
  if (verb == "encode") {
    auto ids = o.document ? tok->encode_document(input) : tok->encode(input);
    std::cout << nlohmann::json(ids).dump() << "\n";
    return 0;
  }
  std::vector<int32_t> ids;
  nlohmann::json array;
  try {
    array = nlohmann::json::parse(input);
  } catch (const nlohmann::json::exception&) {
  }
  if (!array.is_array()) fail("`titan tokenizer decode` expects a JSON array of integer ids on stdin, e.g. [9906, 1917]");
  for (size_t i = 0; i < array.size(); ++i) {
    const auto& v = array[i];
    // A float or an id past int32 would otherwise be truncated to some other token.
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX ||
        (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)))
      fail("`titan tokenizer decode`: element ", i, " of the input is ", v.dump(),
           "; expected a non-negative integer token id (the tokenizer has ", tok->vocab_size(), " ids)");
    ids.push_back(v.get<int32_t>());
  }
  std::cout << tok->decode(ids, o.skip_special);
  return 0;
}

}  // namespace titan::cli
