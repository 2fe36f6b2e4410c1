// Checkpointer: loading torchtitan's checkpoints (torch DCP directories) into titan's training state.
#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/torch_dcp.h"
#include "titan/components/checkpoint/torchtitan_checkpoint.h"

namespace titan::checkpoint {

namespace {

int64_t integer_value(const torch_dcp::Reader& reader, const std::string& key) {
  const pickle::Ptr v = reader.read_object(key);
  if (!v->is(pickle::Value::Kind::integer) || v->integer < 0)
    fail("torch DCP checkpoint ", reader.directory(), ": ", quote(key), " is ", v->describe(), ", expected a non-negative integer");
  return v->integer;
}

}  // namespace

bool Checkpointer::load_torch_dcp(CheckpointedState& state, const std::string& directory, bool weights_only) {
  const double start = now_seconds();
  torch_dcp::Reader reader(directory);
  auto excluded = [&](const std::string& part) {
    return std::find(config_.exclude_from_loading.begin(), config_.exclude_from_loading.end(), part) !=
           config_.exclude_from_loading.end();
  };
  // The model: torchtitan keeps its weights at the top level under the same names as titan's parameters.
  std::set<std::string> expected;
  for (const auto& p : llama3::parameter_shapes(state.model_args)) expected.insert(p.name);
  for (const auto& [key, item] : reader.tensors()) {
    const bool other_state = starts_with(key, "optimizer.") || starts_with(key, "lr_scheduler.") ||
                             starts_with(key, "train_state.") || starts_with(key, "dataloader.");
    if (!other_state && !expected.count(key))
      fail("torch DCP checkpoint ", directory, " has tensor ", quote(key), ", which this run's model does not have; is it "
           "a Llama 3 checkpoint of the same shape (model.flavor and [model] keys)?");
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
  const bool has_training_state = reader.objects().count(torchtitan::kStepKey) > 0;
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
  const int64_t step = integer_value(reader, torchtitan::kStepKey);
  if (!excluded("lr_scheduler") && reader.objects().count(torchtitan::kLrEpochKey))
    state.lr_scheduler.set_completed(integer_value(reader, torchtitan::kLrEpochKey));
  if (!excluded("train_state")) {
    state.train.step = step;
    state.train.tokens_seen = reader.objects().count(torchtitan::kTokensKey) ? integer_value(reader, torchtitan::kTokensKey) : 0;
  }
  // torchtitan's data loader state is a pickled Python StatefulDataLoader: nothing titan's loader can continue from.
  log::warn("torch DCP checkpoint ", directory, ": the data loader starts from the beginning of the data (torchtitan's "
            "data loader state has no titan equivalent); the model, optimizer, LR schedule and step continue");
  log::info(strprintf("Loaded torch DCP checkpoint %s (step %lld: model, optimizer, LR schedule) in %.2f s", directory.c_str(),
                      static_cast<long long>(step), now_seconds() - start));
  return true;
}

}  // namespace titan::checkpoint
