#include "titan/trainer/train_state.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cstring>

#include "titan/common/error.h"

namespace titan {

using json = nlohmann::json;

protocols::SavedState TrainState::state_dict(const protocols::SaveOptions&) const {
  protocols::SavedState saved;
  saved.global = {{"train_state", {{"step", step}, {"tokens_seen", tokens_seen}}}};
  const at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
  const auto* bytes = rng.data_ptr<uint8_t>();
  saved.rank = {{"rng", std::vector<uint8_t>(bytes, bytes + rng.numel())}};
  return saved;
}

void TrainState::load_state_dict(protocols::StateSource& source) {
  const json& meta = source.metadata();
  if (!meta.contains("train_state"))
    fail(source.name(), " holds no train state (step and tokens seen); load its weights only "
         "(checkpoint.initial_load_model_only = true)");
  step = meta["train_state"].at("step").get<int64_t>();
  tokens_seen = meta["train_state"].at("tokens_seen").get<int64_t>();
  if (const json* own = source.own_rank(); own && own->contains("rng")) {
    const auto bytes = (*own)["rng"].get<std::vector<uint8_t>>();
    at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(state);
  }
}

}  // namespace titan
