// `titan convert`: model weights (and, between titan and torchtitan checkpoints, the training state) from one
// format into another: titan checkpoints, torch DCP directories (torchtitan's checkpoints), Hugging Face
// safetensors directories, torch.save files and Meta's consolidated .pth shards.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>

#include "titan/cli/commands.h"
#include "titan/common/error.h"
#include "titan/common/progress.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/dcp.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/formats/pickle_writer.h"
#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/components/checkpoint/formats/torch_load.h"
#include "titan/components/checkpoint/formats/torch_save.h"
#include "titan/components/checkpoint/formats/torchtitan_checkpoint.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/models/registry.h"

namespace titan::cli {
namespace {

namespace fs = std::filesystem;

const char* kConvertUsage =
    "usage: titan convert --from PATH --to PATH [--format titan|hf|dcp|pt] [--model NAME] [--flavor F]\n"
    "                     [--dtype float32|bfloat16|float16] [--tokenizer PATH] [--max-shard-mb N]\n"
    "  --from: a titan checkpoint step directory (metadata.json), a torch DCP directory (.metadata: torchtitan's\n"
    "          checkpoints), a Hugging Face directory (config.json + safetensors), Meta's consolidated.00.pth or a\n"
    "          folder of consolidated.NN.pth model-parallel shards (their params.json gives the shape), or any torch.save\n"
    "          state dict with titan's names (also one level down: {\"model\": state_dict}).\n"
    "  --format of --to: titan (a model-only titan checkpoint directory, for checkpoint.initial_load_path), hf (a\n"
    "          Hugging Face directory: config.json, model.safetensors or shards + index), dcp (a torch DCP directory in\n"
    "          torchtitan's layout: the weights, and from a full titan checkpoint the AdamW state, step and LR schedule\n"
    "          too), pt (a torch.save file of the weights). Default: pt when --to ends in .pt/.pth, hf from a titan\n"
    "          checkpoint, titan from anything else.\n"
    "  --model: the model family (model.name: llama3, qwen3) where the source does not record it (torch DCP, .pth;\n"
    "          default llama3); titan checkpoints and Hugging Face directories (model_type) carry theirs.\n"
    "  --flavor: the model's shape where the source does not record it (torch DCP, a .pth without params.json); titan\n"
    "          checkpoints, Hugging Face directories and Meta's params.json carry theirs, and a --flavor given is compared\n"
    "          with it field by field.\n"
    "  --dtype: of the written weights (default: as stored).\n"
    "  --tokenizer: for --format hf, the tokenizer whose files (tokenizer.json + tokenizer_config.json) go into the\n"
    "          export; default: the one a titan checkpoint's run used, or an HF directory's own.\n";

// What is read from the source: the weights under titan's names, and the training state where it has one.
struct Source {
  std::string description;  // for messages
  std::string flavor_name;
  const protocols::ModelSpec* spec = nullptr;
  std::shared_ptr<const protocols::ModelArgs> args;
  std::vector<std::pair<std::string, at::Tensor>> weights;  // in parameter order
  at::ScalarType stored = at::kFloat;
  bool training_state = false;
  std::map<std::string, at::Tensor> exp_avg, exp_avg_sq;
  std::map<std::string, double> optimizer_steps;
  int64_t step = 0, tokens_seen = 0, lr_completed = 0;
  nlohmann::json optimizer_settings;  // titan checkpoints from this version on
  std::string tokenizer_path;         // the tokenizer the model was trained with, where the source records it
};

std::shared_ptr<const protocols::ModelArgs> flavor_for(const protocols::ModelSpec& spec, const std::string& flavor_name,
                                                      const std::string& what) {
  if (flavor_name.empty())
    fail(what, " does not record the model's shape; pass --flavor (the titan model it holds; --model names its family, default llama3)");
  return spec.flavor(flavor_name);
}

// Every parameter from `get(name, shape)`, checked against the shape the arguments give.
template <typename Get>
void take_weights(Source& s, Get&& get) {
  const auto shapes = s.args->parameter_shapes();
  Progress progress("reading " + s.description, static_cast<int64_t>(shapes.size()), "tensors");
  for (const auto& p : shapes) {
    at::Tensor t = get(p.name);
    progress.advance(1);
    if (!t.defined()) fail(s.description, ": no tensor ", quote(p.name), " (is it a ", s.flavor_name, " model?)");
    if (t.sizes().vec() != p.shape)
      fail(s.description, ": ", quote(p.name), " has shape ", t.sizes(), ", the model (", s.flavor_name, ") expects ",
           at::IntArrayRef(p.shape));
    s.stored = t.scalar_type();
    s.weights.emplace_back(p.name, t);
  }
  // Untrained state (MoE balancing biases) where the source has it: Hugging Face Qwen3-MoE files do not.
  for (const auto& b : s.args->buffer_shapes()) {
    at::Tensor t = get(b.name);
    if (!t.defined()) continue;
    if (t.sizes().vec() != b.shape)
      fail(s.description, ": ", quote(b.name), " has shape ", t.sizes(), ", the model (", s.flavor_name, ") expects ", at::IntArrayRef(b.shape));
    s.weights.emplace_back(b.name, t.to(at::kFloat));
  }
}

Source read_titan(const std::string& from, const std::string& model_name, const std::string& flavor_name) {
  checkpoint::Reader reader(from);
  const auto& meta = reader.metadata();
  Source s;
  s.description = "titan checkpoint " + from;
  // The family it was trained as (checkpoints from before families were recorded hold the default family's model).
  std::string family = models::default_model_spec().name;
  if (meta.contains("model") && meta.at("model").contains("family") && meta.at("model").at("family").is_string())
    family = meta.at("model").at("family").get<std::string>();
  if (!model_name.empty() && model_name != family)
    fail("--model ", model_name, ": ", from, " holds a ", family, " model; leave --model out to convert it as saved");
  s.spec = &models::model_spec(family);
  if (meta.contains("model")) {
    // The shape it was trained with; a --flavor must describe the same model.
    s.args = s.spec->args_from_json(meta.at("model"), from + "/metadata.json: model");
    if (!flavor_name.empty()) {
      const auto differences = s.args->computation_differences(*s.spec->flavor(flavor_name));
      if (!differences.empty())
        fail("--flavor ", flavor_name, " is not the model ", from, " holds (checkpoint vs flavor):\n  ", join(differences, "\n  "),
             "\nleave --flavor out to convert the model as saved");
    }
    s.flavor_name = flavor_name.empty() ? meta.value("flavor", "custom") : flavor_name;
  } else {
    s.flavor_name = flavor_name.empty() ? meta.value("flavor", "") : flavor_name;
    s.args = flavor_for(*s.spec, s.flavor_name, from);
  }
  s.tokenizer_path = meta.value("tokenizer", "");
  auto read = [&](const std::string& key) -> at::Tensor {
    if (!reader.contains(key)) return {};
    const auto& entry = reader.tensors().at(key);
    at::Tensor full = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
    reader.read_box(key, std::vector<int64_t>(entry.shape.size(), 0), full);  // whatever layout saved it
    return full;
  };
  take_weights(s, [&](const std::string& name) { return read("model." + name); });
  if (!meta.value("model_only", false) && meta.contains("optimizer")) {
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

Source read_torch_dcp(const std::string& from, const std::string& model_name, const std::string& flavor_name) {
  checkpoint::torch_dcp::Reader reader(from);
  Source s;
  s.description = "torch DCP checkpoint " + from;
  s.flavor_name = flavor_name;
  s.spec = model_name.empty() ? &models::default_model_spec() : &models::model_spec(model_name);
  s.args = flavor_for(*s.spec, flavor_name, s.description);
  const std::string nested = checkpoint::torch_dcp::nested_model_prefix(reader);  // {"model": state_dict} saves
  if (!nested.empty()) std::cerr << "note: " << from << " holds the model's tensors under \"model.\"; read them from there\n";
  take_weights(s, [&](const std::string& name) {
    return reader.has_tensor(nested + name) ? reader.read(nested + name) : at::Tensor();
  });
  return s;
}

Source read_hf(const std::string& from, const std::string& model_name, const std::string& flavor_name) {
  // The family is config.json's model_type, the shape its fields; a --flavor is checked against it field by field
  // (HfReader).
  Source s;
  s.description = "Hugging Face model " + from;
  s.spec = &models::spec_for_hf_directory(from);
  if (!model_name.empty() && model_name != s.spec->name)
    fail("--model ", model_name, ": ", from, "/config.json describes a ", s.spec->name, " model; leave --model out to convert it as it is");
  s.args = s.spec->read_hf_config((fs::path(from) / "config.json").string());
  s.flavor_name = flavor_name.empty() ? "custom" : flavor_name;
  if (!flavor_name.empty()) s.args = s.spec->flavor(flavor_name)->with_context_length(s.args->context_length());
  for (const char* file : {"tokenizer.json", "tokenizer.model"})
    if (s.tokenizer_path.empty() && fs::exists(fs::path(from) / file)) s.tokenizer_path = (fs::path(from) / file).string();
  const auto adapter = s.spec->state_dict_adapter(*s.args);
  checkpoint::HfReader reader(from, *s.args, *adapter);  // checks config.json against the arguments and every weight's shape
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : s.args->parameter_shapes()) shapes[p.name] = p.shape;
  for (const auto& b : s.args->buffer_shapes())
    if (reader.contains(b.name)) shapes[b.name] = b.shape;  // DeepSeek-V3's e_score_correction_bias
  take_weights(s, [&](const std::string& name) {
    if (!shapes.count(name)) return at::Tensor();  // state HF files do not hold (Qwen3-MoE's balancing biases)
    at::Tensor t = at::empty(shapes.at(name), at::TensorOptions().dtype(reader.dtype(name)));
    reader.read_box(name, std::vector<int64_t>(t.dim(), 0), t);
    return t;
  });
  return s;
}

// Meta's original checkpoints: consolidated.00.pth, or consolidated.00..NN.pth model-parallel shards (70B: 8), with
// params.json beside them; or any torch.save state dict (one wrapping level, {"model": state_dict}, unwrapped).
Source read_pth(const std::vector<std::string>& parts, const std::string& from, const std::string& model_name,
                const std::string& flavor_name) {
  Source s;
  s.description = parts.size() == 1 ? parts[0] : from;
  s.spec = model_name.empty() ? &models::default_model_spec() : &models::model_spec(model_name);
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
    if (!flavor_name.empty()) {
      const auto differences = s.args->computation_differences(*s.spec->flavor(flavor_name));
      if (!differences.empty())
        fail("--flavor ", flavor_name, " is not the model ", params.string(), " describes (params.json vs flavor):\n  ",
             join(differences, "\n  "), "\nleave --flavor out to import the model params.json describes");
      s.flavor_name = flavor_name;
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
    s.flavor_name = flavor_name;
    s.args = flavor_for(*s.spec, flavor_name, s.description);
  }
  take_weights(s, [&](const std::string& name) { return weights.count(name) ? weights.at(name) : at::Tensor(); });
  return s;
}

void write_titan(const Source& s, const std::string& to) {
  if (fs::exists(to)) fail("--to ", quote(to), " exists; choose a new directory so nothing is overwritten");
  const std::string partial = to + ".partial";
  fs::remove_all(partial);
  fs::create_directories(partial);
  checkpoint::RankWriter writer(partial, 0);
  {
    int64_t bytes = 0;
    for (const auto& [name, t] : s.weights) bytes += static_cast<int64_t>(t.nbytes());
    Progress progress("writing " + to, bytes, "bytes");
    for (const auto& [name, t] : s.weights) {
      writer.add("model." + name, t, std::vector<int64_t>(t.dim(), 0), t.sizes().vec());
      progress.advance(static_cast<int64_t>(t.nbytes()));
    }
  }
  nlohmann::json metadata = checkpoint::merge_rank_parts({writer.finish()});
  metadata.update(checkpoint::metadata_header(0, /*model_only=*/true, /*world_size=*/1, s.flavor_name));
  metadata["model"] = s.args->to_json();
  checkpoint::commit(partial, to, metadata);
  std::cerr << "wrote titan checkpoint " << to << " (" << s.flavor_name << ", model only) from " << s.description << "\n";
}

std::string pickled_int(int64_t v) {
  pickle::Writer p;
  p.integer(v);
  p.stop();
  return p.out;
}

std::string pickled_float(double v) {
  pickle::Writer p;
  p.real(v);
  p.stop();
  return p.out;
}

// torchtitan's layout (torchtitan_checkpoint.h): model weights at the top level; with the training state also the
// AdamW state and param_groups as torch.optim keeps them, the LR schedule (a LambdaLR) and the train state.
void write_dcp(const Source& s, const std::string& to) {
  namespace tt = checkpoint::torchtitan;
  using checkpoint::torch_dcp::ObjectToWrite;
  using checkpoint::torch_dcp::TensorToWrite;
  std::vector<TensorToWrite> tensors;
  std::vector<ObjectToWrite> objects;
  for (const auto& [name, t] : s.weights) tensors.push_back({name, {name}, t});
  // torchtitan's MoE models keep their balancing biases in the model state (persistent buffers), zero when the
  // source had none.
  for (const auto& b : s.args->buffer_shapes())
    if (std::none_of(s.weights.begin(), s.weights.end(), [&](const auto& w) { return w.first == b.name; }))
      tensors.push_back({b.name, {b.name}, at::zeros(b.shape, at::kFloat)});
  // torchtitan's model state dict holds a tied weight under both names (its optimizer state once).
  for (const auto& [alias, stored] : s.args->tied_aliases())
    for (const auto& [name, t] : s.weights)
      if (name == stored) tensors.push_back({alias, {alias}, t});
  if (s.training_state) {
    const auto& o = s.optimizer_settings;
    if (o.is_null())
      fail(s.description, " was saved by an older titan that did not record the optimizer's settings; export the "
           "weights only (a model-only checkpoint) or save again with this version");
    auto object = [&](const std::string& group, const std::string& key, std::string program) {
      objects.push_back({group + "." + key, {group, key}, std::move(program)});
    };
    object("train_state", "step", pickled_int(s.step));
    object("train_state", "ntokens_seen", pickled_int(s.tokens_seen));
    const double lr = o.at("lr").get<double>(), initial_lr = o.at("initial_lr").get<double>();
    // LambdaLR's state_dict (its lr_lambdas are functions: not saved).
    object("lr_scheduler", "last_epoch", pickled_int(s.lr_completed));
    object("lr_scheduler", "_step_count", pickled_int(s.lr_completed + 1));
    pickle::Writer flag;
    flag.boolean(false);
    flag.stop();
    object("lr_scheduler", "_is_initial", flag.out);
    object("lr_scheduler", "_get_lr_called_within_step", flag.out);
    for (const char* key : {"base_lrs", "_last_lr"}) {
      pickle::Writer p;
      p.op(']');
      p.real(std::string(key) == "base_lrs" ? initial_lr : lr);
      p.op('a');
      p.stop();
      object("lr_scheduler", key, p.out);
    }
    const std::string implementation = o.at("implementation").get<std::string>();
    for (const auto& [name, t] : s.weights) {
      if (!s.optimizer_steps.count(name)) continue;
      for (const auto& [field, value] : {std::pair{"exp_avg", s.exp_avg.at(name)}, std::pair{"exp_avg_sq", s.exp_avg_sq.at(name)}})
        tensors.push_back({tt::optimizer_key(name, field), {"optimizer", "state." + name + "." + field}, value});
      tensors.push_back({tt::optimizer_key(name, "step"), {"optimizer", "state." + name + ".step"},
                         at::scalar_tensor(s.optimizer_steps.at(name), at::kFloat)});
      // torch.optim.AdamW's param_group, one per parameter in the flattened layout.
      auto group = [&](const std::string& key, std::string program) {
        objects.push_back({"optimizer.param_groups." + name + "." + key, {"optimizer", "param_groups." + name + "." + key},
                           std::move(program)});
      };
      auto boolean = [](std::optional<bool> v) {
        pickle::Writer p;
        if (v) p.boolean(*v);
        else p.none();
        p.stop();
        return p.out;
      };
      group("lr", pickled_float(lr));
      pickle::Writer betas;
      betas.mark();
      betas.real(o.at("beta1").get<double>());
      betas.real(o.at("beta2").get<double>());
      betas.op('t');
      betas.stop();
      group("betas", betas.out);
      group("eps", pickled_float(o.at("eps").get<double>()));
      group("weight_decay", pickled_float(o.at("weight_decay").get<double>()));
      group("amsgrad", boolean(false));
      group("maximize", boolean(false));
      group("foreach", implementation == "foreach" ? boolean(true) : implementation == "for-loop" ? boolean(false) : boolean(std::nullopt));
      group("capturable", boolean(false));
      group("differentiable", boolean(false));
      group("fused", implementation == "fused" ? boolean(true) : boolean(std::nullopt));
      group("decoupled_weight_decay", boolean(o.at("name").get<std::string>() == "AdamW"));
      group("initial_lr", pickled_float(initial_lr));
    }
  }
  checkpoint::torch_dcp::write_checkpoint(to, tensors, objects);
  std::cerr << "wrote torch DCP checkpoint " << to << " (" << s.flavor_name << ", "
            << (s.training_state ? cat("step ", s.step, ": model, optimizer, LR schedule, train state") : "model only")
            << ") from " << s.description << "\n";
}

}  // namespace

int run_convert(const std::vector<std::string>& args) {
  std::string from, to, model_name, flavor_name, dtype_name, format, tokenizer_path;
  int64_t max_shard_mb = 5000;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << kConvertUsage;
      return 0;
    }
    if (i + 1 >= args.size()) fail(a, " expects a value\n", kConvertUsage);
    const std::string v = args[++i];
    if (a == "--from") from = v;
    else if (a == "--to") to = v;
    else if (a == "--model") model_name = v;
    else if (a == "--flavor") flavor_name = v;
    else if (a == "--dtype") dtype_name = v;
    else if (a == "--format") format = v;
    else if (a == "--tokenizer") tokenizer_path = v;
    else if (a == "--max-shard-mb") max_shard_mb = std::stoll(v);
    else fail("unknown option ", quote(a), " for `titan convert`\n", kConvertUsage);
  }
  if (from.empty() || to.empty()) fail("`titan convert` needs --from and --to\n", kConvertUsage);
  if (!format.empty() && format != "titan" && format != "hf" && format != "dcp" && format != "pt")
    fail("--format ", quote(format), ": expected titan, hf, dcp or pt");

