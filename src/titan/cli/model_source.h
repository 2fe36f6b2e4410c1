// The model weights (and, where the source has one, the training state) of any checkpoint titan reads, under
// titan's names with the family and shape they belong to: titan checkpoints, torch DCP directories (torchtitan's),
// Hugging Face directories, Meta's consolidated.NN.pth (+ params.json) and torch.save state dicts. `titan convert`
// and `titan generate` read their --from through it.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "titan/distributed/placement.h"
#include "titan/protocols/model_spec.h"

namespace titan::cli {

struct ModelSource {
  std::string description;  // for messages
  std::string flavor_name;
  const protocols::ModelSpec* spec = nullptr;
  std::shared_ptr<const protocols::ModelArgs> args;
  // In parameter order, then the buffers the source holds: whole, or the piece `piece_of` asked for.
  std::vector<std::pair<std::string, at::Tensor>> weights;
  at::ScalarType stored = at::kFloat;
  bool training_state = false;
  std::map<std::string, at::Tensor> exp_avg, exp_avg_sq;
  std::map<std::string, double> optimizer_steps;
  int64_t step = 0, tokens_seen = 0, lr_completed = 0;
  nlohmann::json optimizer_settings;  // titan checkpoints from this version on
  std::string tokenizer_path;         // the tokenizer the model was trained with, where the source records it
};

// What the command line says of the model: its family (--model) and shape (--flavor, or the [model] section of the
// training job's configuration: --config FILE with --model.KEY VALUE and --training.seq_len overrides, as given to
// `titan train`). Needed where the source does not record them, compared with the source where it does.
struct ModelChoice {
  std::string family, flavor;
  std::shared_ptr<const protocols::ModelArgs> args;  // from a job configuration (`flavor` then names that model)
  std::string option;                                // how the shape was given, for messages ("--flavor 8B")
  bool has_shape() const { return !flavor.empty() || args; }
};

// Whether `args[i]` is a job-configuration argument (--config/--job.config_file FILE, --model.KEY VALUE,
// --training.seq_len VALUE, or the --key=value forms); if so appends it (and its value) to `job` and advances `i`.
bool take_job_argument(const std::vector<std::string>& args, size_t& i, std::vector<std::string>& job);
// The choice --model, --flavor and the job arguments make (UserError for a contradiction or a bad configuration).
ModelChoice model_choice(const std::string& family, const std::string& flavor, const std::vector<std::string>& job);
// The usage lines for the options above.
extern const char* kModelChoiceUsage;

// Reads `from` by what it holds (metadata.json, .metadata, config.json, .pth/.pt files). `choice`'s family and shape
// are needed where the source does not record them and checked against it where it does.
// `from_titan` (when given) says whether it was a titan checkpoint. UserError naming the path otherwise.
// `piece_of` (when given) is asked, once the family and shape are known, which box of each weight to read (tensor
// parallelism: a rank's slices); titan, torch DCP and Hugging Face files are read only there, .pth files whole and
// then cut. Optimizer state is read whole, and not at all with `weights_only`.
using PieceOf = std::function<distributed::Box(const ModelSource& source, const std::string& name, const std::vector<int64_t>& shape)>;
ModelSource read_model_source(const std::string& from, const ModelChoice& choice, bool* from_titan = nullptr,
                              const PieceOf& piece_of = {}, bool weights_only = false);

}  // namespace titan::cli
