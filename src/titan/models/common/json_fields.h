// Typed reading of a JSON object's fields (config.json, checkpoint metadata) with errors that name the source, the
// field and what was expected; and reading a JSON file.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace titan::models {

struct JsonFields {
  const nlohmann::json& object;
  std::string where;       // the file (and field) in errors
  std::string required_by;  // what needs a missing integer field, e.g. "a Llama config.json"; empty: just "no KEY"

  // The field, or null when it is absent or JSON null.
  const nlohmann::json* find(const std::string& key) const;
  int64_t integer(const std::string& key) const;  // required
  double number(const std::string& key, double fallback) const;
  bool boolean(const std::string& key, bool fallback) const;
};

// The JSON in `path`; UserError naming the file when it cannot be read or parsed (`what`: what it should be).
nlohmann::json read_json_file(const std::string& path, const std::string& what);

}  // namespace titan::models
