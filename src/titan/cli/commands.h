// The `titan` subcommands; each takes the arguments after its name and returns the process exit code.
#pragma once
#include <string>
#include <vector>

namespace titan::cli {

int run_train(const std::vector<std::string>& args);
int run_tokenizer(const std::vector<std::string>& args);
int run_estimate(const std::vector<std::string>& args);
int run_plan(const std::vector<std::string>& args);
int run_data(const std::vector<std::string>& args);
int run_convert(const std::vector<std::string>& args);
int run_generate(const std::vector<std::string>& args);

}  // namespace titan::cli
