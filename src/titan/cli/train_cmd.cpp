// `titan train`: load the job config (TOML + overrides) and run the trainer.
#include <iostream>

#include "titan/cli/commands.h"
#include "titan/config/loader.h"
#include "titan/trainer/trainer.h"

namespace titan::cli {

int run_train(const std::vector<std::string>& args) {
  auto loaded = config::load_job_config(args);
  if (loaded.help_requested) {
    std::cout << config::help_text();
    return 0;
  }
  Trainer trainer(std::move(loaded));
  return trainer.train();
}

}  // namespace titan::cli
