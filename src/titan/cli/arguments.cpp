#include "titan/cli/arguments.h"

#include <exception>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::cli {

int64_t integer_argument(const std::string& option, const std::string& value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  fail(option, " expects an integer, got ", quote(value));
}

int64_t positive_integer_argument(const std::string& option, const std::string& value) {
  const int64_t v = integer_argument(option, value);
  if (v <= 0) fail(option, " ", quote(value), ": expected a positive integer");
  return v;
}

double number_argument(const std::string& option, const std::string& value) {
  try {
    size_t used = 0;
    const double v = std::stod(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  fail(option, " expects a number, got ", quote(value));
}

}  // namespace titan::cli