  Source source;
  bool from_titan = false;
  if (fs::exists(fs::path(from) / "metadata.json")) {
    source = read_titan(from, model_name, flavor_name);
    from_titan = true;
  } else if (checkpoint::torch_dcp::is_checkpoint(from)) {
    source = read_torch_dcp(from, model_name, flavor_name);
  } else if (fs::exists(fs::path(from) / "config.json")) {
    source = read_hf(from, model_name, flavor_name);
  } else {
    std::vector<std::string> parts;
    if (fs::is_directory(from)) {
      for (const auto& e : fs::directory_iterator(from))
        if (e.path().filename().string().starts_with("consolidated.") && e.path().extension() == ".pth") parts.push_back(e.path().string());
      std::sort(parts.begin(), parts.end());
    } else if (fs::is_regular_file(from) && (ends_with(from, ".pth") || ends_with(from, ".pt"))) {
      parts = {from};
    }
    if (parts.empty())
      fail(quote(from), " is neither a titan checkpoint directory (metadata.json), a torch DCP one (.metadata), a "
           "Hugging Face one (config.json) nor .pth files");
    source = read_pth(parts, from, model_name, flavor_name);
  }
  if (!dtype_name.empty()) {
    const at::ScalarType dtype = checkpoint::parse_dtype(dtype_name, "--dtype");
    if (source.training_state && format == "dcp")
      std::cerr << "warning: --dtype " << dtype_name << " casts the weights only; the AdamW state keeps its dtype, and a "
                << "run resuming from this checkpoint trains in the weights' new dtype\n";
    for (auto& [name, t] : source.weights) t = t.to(dtype);
    source.stored = dtype;
  }
  if (format.empty()) format = ends_with(to, ".pt") || ends_with(to, ".pth") ? "pt" : from_titan ? "hf" : "titan";
  if (format == "pt") {
    if (fs::exists(to)) fail("--to ", quote(to), " exists; choose a new file name so nothing is overwritten");
    checkpoint::save_torch(to, source.weights);
    std::cerr << "wrote torch.save file " << to << " (" << source.weights.size() << " tensors, "
              << checkpoint::dtype_string(source.stored) << ") from " << source.description << "\n";
  } else if (format == "hf") {
    // The tokenizer's files go with the model: --tokenizer, else the one the source records (a titan checkpoint's
    // training run, an HF directory's own).
    std::unique_ptr<tokenizer::Tokenizer> tok;
    if (!tokenizer_path.empty()) {
      tok = tokenizer::load(tokenizer_path);
    } else if (!source.tokenizer_path.empty() && fs::exists(source.tokenizer_path)) {
      tok = tokenizer::load(source.tokenizer_path);
    } else {
      std::cerr << "warning: no tokenizer files in the export"
                << (source.tokenizer_path.empty() ? std::string() : " (the recorded tokenizer " + source.tokenizer_path + " no longer exists)")
                << "; pass --tokenizer PATH (a tokenizer file or model.hf_assets_path) so that AutoTokenizer loads it\n";
    }
    checkpoint::save_hf(to, *source.args, *source.spec->state_dict_adapter(*source.args), source.weights, source.stored,
                        max_shard_mb * 1000 * 1000, tok.get());
    std::cerr << "wrote Hugging Face model " << to << " (" << source.flavor_name << ", "
              << checkpoint::dtype_string(source.stored) << ") from " << source.description << "\n";
  } else if (format == "dcp") {
    write_dcp(source, to);
  } else {
    write_titan(source, to);
  }
  return 0;
}

}  // namespace titan::cli
