#include "titan/components/checkpoint/model_weights.h"

#include <set>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/config/dtypes.h"

namespace titan::checkpoint {

using json = nlohmann::json;

ModelWeights::ModelWeights(std::vector<distributed::ShardedParameter>& parameters, const protocols::ModelArgs& args,
                           std::string flavor, std::string tokenizer_path, std::vector<distributed::ShardedParameter>* buffers)
    : parameters_(parameters), buffers_(buffers), args_(args), flavor_(std::move(flavor)), tokenizer_path_(std::move(tokenizer_path)) {}

protocols::SavedState ModelWeights::state_dict(const protocols::SaveOptions& options) const {
  protocols::SavedState saved;
  for (const auto& p : parameters_) {
    if (!p.layout.owner()) continue;
    at::Tensor piece = p.piece().detach();
    if (options.weights_dtype) piece = piece.to(*options.weights_dtype);
    saved.tensors.push_back({key(p.name), piece, p.layout.local_box().offsets, p.layout.global_shape()});
  }
  // Model-only saves keep them too: the bias decides routing at inference (DeepSeek's e_score_correction_bias).
  if (buffers_)
    for (const auto& b : *buffers_)
      if (b.layout.owner()) saved.tensors.push_back({key(b.name), b.local.detach().clone(), b.layout.local_box().offsets, b.layout.global_shape()});
  saved.global = {{"flavor", flavor_}, {"model", args_.to_json()}};
  if (!tokenizer_path_.empty()) saved.global["tokenizer"] = tokenizer_path_;
  return saved;
}

void ModelWeights::load_state_dict(protocols::StateSource& source) {
  const json& meta = source.metadata();
  const std::string saved_flavor = meta.contains("flavor") && meta["flavor"].is_string() ? meta["flavor"].get<std::string>() : "?";
  if (meta.contains("model") && meta["model"].is_object() && meta["model"].contains("family") && meta["model"]["family"].is_string() &&
      meta["model"]["family"].get<std::string>() != args_.family())
    fail(source.name(), " was saved from a ", meta["model"]["family"].get<std::string>(), " model (flavor ", quote(saved_flavor),
         "); this run trains ", args_.family(), " (model.name); set model.name and model.flavor to the checkpoint's, or "
         "point checkpoint.folder elsewhere");
  // Where a tensor is missing or misshapen: the checkpoint's model against this run's, as far as its metadata says.
  const auto origin = [&]() -> std::string {
    std::string from = saved_flavor == "?" ? std::string("a model of another shape or family") : cat("flavor ", quote(saved_flavor));
    if (meta.contains("model") && meta["model"].is_object()) {
      try {
        const auto saved = args_.parse_json(meta["model"], source.name());
        if (const auto differences = saved->computation_differences(args_); !differences.empty())
          from += cat(" (the checkpoint's vs this run's: ", join(differences, "; "), ")");
      } catch (const UserError&) {
      }
    }
    return from;
  };
  // Every parameter of the model, not just this rank's (a pipeline stage holds some of them); tied aliases are the
  // names torchtitan's state dicts also carry.
  std::set<std::string> expected;
  for (const auto& p : args_.parameter_shapes()) expected.insert(key(p.name));
  for (const auto& [alias, stored] : args_.tied_aliases()) expected.insert(key(alias));
  for (const auto& b : args_.buffer_shapes()) expected.insert(key(b.name));
  for (const auto& k : source.keys())
    if (starts_with(k, "model.") && !expected.count(k))
      fail(source.name(), " has tensor ", quote(source.key_name(k)), ", which this run's model does not have (flavor ",
           quote(flavor_), "); it was saved from ", origin());
  at::NoGradGuard no_grad;
  for (auto& p : parameters_) {
    const std::string k = key(p.name);
    const auto entry = source.entry(k);
    if (!entry)
      fail(source.name(), " has no tensor ", quote(source.key_name(k)), "; it was saved from ", origin(), ", this run uses ",
           quote(flavor_));
    if (entry->shape != p.layout.global_shape())
      fail(source.name(), ": tensor ", quote(source.key_name(k)), " has shape [", join_ints(entry->shape),
           "], the model expects [", join_ints(p.layout.global_shape()), "]; it was saved from ", origin());
    if (source.exact_dtypes() && entry->dtype != p.local.scalar_type())
      fail(source.name(), ": tensor ", quote(source.key_name(k)), " is ", titan::config::dtype_name(entry->dtype),
           ", the model trains in ", titan::config::dtype_name(p.local.scalar_type()),
           "; a resumable checkpoint must match training.dtype");
    source.read_box(k, p.layout.local_box().offsets, p.piece().detach());
  }
  if (buffers_) {
    int64_t missing = 0;
    for (auto& b : *buffers_) {
      const std::string k = key(b.name);
      const auto entry = source.entry(k);
      if (!entry) {
        ++missing;
        continue;
      }
      if (entry->shape != b.layout.global_shape())
        fail(source.name(), ": tensor ", quote(source.key_name(k)), " has shape [", join_ints(entry->shape), "], the model expects [",
             join_ints(b.layout.global_shape()), "]");
      at::Tensor value = at::empty(b.layout.global_shape(), b.local.options().device(at::kCPU));
      source.read_box(k, std::vector<int64_t>(b.layout.global_shape().size(), 0), value);
      b.local.detach().copy_(value);
    }
    if (missing > 0)
      log::info(source.name(), " has no ", missing == static_cast<int64_t>(buffers_->size()) ? "" : cat(missing, " of the "),
                "MoE balancing biases (", buffers_->front().name, ", ...); they start at zero, and balancing ",
                "(model.moe_load_balance_coeff) moves them as the run trains. A Hugging Face export of a format with no "
                "place for them (Qwen3-MoE's) leaves them out and then routes differently; set "
                "model.moe_load_balance_coeff = 0 to train a model that exports exactly");
  }
  if (meta.contains("model")) {
    // Same shapes can still compute differently (RoPE base and scaling, norm epsilon): say so, as long-context
    // extension changes them on purpose.
    const auto differences = args_.parse_json(meta.at("model"), source.name() + ": metadata field model")->computation_differences(args_);
    if (!differences.empty())
      log::warn(source.name(), " was saved from a model that computes differently than this run's (saved vs now): ",
                join(differences, "; "));
  } else if (saved_flavor != "?" && saved_flavor != flavor_) {
    log::warn(source.name(), " was saved from model flavor ", quote(saved_flavor), ", this run uses ", quote(flavor_),
              "; every tensor's shape matches, so it loads");
  }
}

}  // namespace titan::checkpoint
