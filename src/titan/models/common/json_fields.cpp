#include "titan/models/common/json_fields.h"

#include <fstream>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::models {

using json = nlohmann::json;

const json* JsonFields::find(const std::string& key) const {
  auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

int64_t JsonFields::integer(const std::string& key) const {
  const json* v = find(key);
  if (!v) fail(where, ": no ", key, required_by.empty() ? std::string() : cat("; ", required_by, " must give it"));
  if (!v->is_number_integer()) fail(where, ": ", key, " must be an integer, got ", v->dump());
  return v->get<int64_t>();
}

double JsonFields::number(const std::string& key, double fallback) const {
  const json* v = find(key);
  if (!v) return fallback;
  if (!v->is_number()) fail(where, ": ", key, " must be a number, got ", v->dump());
  return v->get<double>();
}

bool JsonFields::boolean(const std::string& key, bool fallback) const {
  const json* v = find(key);
  if (!v) return fallback;
  if (!v->is_boolean()) fail(where, ": ", key, " must be true or false, got ", v->dump());
  return v->get<bool>();
}

json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) fail("cannot read ", quote(path), "; expected ", what);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

}  // namespace titan::models
