// Small string helpers: split/join/trim, edit distance and "did you mean" suggestions, number formatting.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace titan {

std::vector<std::string> split(std::string_view text, char separator);
std::string join(const std::vector<std::string>& parts, std::string_view separator);
// {1, 2, 3} -> "1, 2, 3" (shapes and boxes in messages).
std::string join_ints(const std::vector<int64_t>& values);
std::string trim(std::string_view text);
bool starts_with(std::string_view text, std::string_view prefix);
bool ends_with(std::string_view text, std::string_view suffix);
std::string to_lower(std::string_view text);

size_t edit_distance(std::string_view a, std::string_view b);
// The candidate closest to `word` by edit distance, or "" when none is reasonably close.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// 1234567 -> "1,234,567" (Python's "{:,}").
std::string with_thousands(long long value);
// 1234.5678, 2 -> "1,234.57" (Python's "{:,.2f}").
std::string with_thousands(double value, int decimals);
// printf-style formatting into a std::string.
std::string strprintf(const char* format, ...) __attribute__((format(printf, 1, 2)));
// JSON-style quoting for messages: "abc" with escapes.
std::string quote(std::string_view text);

}  // namespace titan
