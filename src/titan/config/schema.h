// The key schema: one KeySpec per config key (type, storage, one-line doc, allowed values), bound to a JobConfig.
#pragma once
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "titan/config/job_config.h"

namespace titan::config {

using ValuePtr = std::variant<bool*, int64_t*, double*, std::string*, std::optional<std::string>*,
                              std::optional<int64_t>*, std::optional<double>*, StringList*,
                              std::optional<std::vector<StringList>>*, DatasetSources*>;

struct KeySpec {
  std::string section;  // dotted section path, e.g. "quantize.linear.float8"
  std::string name;     // key inside the section
  ValuePtr value;
  std::string doc;
  std::vector<std::string> choices;  // allowed strings; empty means any
  std::optional<double> min;         // inclusive lower bound for numbers
  std::optional<double> max;         // inclusive upper bound for numbers
  bool min_exclusive = false;
  std::vector<int64_t> also_allowed;  // integers accepted outside [min, max], e.g. -1 for "auto"

  std::string full_name() const { return section + "." + name; }
  std::string type_name() const;
  std::string value_string() const;  // current value, TOML-like
};

// Every key of `config`, in torchtitan's section order; the pointers refer into `config`.
std::vector<KeySpec> describe(JobConfig& config);
// All section paths, including intermediate ones such as "quantize" and "quantize.linear".
std::vector<std::string> section_names();

}  // namespace titan::config
