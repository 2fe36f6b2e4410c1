// Loading a JobConfig: defaults < TOML file (--job.config_file) < command-line overrides, then validation.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "titan/config/job_config.h"

namespace titan::config {

struct LoadedConfig {
  JobConfig config;
  // Where each explicitly set key came from ("file.toml:12" or "--training.steps"), for error messages.
  std::map<std::string, std::string> origins;
  bool help_requested = false;

  // "(set at FILE:LINE)" or "(default)" for a full key name such as "training.steps".
  std::string where(const std::string& key) const;
};

// Parses `args` (everything after `titan train`). Throws UserError naming the file, line, key and the closest
// valid key for unknown names, wrong types and out-of-range values.
LoadedConfig load_job_config(const std::vector<std::string>& args);

// Reads only a TOML file (no command line), e.g. to check that torchtitan's TOMLs load unchanged.
LoadedConfig load_toml_file(const std::string& path);

// Cross-key checks that do not depend on the run's world size; called by load_job_config.
void validate(LoadedConfig& loaded);

// `titan train --help`: every key with its type, default and a one-line doc.
std::string help_text();

// The resolved config as JSON (job.print_config, job.save_config_file).
std::string to_json(const JobConfig& config);

}  // namespace titan::config
