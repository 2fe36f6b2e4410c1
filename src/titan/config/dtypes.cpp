#include "titan/config/dtypes.h"

#include <map>
#include <vector>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::config {
namespace {

const std::map<std::string, at::ScalarType>& names() {
  static const std::map<std::string, at::ScalarType> table = {
      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf},  {"float64", at::kDouble},
      {"int64", at::kLong},    {"int32", at::kInt},         {"int16", at::kShort},   {"int8", at::kChar},
      {"uint8", at::kByte},    {"bool", at::kBool}};
  return table;
}

}  // namespace

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  auto it = names().find(name);
  if (it == names().end()) {
    std::vector<std::string> known;
    for (const auto& [n, t] : names()) known.push_back(n);
    fail(where, ": unknown dtype ", quote(name), "; known: ", join(known, ", "));
  }
  return it->second;
}

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& [name, t] : names())
    if (t == dtype) return name;
  fail("unsupported dtype ", c10::toString(dtype));
}

double dtype_bytes(const std::string& name) {
  return static_cast<double>(c10::elementSize(dtype_from_name(name, "dtype")));
}

}  // namespace titan::config
