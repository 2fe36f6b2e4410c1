// The family and model a job trains, decided as `titan train` decides them and as `titan plan` and `titan estimate`
// predict them: from the configuration (a flavor and [model] keys, or a Hugging Face folder's config.json), or from
// what a titan checkpoint records where that checkpoint decides the model.
#pragma once
#include <string>

#include "titan/config/loader.h"
#include "titan/protocols/model_spec.h"

namespace titan {

struct JobChoice {
  const protocols::ModelSpec* spec = nullptr;
  protocols::JobModel model;
  std::string checkpoint_flavor;  // the flavor name the run's checkpoints record
  std::string source;             // where a checkpoint decided the model, for the log; empty when the configuration did
};

// A checkpoint's record decides the model
// - when the run resumes (checkpoint.folder holds a checkpoint) and started from a Hugging Face folder
//   (initial_load_in_hf) or named no flavor: the folder it started from is not read again;
// - when the run starts from a titan checkpoint (checkpoint.initial_load_path, no initial_load_in_hf) and names no
//   flavor: it trains the model that checkpoint holds.
// model.name, when set, must be the recorded family (UserError naming both otherwise); [model] keys set must agree
// with the recorded shape. Reads files only: every rank decides alike.
JobChoice choose_job_model(const config::LoadedConfig& loaded);

}  // namespace titan
