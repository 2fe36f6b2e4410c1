// RegexSplitter: the pre-tokenizer step that cuts text into pieces with a Unicode regex (PCRE2, JIT-compiled),
// matching tiktoken's and HF tokenizers' semantics for the Llama 3 / GPT-2 patterns.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace titan::tokenizer {

// The Llama 3 (and cl100k_base) pre-tokenizer pattern.
extern const char* const kLlama3Pattern;
// GPT-2's pattern, used by HF's ByteLevel pre-tokenizer when use_regex is true.
extern const char* const kGpt2Pattern;

class RegexSplitter {
 public:
  // `origin` names where the pattern came from, for error messages.
  RegexSplitter(const std::string& pattern, const std::string& origin);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // Emits consecutive pieces covering all of `text`: every match (matched = true), and any unmatched gap
  // between matches (matched = false). Invalid UTF-8 never matches, so such bytes come out as gaps.
  void split(std::string_view text, const std::function<void(std::string_view piece, bool matched)>& emit) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string pattern_;
};

// Rewrites \s and \S so that U+0085 (NEL) counts as whitespace, as in the Rust and Oniguruma engines that
// tiktoken and HF tokenizers use (PCRE2's \s lacks it).
std::string pcre2_compatible_pattern(const std::string& pattern);

}  // namespace titan::tokenizer
