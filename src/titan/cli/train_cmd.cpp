// `titan train`: load the job config (TOML + overrides) and run the trainer.
#include <iostream>

#include "titan/cli/commands.h"
#include "titan/common/error.h"
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
  try {
    return trainer.train();
  } catch (const UserError&) {  // main's exit codes: 2 for errors in what the user gave, 1 for the rest
    trainer.record_failure(2);
    throw;
  } catch (...) {
    trainer.record_failure(1);
    throw;
  }
}

}  // namespace titan::cli
