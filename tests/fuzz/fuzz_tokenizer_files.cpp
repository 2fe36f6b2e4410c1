// libFuzzer harness: tokenizer files (tiktoken ranks when the first byte is even, an HF tokenizer.json when odd);
// whatever loads must then encode and decode without failing in any other way than a UserError.
#include <algorithm>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "titan/components/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool tiktoken = data[0] % 2 == 0;
  const std::string path = titan_fuzz::write_file(tiktoken ? "t/ranks.tiktoken" : "h/tokenizer.json", data + 1, size - 1);
  std::unique_ptr<titan::tokenizer::Tokenizer> tok;
  titan_fuzz::refusals_allowed([&] {
    tok = tiktoken ? titan::tokenizer::load_tiktoken(path) : titan::tokenizer::load_hf_json(path);
  });
  if (!tok) return 0;
  const std::string text = "Hello world, <|endoftext|> naïve café 12345\n\t  日本語 🎉";
  titan_fuzz::refusals_allowed([&] {
    std::vector<int32_t> ids = tok->encode_document(text);
    tok->decode(ids, false);
    tok->decode(ids, true);
  });
  const int32_t n = static_cast<int32_t>(std::min<int64_t>(tok->vocab_size() + 2, 600));
  for (int32_t id = -1; id < n; ++id) {
    const std::vector<int32_t> one = {id};
    titan_fuzz::refusals_allowed([&] { tok->decode(one, false); });
  }
  return 0;
}
