#include "titan/cli/model_source.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <set>

#include "titan/common/error.h"
#include "titan/common/progress.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/dcp.h"
#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/components/checkpoint/formats/torch_load.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/config/loader.h"
#include "titan/models/registry.h"
#include "titan/trainer/job_model.h"

namespace titan::cli {
namespace {

namespace fs = std::filesystem;

// The family the choice names (the default one, Llama 3, when it names none).
const protocols::ModelSpec& spec_for(const ModelChoice& choice) {
  return choice.family.empty() ? models::default_model_spec() : models::model_spec(choice.family);
}

// The shape the choice gives, for a source that does not record one.
std::shared_ptr<const protocols::ModelArgs> flavor_for(const protocols::ModelSpec& spec, const ModelChoice& choice,
                                                      const std::string& what) {
  if (choice.args) return choice.args;
  if (choice.flavor.empty())
    fail(what, " does not record the model's shape; pass --flavor (a built-in shape: the titan model it holds; --model names "
         "its family, default llama3) or --config with the training job's TOML (and its --model.KEY overrides)");
  return spec.flavor(choice.flavor);
}

// Fails when the choice gives a shape that differs from the one the source records (`recorded`, from `what`).
void check_choice(const protocols::ModelSpec& spec, const ModelChoice& choice, const protocols::ModelArgs& recorded,
                  const std::string& what, const std::string& label, const std::string& purpose) {
  if (!choice.has_shape()) return;
  const auto differences = recorded.computation_differences(*flavor_for(spec, choice, what));
  if (!differences.empty())
    fail(choice.option, " is not the model ", what, " ", label, " (", label == "holds" ? "checkpoint" : "params.json", " vs ",
         choice.args ? "configuration" : "flavor", "):\n  ", join(differences, "\n  "), "\nleave ",
         choice.args ? "the configuration" : "--flavor", " out to ", purpose);
}

// A tensor of the source, read when asked: its whole shape and stored dtype, and how to fill a box of it.
struct Stored {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  std::function<void(const std::vector<int64_t>& offsets, at::Tensor& out)> read;
  at::Tensor whole;  // a tensor already in memory, taken as it is when the whole of it is asked for
  bool defined() const { return static_cast<bool>(read); }
};

// `key` of a checkpoint reader that reads boxes (titan's, torch DCP's, the HF reader).
template <typename Reader>
Stored boxes_of(Reader& reader, std::string key, std::vector<int64_t> shape, at::ScalarType dtype) {
  return {std::move(shape), dtype, [&reader, key = std::move(key)](const std::vector<int64_t>& offsets, at::Tensor& out) {
            reader.read_box(key, offsets, out);  // whatever layout saved it
          },
          at::Tensor()};
}

// A tensor already in memory (a .pth file's).
Stored in_memory(const at::Tensor& t) {
  if (!t.defined()) return {};
  return {t.sizes().vec(), t.scalar_type(),
          [t](const std::vector<int64_t>& offsets, at::Tensor& out) {
            at::Tensor box = t;
            for (size_t d = 0; d < offsets.size(); ++d) box = box.narrow(static_cast<int64_t>(d), offsets[d], out.size(static_cast<int64_t>(d)));
            out.copy_(box);
          },
          t};
}

// Every parameter from `get(name)`, checked against the shape the arguments give, read whole or as the piece
// `piece_of` names.
template <typename Get>
void take_weights(ModelSource& s, Get&& get, const PieceOf& piece_of) {
  const auto shapes = s.args->parameter_shapes();
  Progress progress("reading " + s.description, static_cast<int64_t>(shapes.size()), "tensors");
  auto take = [&](const std::string& name, const Stored& t) {
    const distributed::Box box = piece_of ? piece_of(s, name, t.shape) : distributed::Box::whole(t.shape);
    if (t.whole.defined() && box == distributed::Box::whole(t.shape)) return t.whole;  // no second copy
    at::Tensor out = at::empty(box.lengths, at::TensorOptions().dtype(t.dtype));
    t.read(box.offsets, out);
    return out;
  };
  for (const auto& p : shapes) {
    const Stored t = get(p.name);
    progress.advance(1);
    if (!t.defined()) fail(s.description, ": no tensor ", quote(p.name), " (is it a ", s.flavor_name, " model?)");
    if (t.shape != p.shape)
      fail(s.description, ": ", quote(p.name), " has shape ", at::IntArrayRef(t.shape), ", the model (", s.flavor_name, ") expects ",
           at::IntArrayRef(p.shape));
    s.stored = t.dtype;
    s.weights.emplace_back(p.name, take(p.name, t));
  }
  // Untrained state (MoE balancing biases) where the source has it: Hugging Face Qwen3-MoE files do not.
  for (const auto& b : s.args->buffer_shapes()) {
    const Stored t = get(b.name);
    if (!t.defined()) continue;
    if (t.shape != b.shape)
      fail(s.description, ": ", quote(b.name), " has shape ", at::IntArrayRef(t.shape), ", the model (", s.flavor_name, ") expects ",
           at::IntArrayRef(b.shape));
    s.weights.emplace_back(b.name, take(b.name, t).to(at::kFloat));
  }
}

ModelSource read_titan(const std::string& from, const ModelChoice& choice, const PieceOf& piece_of, bool weights_only) {
  checkpoint::Reader reader(from);
  const auto& meta = reader.metadata();
  ModelSource s;
  s.description = "titan checkpoint " + from;
  // The family it was trained as (checkpoints from before families were recorded hold the default family's model).
  std::string family = models::default_model_spec().name;
  if (meta.contains("model") && meta.at("model").contains("family") && meta.at("model").at("family").is_string())
    family = meta.at("model").at("family").get<std::string>();
  if (!choice.family.empty() && choice.family != family)
    fail(choice.args ? choice.option + " (model.name = " + choice.family + ")" : "--model " + choice.family, ": ", from, " holds a ",
         family, " model; leave it out to convert it as saved");
  s.spec = &models::model_spec(family);
  if (meta.contains("model")) {
    // The shape it was trained with; a --flavor or configuration must describe the same model.
    s.args = s.spec->args_from_json(meta.at("model"), from + "/metadata.json: model");
    check_choice(*s.spec, choice, *s.args, from, "holds", "convert the model as saved");
    s.flavor_name = choice.has_shape() ? choice.flavor : meta.value("flavor", "custom");
  } else {
    ModelChoice recorded = choice;
    if (!choice.has_shape()) recorded.flavor = meta.value("flavor", "");
    s.flavor_name = recorded.flavor;
    s.args = flavor_for(*s.spec, recorded, from);
  }
  s.tokenizer_path = meta.value("tokenizer", "");
  auto read = [&](const std::string& key) -> at::Tensor {
    if (!reader.contains(key)) return {};
    const auto& entry = reader.tensors().at(key);
    at::Tensor full = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
    reader.read_box(key, std::vector<int64_t>(entry.shape.size(), 0), full);  // whatever layout saved it
    return full;
  };
  take_weights(
      s,
      [&](const std::string& name) -> Stored {
        const std::string key = "model." + name;
        if (!reader.contains(key)) return {};
        const auto& entry = reader.tensors().at(key);
        return boxes_of(reader, key, entry.shape, entry.dtype);
      },
      piece_of);
  if (!weights_only && !meta.value("model_only", false) && meta.contains("optimizer")) {
    s.training_state = true;
    for (const auto& [name, step] : meta.at("optimizer").at("steps").items()) {
      s.optimizer_steps[name] = step.get<double>();
      s.exp_avg[name] = read("optimizer.exp_avg." + name);
      s.exp_avg_sq[name] = read("optimizer.exp_avg_sq." + name);
      if (!s.exp_avg[name].defined() || !s.exp_avg_sq[name].defined())
        fail(s.description, ": optimizer state of ", quote(name), " is missing");
    }
    s.step = meta.at("train_state").at("step").get<int64_t>();
    s.tokens_seen = meta.at("train_state").at("tokens_seen").get<int64_t>();
    s.lr_completed = meta.at("lr_scheduler").at("completed").get<int64_t>();
    s.optimizer_settings = meta.value("optimizer_settings", nlohmann::json());
  }
  return s;
}

ModelSource read_torch_dcp(const std::string& from, const ModelChoice& choice, const PieceOf& piece_of) {
  checkpoint::torch_dcp::Reader reader(from);
  ModelSource s;
  s.description = "torch DCP checkpoint " + from;
  s.flavor_name = choice.flavor;
  s.spec = &spec_for(choice);
  s.args = flavor_for(*s.spec, choice, s.description);
  const std::string nested = checkpoint::torch_dcp::nested_model_prefix(reader);  // {"model": state_dict} saves
  if (!nested.empty()) std::cerr << "note: " << from << " holds the model's tensors under \"model.\"; read them from there\n";
  take_weights(
      s,
      [&](const std::string& name) -> Stored {
        const std::string key = nested + name;
        if (!reader.has_tensor(key)) return {};
        const auto& item = reader.tensors().at(key);
        return boxes_of(reader, key, item.shape, item.dtype);
      },
      piece_of);
  return s;
}

ModelSource read_hf(const std::string& from, const ModelChoice& choice, const PieceOf& piece_of) {
  // The family is config.json's model_type, the shape its fields; a --flavor is checked against it field by field
  // (HfReader).
  ModelSource s;
  s.description = "Hugging Face model " + from;
  s.spec = &models::spec_for_hf_directory(from);
  if (!choice.family.empty() && choice.family != s.spec->name)
    fail(choice.args ? choice.option + " (model.name = " + choice.family + ")" : "--model " + choice.family, ": ", from,
         "/config.json describes a ", s.spec->name, " model; leave it out to convert it as it is");
  s.args = s.spec->read_hf_config((fs::path(from) / "config.json").string());
  s.flavor_name = choice.has_shape() ? choice.flavor : "custom";
  if (choice.has_shape()) s.args = flavor_for(*s.spec, choice, from)->with_context_length(s.args->context_length());
  for (const char* file : {"tokenizer.json", "tokenizer.model"})
    if (s.tokenizer_path.empty() && fs::exists(fs::path(from) / file)) s.tokenizer_path = (fs::path(from) / file).string();
  const auto adapter = s.spec->state_dict_adapter(*s.args);
  checkpoint::HfReader reader(from, *s.args, *adapter);  // checks config.json against the arguments and every weight's shape
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : s.args->parameter_shapes()) shapes[p.name] = p.shape;
  for (const auto& b : s.args->buffer_shapes())
    if (reader.contains(b.name)) shapes[b.name] = b.shape;  // DeepSeek-V3's e_score_correction_bias
  take_weights(
      s,
      [&](const std::string& name) -> Stored {
        if (!shapes.count(name)) return {};  // state HF files do not hold (Qwen3-MoE's balancing biases)
        return boxes_of(reader, name, shapes.at(name), reader.dtype(name));
      },
      piece_of);
  return s;
}

// Meta's original checkpoints: consolidated.00.pth, or consolidated.00..NN.pth model-parallel shards (70B: 8), with
// params.json beside them; or any torch.save state dict (one wrapping level, {"model": state_dict}, unwrapped).
ModelSource read_pth(const std::vector<std::string>& parts, const std::string& from, const ModelChoice& choice,
                     const PieceOf& piece_of) {
  ModelSource s;
  s.description = parts.size() == 1 ? parts[0] : from;
  s.spec = &spec_for(choice);
  std::vector<std::map<std::string, at::Tensor>> shards;
  for (const auto& part : parts) {
    std::string unwrapped;
    shards.push_back(checkpoint::load_torch(part, &unwrapped));
    if (!unwrapped.empty())
      std::cerr << "note: " << part << " holds its tensors under " << quote(unwrapped) << "; read them from there\n";
    shards.back().erase("rope.freqs");  // Llama 2's precomputed RoPE table: not a parameter
  }
  std::map<std::string, at::Tensor> weights;
  if (shards.size() == 1) {
    weights = std::move(shards[0]);
  } else {
    // Meta's model parallelism: the embedding and the row-parallel projections (wo, w2) are split along dim 1,
    // the column-parallel ones (wq, wk, wv, w1, w3, output) along dim 0; norms are replicated.
    for (const auto& [name, first] : shards[0]) {
      std::vector<at::Tensor> pieces;
      for (size_t i = 0; i < shards.size(); ++i) {
        auto it = shards[i].find(name);
        if (it == shards[i].end()) fail(quote(parts[i]), ": no tensor ", quote(name), " (shards of different models?)");
        pieces.push_back(it->second);
      }
      if (first.dim() == 1) {
        weights[name] = first;
      } else {
        const bool dim1 = name == "tok_embeddings.weight" || ends_with(name, ".attention.wo.weight") ||
                          ends_with(name, ".feed_forward.w2.weight");
        weights[name] = at::cat(pieces, dim1 ? 1 : 0);
      }
    }
  }
  // Wrappers' prefixes on every name: DDP's "module.", torch.compile's "_orig_mod.", a {"model.<name>"} layout.
  for (bool stripped = true; stripped && !weights.empty();) {
    stripped = false;
    for (const std::string prefix : {"module.", "_orig_mod.", "model."}) {
      if (!std::all_of(weights.begin(), weights.end(), [&](const auto& w) { return starts_with(w.first, prefix); })) continue;
      std::map<std::string, at::Tensor> renamed;
      for (auto& [name, t] : weights) renamed[name.substr(prefix.size())] = std::move(t);
      weights = std::move(renamed);
      std::cerr << "note: every tensor name in " << s.description << " starts with " << quote(prefix) << "; read without it\n";
      stripped = true;
      break;
    }
  }
  // The shape: Meta's params.json beside the files where the family reads it, else --flavor.
  const fs::path params = fs::path(parts[0]).parent_path() / "params.json";
  if (fs::exists(params) && s.spec->read_meta_params) {
    // params.json does not say whether the output reads the embedding's table: the weights do (no output.weight,
    // or one equal to the embedding, as Llama 3.2's 1B and 3B).
    auto output = weights.find("output.weight");
    auto embedding = weights.find("tok_embeddings.weight");
    const bool tied = output == weights.end() ||
                      (embedding != weights.end() && output->second.sizes() == embedding->second.sizes() &&
                       output->second.scalar_type() == embedding->second.scalar_type() && at::equal(output->second, embedding->second));
    s.args = s.spec->read_meta_params(params.string(), tied);
    if (choice.has_shape()) {
      check_choice(*s.spec, choice, *s.args, params.string(), "describes", "import the model params.json describes");
      s.flavor_name = choice.flavor;
    } else {
      // A built-in flavor of the same shape gives its name; anything else is "custom".
      s.flavor_name = "custom";
      for (const auto& name : s.spec->flavor_names())
        if (s.args->computation_differences(*s.spec->flavor(name)).empty()) {
          s.flavor_name = name;
          break;
        }
    }
    std::cerr << "read the model's shape from " << params.string() << " (" << s.flavor_name
              << (tied ? ", output tied to the embedding" : "") << ")\n";
  } else {
    s.flavor_name = choice.flavor;
    s.args = flavor_for(*s.spec, choice, s.description);
  }
  // A file of other names altogether (another model's, another layout's) names a few of them.
  if (const auto shapes = s.args->parameter_shapes(); !shapes.empty() && !weights.count(shapes.front().name)) {
    std::vector<std::string> seen;
    for (const auto& [name, t] : weights) {
      if (seen.size() == 4) break;
      seen.push_back(quote(name));
    }
    fail(s.description, ": no tensor ", quote(shapes.front().name), " (is it a ", s.flavor_name, " model in titan's names?); it holds ",
         weights.size(), " tensor(s)", seen.empty() ? std::string() : cat(", e.g. ", join(seen, ", ")));
  }
  // Each tensor leaves the map as it is taken, so that a piece's whole tensor is freed once the piece is cut.
  take_weights(
      s,
      [&](const std::string& name) {
        auto it = weights.find(name);
        if (it == weights.end()) return Stored{};
        Stored stored = in_memory(it->second);
        weights.erase(it);
        return stored;
      },
      piece_of);
  return s;
}

}  // namespace

