#include "titan/models/registry.h"

#include <algorithm>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/models/common/json_fields.h"
#include "titan/models/deepseek_v3/spec.h"
#include "titan/models/llama3/spec.h"
#include "titan/models/qwen3/spec.h"

namespace titan::models {
namespace {

// One line per family.
const std::vector<protocols::ModelSpec>& registered() {
  static const std::vector<protocols::ModelSpec> specs = {
      llama3::spec(),
      qwen3::spec(),
      deepseek_v3::spec(),
  };
  return specs;
}

// config.json's model_type, or "" when the file has none.
std::string hf_model_type(const std::string& path) {
  const nlohmann::json c = read_json_file(path, "a Hugging Face config.json");
  auto it = c.find("model_type");
  if (it == c.end() || it->is_null()) return "";
  if (!it->is_string()) fail(path, ": model_type must be a string, got ", it->dump());
  return it->get<std::string>();
}

std::string hf_types() {
  std::vector<std::string> out;
  for (const auto& s : registered())
    for (const auto& t : s.hf_model_types) out.push_back(quote(t) + " (" + s.name + ")");
  return join(out, ", ");
}

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> out;
  for (const auto& s : registered()) out.push_back(s.name);
  return out;
}

const protocols::ModelSpec& default_model_spec() { return registered().front(); }

const protocols::ModelSpec& model_spec(const std::string& name) {
  for (const auto& s : registered())
    if (s.name == name) return s;
  const std::string hint = closest_match(name, model_names());
  fail("model.name = ", quote(name), " is not a registered model family; registered: ", join(model_names(), ", "),
       hint.empty() ? "" : cat(" (did you mean ", quote(hint), "?)"));
}

const protocols::ModelSpec* spec_for_hf_model_type(const std::string& model_type) {
  for (const auto& s : registered())
    for (const auto& t : s.hf_model_types)
      if (t == model_type) return &s;
  return nullptr;
}

const protocols::ModelSpec& spec_for_hf_directory(const std::string& directory) {
  const std::string path = (std::filesystem::path(directory) / "config.json").string();
  const std::string type = hf_model_type(path);
  // A config.json without model_type is read as the default family's, as titan did before families were registered.
  if (type.empty()) return default_model_spec();
  const auto* spec = spec_for_hf_model_type(type);
  if (!spec) fail(path, ": model_type = ", quote(type), " is not a family titan trains; registered model types: ", hf_types());
  return *spec;
}

const protocols::ModelSpec& job_spec(const config::LoadedConfig& loaded) {
  const config::JobConfig& c = loaded.config;
  const bool name_set = loaded.origins.count("model.name") > 0;
  const bool from_hf = c.checkpoint.initial_load_in_hf && c.checkpoint.initial_load_path;
  if (!from_hf) return model_spec(c.model.name);
  const std::string path = (std::filesystem::path(*c.checkpoint.initial_load_path) / "config.json").string();
  const std::string type = hf_model_type(path);
  if (!name_set) {
    if (type.empty()) return model_spec(c.model.name);
    const auto* spec = spec_for_hf_model_type(type);
    if (!spec)
      fail(path, ": model_type = ", quote(type), " is not a family titan trains (registered model types: ", hf_types(),
           "); set model.name to the family the weights belong to");
    return *spec;
  }
  const auto& spec = model_spec(c.model.name);
  if (!type.empty() && std::find(spec.hf_model_types.begin(), spec.hf_model_types.end(), type) == spec.hf_model_types.end())
    fail("model.name = ", quote(c.model.name), " ", loaded.where("model.name"), " but ", path, " has model_type = ", quote(type),
         ", which belongs to ", [&] {
           const auto* other = spec_for_hf_model_type(type);
           return other ? cat("model.name = ", quote(other->name)) : std::string("no registered family");
         }(),
         "; set model.name to the family of the weights (or leave it out)");
  return spec;
}

bool take_flavor_mask(config::LoadedConfig& loaded, const protocols::ModelArgs& args) {
  if (loaded.origins.count("model.attn_mask_type") || loaded.config.model.attn_mask_type == args.attn_mask_type()) return false;
  loaded.config.model.attn_mask_type = args.attn_mask_type();
  return true;
}

}  // namespace titan::models
