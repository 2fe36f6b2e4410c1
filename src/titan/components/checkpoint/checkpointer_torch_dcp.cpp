// Checkpointer: loading torchtitan's checkpoints (torch DCP directories) into titan's training state.
#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/components/checkpoint/formats/torchtitan_checkpoint.h"

namespace titan::checkpoint {


bool Checkpointer::load_torch_dcp(CheckpointedState& state, const std::string& directory, bool weights_only) {
  const double start = now_seconds();
  torch_dcp::Reader reader(directory);
  auto excluded = [&](const std::string& part) {
    return std::find(config_.exclude_from_loading.begin(), config_.exclude_from_loading.end(), part) !=
           config_.exclude_from_loading.end();
  };
  // The model: torchtitan keeps its weights at the top level under the same names as titan's parameters.
  std::set<std::string> expected;
  for (const auto& p : state.model_args.parameter_shapes()) expected.insert(p.name);
  // torchtitan saves a tied weight under both names (a tied output projection as output.weight too).
  for (const auto& [alias, stored] : state.model_args.tied_aliases()) expected.insert(alias);
  for (const auto& [key, item] : reader.tensors()) {
    const bool other_state = starts_with(key, "optimizer.") || starts_with(key, "lr_scheduler.") ||
                             starts_with(key, "train_state.") || starts_with(key, "dataloader.");
    if (!other_state && !expected.count(key))
      fail("torch DCP checkpoint ", directory, " has tensor ", quote(key), ", which this run's model does not have; is it "
           "a checkpoint of this model family and shape (model.name, model.flavor and [model] keys)?");
  }
  at::NoGradGuard no_grad;
  if (!excluded("model")) {
    for (const auto& p : state.parameters) {
      if (!reader.has_tensor(p.name))
        fail("torch DCP checkpoint ", directory, " has no tensor ", quote(p.name),
             "; torchtitan saves model weights under their own names (is it a model of this shape?)");
      const auto& item = reader.tensors().at(p.name);
      if (item.shape != p.layout.global_shape())
        fail("torch DCP checkpoint tensor ", quote(p.name), " has shape [", join_ints(item.shape), "], the model expects [",
             join_ints(p.layout.global_shape()), "]");
      reader.read_box(p.name, p.layout.local_box().offsets, p.piece().detach());
    }
  }
  const std::optional<int64_t> saved_step = reader.read_integer(torchtitan::kStepKey);
  const bool has_training_state = saved_step.has_value();
  if (!has_training_state && !weights_only)
    for (const auto& [key, item] : reader.tensors())
      if (starts_with(key, "optimizer."))
        fail("torch DCP checkpoint ", directory, " has optimizer state but no ", torchtitan::kStepKey,
             "; titan cannot tell which step it continues from. Load its weights only (checkpoint.initial_load_model_only = true)");
  if (weights_only || !has_training_state) {
    log::info("Loaded model weights from torch DCP checkpoint ", directory,
              has_training_state ? " (model only: training starts at step 1)"
                                 : " (it holds model weights only, as torchtitan's last save: training starts at step 1)",
              strprintf(" in %.2f s", now_seconds() - start));
    return true;
  }
  if (!excluded("optimizer")) {
    state.optimizer.init_state();
    auto& opt = state.optimizer.mutable_state();
    for (size_t i = 0; i < state.parameters.size(); ++i) {
      const auto& p = state.parameters[i];
      const std::string step_key = torchtitan::optimizer_key(p.name, "step");
      if (!reader.has_tensor(step_key)) continue;  // saved before the first optimizer step
      for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
        const std::string key = torchtitan::optimizer_key(p.name, moment);
        if (!reader.has_tensor(key)) fail("torch DCP checkpoint ", directory, " has no tensor ", quote(key));
        at::Tensor& buffer = std::string(moment) == "exp_avg" ? opt[i].exp_avg : opt[i].exp_avg_sq;
        if (reader.tensors().at(key).shape != p.layout.global_shape())
          fail("torch DCP checkpoint tensor ", quote(key), " has shape [", join_ints(reader.tensors().at(key).shape),
               "], the optimizer keeps [", join_ints(p.layout.global_shape()), "]");
        reader.read_box(key, p.layout.local_box().offsets, distributed::unpadded(buffer, p.layout));
      }
      opt[i].step.copy_(reader.read(step_key).reshape({}));
    }
  }
  const int64_t step = *saved_step;
  if (!excluded("lr_scheduler"))
    if (auto epoch = reader.read_integer(torchtitan::kLrEpochKey)) state.lr_scheduler.set_completed(*epoch);
  if (!excluded("train_state")) {
    state.train.step = step;
    // torchtitan counts each rank's own tokens; titan counts all ranks': times its data-parallel world size.
    const int64_t ranks = reader.read_integer(torchtitan::kDataWorldSizeKey).value_or(1);
    state.train.tokens_seen = reader.read_integer(torchtitan::kTokensKey).value_or(0) * std::max<int64_t>(ranks, 1);
  }
  // torchtitan's data loader state is a pickled Python StatefulDataLoader: nothing titan's loader can continue from.
  log::warn("torch DCP checkpoint ", directory, ": the data loader starts from the beginning of the data (torchtitan's "
            "data loader state has no titan equivalent); the model, optimizer, LR schedule and step continue");
  log::info(strprintf("Loaded torch DCP checkpoint %s (step %lld: model, optimizer, LR schedule) in %.2f s", directory.c_str(),
                      static_cast<long long>(step), now_seconds() - start));
  return true;
}

}  // namespace titan::checkpoint
