// Which configured features this build of titan.cpp can run: settings that ask for a feature not implemented yet
// are reported as clear errors (never silently ignored), with the key, its value and where it was set.
#pragma once
#include <string>
#include <vector>

#include "titan/config/loader.h"

namespace titan::config {

struct SupportReport {
  std::vector<std::string> errors;    // the run must not start
  std::vector<std::string> warnings;  // accepted with a difference worth knowing
};

SupportReport check_supported(const LoadedConfig& loaded);

// Throws UserError listing every unsupported setting; logs the warnings.
void require_supported(const LoadedConfig& loaded);

}  // namespace titan::config