const char* kModelChoiceUsage =
    "  --config FILE: the training job's TOML (titan's or torchtitan's), whose [model] section (name, flavor and shape\n"
    "          keys) and training.seq_len give the family and shape, as `titan train` builds them; --model.KEY VALUE\n"
    "          and --training.seq_len VALUE override it as on the training command line (they also work alone, over\n"
    "          the defaults). For a model of custom shape where the source does not record it; compared with the\n"
    "          source where it does.\n";

bool take_job_argument(const std::vector<std::string>& args, size_t& i, std::vector<std::string>& job) {
  const std::string& a = args[i];
  const std::string key = a.substr(0, a.find('='));
  const bool is_config = key == "--config" || key == "--job.config_file";
  if (!is_config && !key.starts_with("--model.") && key != "--training.seq_len") return false;
  const std::string name = is_config ? "--job.config_file" : key;
  if (a.find('=') != std::string::npos) {
    job.push_back(name + a.substr(a.find('=')));
    return true;
  }
  job.push_back(name);
  // As on titan train's command line: a boolean key alone is true and --model.no_KEY false, so the next argument
  // is its value only when it is true or false; any other key takes the next argument unless it is an option.
  static const std::set<std::string> booleans = {"--model.tie_word_embeddings", "--model.print_after_conversion"};
  const bool flag = key.starts_with("--model.no_") || booleans.count(key);
  if (i + 1 < args.size() && (flag ? args[i + 1] == "true" || args[i + 1] == "false" : !args[i + 1].starts_with("--")))
    job.push_back(args[++i]);
  else if (!flag)
    fail(a, " expects a value");
  return true;
}

