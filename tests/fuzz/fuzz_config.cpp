// libFuzzer harness: the job config loader, from a TOML file (first byte even) or from command-line arguments, one
// per line (first byte odd), then validation.
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "titan/config/loader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    const std::string path = titan_fuzz::write_file("job.toml", data + 1, size - 1);
    titan_fuzz::refusals_allowed([&] {
      auto loaded = titan::config::load_toml_file(path);
      titan::config::validate(loaded);
    });
    return 0;
  }
  std::vector<std::string> args;
  std::string current;
  for (size_t i = 1; i < size; ++i) {
    if (data[i] == '\n') {
      args.push_back(current);
      current.clear();
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  args.push_back(current);
  // A config file named on the command line must be the fuzzer's own, never an arbitrary (or endless) path.
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].find("config_file") != std::string::npos) return 0;
  titan_fuzz::refusals_allowed([&] { titan::config::load_job_config(args); });
  return 0;
}
