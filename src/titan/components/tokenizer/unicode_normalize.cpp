#include "titan/components/tokenizer/unicode_normalize.h"

#include <cctype>
#include <functional>

#include "titan/common/error.h"

#ifdef TITAN_WITH_ICU
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#include <unicode/utf8.h>
#endif

namespace titan::tokenizer {

namespace {

bool is_ascii(std::string_view text) {
  for (unsigned char c : text)
    if (c >= 0x80) return false;
  return true;
}

#ifdef TITAN_WITH_ICU
using Transform = std::function<std::u16string(const std::u16string&)>;

void append_utf8(std::string& out, const std::u16string& text) {
  if (text.empty()) return;
  UErrorCode status = U_ZERO_ERROR;
  int32_t length = 0;
  u_strToUTF8(nullptr, 0, &length, text.data(), static_cast<int32_t>(text.size()), &status);
  status = U_ZERO_ERROR;
  const size_t start = out.size();
  out.resize(start + static_cast<size_t>(length));
  u_strToUTF8(out.data() + start, length, nullptr, text.data(), static_cast<int32_t>(text.size()), &status);
  if (U_FAILURE(status)) fail("internal: UTF-16 to UTF-8: ", u_errorName(status));
}

// Applies `transform` to each maximal run of valid UTF-8, copying the bytes that are not UTF-8 between them.
std::string transform_runs(std::string_view text, const Transform& transform) {
  std::string out;
  out.reserve(text.size());
  std::u16string run;
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t length = static_cast<int32_t>(text.size());
  int32_t i = 0;
  while (i < length) {
    const int32_t start = i;
    UChar32 c;
    U8_NEXT(bytes, i, length, c);
    if (c < 0) {
      append_utf8(out, transform(run));
      run.clear();
      out.append(text.substr(static_cast<size_t>(start), static_cast<size_t>(i - start)));
      continue;
    }
    if (c <= 0xFFFF) {
      run.push_back(static_cast<char16_t>(c));
    } else {
      run.push_back(static_cast<char16_t>(U16_LEAD(c)));
      run.push_back(static_cast<char16_t>(U16_TRAIL(c)));
    }
  }
  append_utf8(out, transform(run));
  return out;
}

const UNormalizer2* normalizer(UnicodeForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* n = nullptr;
  switch (form) {
    case UnicodeForm::NFC: n = unorm2_getNFCInstance(&status); break;
    case UnicodeForm::NFD: n = unorm2_getNFDInstance(&status); break;
    case UnicodeForm::NFKC: n = unorm2_getNFKCInstance(&status); break;
    case UnicodeForm::NFKD: n = unorm2_getNFKDInstance(&status); break;
  }
  if (U_FAILURE(status) || !n) fail("ICU has no Unicode normalizer data: ", u_errorName(status));
  return n;
}

// Runs an ICU function of the (dest, capacity, ..., status) kind, growing the buffer once when it was too small.
std::u16string with_buffer(size_t hint, const std::function<int32_t(char16_t*, int32_t, UErrorCode*)>& call) {
  std::u16string out(hint, u'\0');
  UErrorCode status = U_ZERO_ERROR;
  int32_t length = call(out.data(), static_cast<int32_t>(out.size()), &status);
  if (status == U_BUFFER_OVERFLOW_ERROR) {
    out.assign(static_cast<size_t>(length), u'\0');
    status = U_ZERO_ERROR;
    length = call(out.data(), length, &status);
  }
  if (U_FAILURE(status)) fail("internal: ICU: ", u_errorName(status));
  out.resize(static_cast<size_t>(length));
  return out;
}
#endif

}  // namespace

bool unicode_normalization_available() {
#ifdef TITAN_WITH_ICU
  return true;
#else
  return false;
#endif
}

std::string unicode_normalize(std::string_view text, UnicodeForm form) {
  if (is_ascii(text)) return std::string(text);  // every form leaves ASCII as it is
#ifdef TITAN_WITH_ICU
  const UNormalizer2* n = normalizer(form);
  return transform_runs(text, [n](const std::u16string& run) {
    if (run.empty()) return run;
    return with_buffer(run.size() * 2 + 16, [&](char16_t* dest, int32_t capacity, UErrorCode* status) {
      return unorm2_normalize(n, reinterpret_cast<const UChar*>(run.data()), static_cast<int32_t>(run.size()),
                              reinterpret_cast<UChar*>(dest), capacity, status);
    });
  });
#else
  fail("Unicode normalization needs ICU, which this build of titan.cpp was configured without (Debian: libicu-dev)");
#endif
}

std::string unicode_lowercase(std::string_view text) {
  if (is_ascii(text)) {
    std::string out(text);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
#ifdef TITAN_WITH_ICU
  // Code point by code point, as HF tokenizers maps each char (Rust's char::to_lowercase: the full mapping, "İ" to
  // "i̇", but no context, so a final capital sigma becomes "σ", not "ς").
  return transform_runs(text, [](const std::u16string& run) {
    std::u16string out;
    out.reserve(run.size());
    for (size_t i = 0; i < run.size();) {
      const size_t width = U16_IS_LEAD(run[i]) && i + 1 < run.size() && U16_IS_TRAIL(run[i + 1]) ? 2 : 1;
      const std::u16string one = run.substr(i, width);
      out += with_buffer(8, [&](char16_t* dest, int32_t capacity, UErrorCode* status) {
        return u_strToLower(reinterpret_cast<UChar*>(dest), capacity, reinterpret_cast<const UChar*>(one.data()),
                            static_cast<int32_t>(one.size()), "", status);
      });
      i += width;
    }
    return out;
  });
#else
  fail("Unicode lowercasing needs ICU, which this build of titan.cpp was configured without (Debian: libicu-dev)");
#endif
}

}  // namespace titan::tokenizer