ModelChoice model_choice(const std::string& family, const std::string& flavor, const std::vector<std::string>& job) {
  ModelChoice choice{family, flavor, nullptr, flavor.empty() ? "" : "--flavor " + flavor};
  if (job.empty()) return choice;
  if (!flavor.empty())
    fail("--flavor ", flavor, " and a job configuration (--config or --model.KEY) both give the shape; name the flavor in "
         "the configuration (model.flavor, or --model.flavor ", flavor, ")");
  config::LoadedConfig loaded = config::load_job_config(job);
  if (!family.empty() && family != loaded.config.model.name) {
    // --model names the family where the configuration leaves model.name at its default.
    if (loaded.origins.count("model.name"))
      fail("--model ", family, " and the configuration's model.name = ", loaded.config.model.name, " ", loaded.where("model.name"), " disagree");
    std::vector<std::string> named = job;
    named.insert(named.end(), {"--model.name", family});
    loaded = config::load_job_config(named);
  }
  // As titan train decides it (a checkpoint's record where that decides the model).
  const JobChoice job_choice = choose_job_model(loaded);
  const auto& spec = *job_choice.spec;
  const auto& model = job_choice.model;
  choice.family = spec.name;
  choice.args = model.args;
  choice.flavor = model.name;
  const auto file = std::find(job.begin(), job.end(), "--job.config_file");
  choice.option = file != job.end() && file + 1 != job.end() ? "--config " + *(file + 1) : join(job, " ");
  return choice;
}

