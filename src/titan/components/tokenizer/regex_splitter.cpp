#include "titan/components/tokenizer/regex_splitter.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <algorithm>
#include <pcre2.h>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::tokenizer {

const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string pcre2_compatible_pattern(const std::string& pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char n = pattern[i + 1];
      if (n == 's') out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      else if (n == 'S' && !in_class) out += "[^\\s\\x{85}]";
      else out += pattern.substr(i, 2);
      ++i;
      continue;
    }
    if (c == '[' && !in_class) in_class = true;
    else if (c == ']' && in_class) in_class = false;
    out.push_back(c);
  }
  return out;
}

struct RegexSplitter::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  pcre2_match_context* context = nullptr;
  ~Impl() {
    if (context) pcre2_match_context_free(context);
    if (code) pcre2_code_free(code);
  }
};

namespace {

// Long runs (megabytes of whitespace) need more than PCRE2's default 32 KiB JIT stack. A JIT stack serves one
// thread at a time, so each thread that encodes gets its own.
pcre2_jit_stack* thread_jit_stack(void*) {
  struct Holder {
    pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
    ~Holder() {
      if (stack) pcre2_jit_stack_free(stack);
    }
  };
  thread_local Holder holder;
  return holder.stack;
}

}  // namespace

RegexSplitter::RegexSplitter(const std::string& pattern, const std::string& origin)
    : impl_(std::make_unique<Impl>()), pattern_(pattern) {
  std::string translated = pcre2_compatible_pattern(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    fail(origin, ": cannot compile the pre-tokenizer regex ", quote(pattern), " at offset ", offset, ": ",
         reinterpret_cast<const char*>(message));
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
  impl_->context = pcre2_match_context_create(nullptr);
  if (impl_->jit) pcre2_jit_stack_assign(impl_->context, &thread_jit_stack, nullptr);
}

RegexSplitter::~RegexSplitter() = default;

void RegexSplitter::split(std::string_view text,
                          const std::function<void(std::string_view, bool)>& emit) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
      pcre2_match_data_create_from_pattern(impl_->code, nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, gap_start = 0;
  while (pos < text.size()) {
    int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, text.size(), pos, 0, match.get(), impl_->context)
                        : pcre2_match(impl_->code, subject, text.size(), pos, 0, match.get(), impl_->context);
    if (rc == PCRE2_ERROR_NOMATCH) break;  // the rest is one gap
    if (rc < 0) {
      // Anything else (a resource limit) would silently change the pieces; refuse instead.
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      fail("the pre-tokenizer regex failed at byte ", pos, " of a ", text.size(), "-byte text: ",
           reinterpret_cast<const char*>(message));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match.get());
    size_t begin = ov[0], end = ov[1];
    if (begin > gap_start) emit(text.substr(gap_start, begin - gap_start), false);
    if (end == begin) {
      // An empty match would loop forever; skip one byte and keep it in the next gap.
      pos = begin + 1;
      gap_start = begin;
      continue;
    }
    emit(text.substr(begin, end - begin), true);
    pos = gap_start = end;
  }
  if (gap_start < text.size()) emit(text.substr(gap_start), false);
}

}  // namespace titan::tokenizer
