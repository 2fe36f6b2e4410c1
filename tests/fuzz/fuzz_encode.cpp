// libFuzzer harness: encoding arbitrary text with real tokenizers from ../shared/data (cl100k ranks and torchtitan's
// test tokenizer.json). For valid UTF-8, cl100k's byte-level BPE must decode back to exactly the input.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "fuzz_util.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/components/tokenizer/utf8.h"

namespace {

std::string shared_data(const std::string& relative) {
  const char* root = std::getenv("TITAN_SHARED_DATA");
  if (!root) {
    std::fprintf(stderr, "fuzz_encode: set TITAN_SHARED_DATA to ../shared/data\n");
    std::abort();
  }
  return std::string(root) + "/" + relative;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  titan_fuzz::scratch_dir();  // quiets logging
  static const auto cl100k = titan::tokenizer::load(shared_data("tokenizers/cl100k_base.tiktoken"));
  static const auto hf = titan::tokenizer::load(shared_data("tokenizers/torchtitan_test"));
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto ids = cl100k->encode(text);
  if (titan::tokenizer::is_valid_utf8(text) && cl100k->decode(ids, false) != text) {
    std::fprintf(stderr, "cl100k: decode(encode(x)) != x for a valid UTF-8 input of %zu bytes\n", size);
    std::abort();
  }
  hf->decode(hf->encode_document(text), true);
  return 0;
}
