#include "titan/trainer/job_model.h"

#include <filesystem>
#include <optional>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/formats/dcp.h"
#include "titan/models/common/decoder_job.h"
#include "titan/models/registry.h"

namespace titan {
namespace {

namespace fs = std::filesystem;

// What a titan checkpoint directory records of its model; nothing for other directories (torch DCP, Hugging Face)
// and for checkpoints written before the model was recorded.
std::optional<protocols::RecordedModel> recorded_in(const std::string& directory) {
  if (!fs::exists(fs::path(directory) / "metadata.json")) return std::nullopt;
  const checkpoint::Reader reader(directory);
  const nlohmann::json& meta = reader.metadata();
  if (!meta.contains("model") || !meta.at("model").is_object()) return std::nullopt;
  return protocols::RecordedModel{meta.at("model"), meta.value("flavor", "custom"), (fs::path(directory) / "metadata.json").string()};
}

}  // namespace

JobChoice choose_job_model(const config::LoadedConfig& loaded) {
  const config::JobConfig& c = loaded.config;
  JobChoice out;
  std::optional<protocols::RecordedModel> recorded;
  const bool flavor_named = loaded.origins.count("model.flavor") && c.model.flavor != models::kHfFlavor;
  if (c.checkpoint.initial_load_path) {
    const auto resume = checkpoint::Checkpointer::resume_directory(c.checkpoint, c.job.dump_folder);
    if (resume && (c.checkpoint.initial_load_in_hf || !flavor_named)) {
      recorded = recorded_in(*resume);
      // With a flavor named, the record only spares the folder's config.json a second comparison.
      if (recorded && !flavor_named)
        out.source = cat("Resuming from ", *resume, ": the model is the one it records (checkpoint.initial_load_path ",
                         quote(*c.checkpoint.initial_load_path), " is not read for it)");
    } else if (!resume && !c.checkpoint.initial_load_in_hf && !flavor_named) {
      recorded = recorded_in(*c.checkpoint.initial_load_path);
      if (recorded)
        out.source = cat("Model from ", *c.checkpoint.initial_load_path, ", the checkpoint the run starts from (model.flavor ",
                         c.model.flavor == models::kHfFlavor ? "= \"hf\"" : "is not set", ")");
    }
  }
  if (!recorded) {
    out.spec = &models::job_spec(loaded);
    out.model = out.spec->job_model(loaded);
    out.checkpoint_flavor = c.model.flavor;
    return out;
  }
  // Checkpoints from before families were recorded hold the default family's model.
  const nlohmann::json* family = recorded->model.contains("family") ? &recorded->model.at("family") : nullptr;
  const std::string name = family && family->is_string() ? family->get<std::string>() : models::default_model_spec().name;
  if (loaded.origins.count("model.name") && c.model.name != name)
    fail("model.name = ", quote(c.model.name), " ", loaded.where("model.name"), " but ", recorded->where, " records a ", name,
         " model; leave model.name out or set it to ", quote(name));
  out.spec = &models::model_spec(name);
  out.model = out.spec->recorded_job_model(loaded, *recorded);
  out.checkpoint_flavor = flavor_named ? c.model.flavor : recorded->flavor;
  return out;
}

}  // namespace titan
