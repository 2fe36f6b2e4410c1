// Command-line values of the `titan` subcommands, parsed with errors that name the option and the value.
#pragma once
#include <cstdint>
#include <string>

namespace titan::cli {

int64_t integer_argument(const std::string& option, const std::string& value);
int64_t positive_integer_argument(const std::string& option, const std::string& value);
double number_argument(const std::string& option, const std::string& value);

}  // namespace titan::cli