ModelSource read_model_source(const std::string& from, const ModelChoice& choice, bool* from_titan, const PieceOf& piece_of,
                              bool weights_only) {
  if (from_titan) *from_titan = false;
  if (fs::exists(fs::path(from) / "metadata.json")) {
    if (from_titan) *from_titan = true;
    return read_titan(from, choice, piece_of, weights_only);
  }
  if (checkpoint::torch_dcp::is_checkpoint(from)) return read_torch_dcp(from, choice, piece_of);
  if (fs::exists(fs::path(from) / "config.json")) return read_hf(from, choice, piece_of);
  std::vector<std::string> parts;
  if (fs::is_directory(from)) {
    for (const auto& e : fs::directory_iterator(from))
      if (e.path().filename().string().starts_with("consolidated.") && e.path().extension() == ".pth") parts.push_back(e.path().string());
    std::sort(parts.begin(), parts.end());
  } else if (fs::is_regular_file(from) && (ends_with(from, ".pth") || ends_with(from, ".pt"))) {
    parts = {from};
  }
  if (!fs::exists(from)) fail(quote(from), ": no such file or directory");
  if (fs::is_directory(from) && !fs::exists(fs::path(from) / ".metadata"))
    for (const auto& e : fs::directory_iterator(from))
      if (e.path().extension() == ".distcp")
        fail(quote(from), " holds torch.distributed.checkpoint (DCP) data files (*.distcp) but no ",
             quote((fs::path(from) / ".metadata").string()), ", the index DCP writes last: an incomplete save, or a copy that "
             "left out the hidden file");
  if (parts.empty())
    fail(quote(from), " is neither a titan checkpoint directory (metadata.json), a torch DCP one (.metadata), a "
         "Hugging Face one (config.json) nor .pth files");
  return read_pth(parts, from, choice, piece_of);
}

}  // namespace titan::cli
