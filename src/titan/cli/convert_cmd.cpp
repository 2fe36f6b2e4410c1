// `titan convert`: model weights (and, between titan and torchtitan checkpoints, the training state) from one
// format into another: titan checkpoints, torch DCP directories (torchtitan's checkpoints), Hugging Face
// safetensors directories, torch.save files and Meta's consolidated .pth shards.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>

#include "titan/cli/arguments.h"
#include "titan/cli/commands.h"
#include "titan/cli/gguf_export.h"
#include "titan/cli/model_source.h"
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
    "usage: titan convert --from PATH --to PATH [--format titan|hf|dcp|pt|gguf] [--model NAME] [--flavor F]\n"
    "                     [--config FILE] [--model.KEY VALUE]...\n"
    "                     [--dtype float32|bfloat16|float16] [--tokenizer PATH] [--max-shard-mb N]\n"
    "                     [--gguf-type f32|f16|bf16|q8_0]\n"
    "  --from: a titan checkpoint step directory (metadata.json), a torch DCP directory (.metadata: torchtitan's\n"
    "          checkpoints), a Hugging Face directory (config.json + safetensors), Meta's consolidated.00.pth or a\n"
    "          folder of consolidated.NN.pth model-parallel shards (their params.json gives the shape), or any torch.save\n"
    "          state dict with titan's names (also one level down: {\"model\": state_dict}).\n"
    "  --format of --to: titan (a model-only titan checkpoint directory, for checkpoint.initial_load_path), hf (a\n"
    "          Hugging Face directory: config.json, model.safetensors or shards + index), dcp (a torch DCP directory in\n"
    "          torchtitan's layout: the weights, and from a full titan checkpoint the AdamW state, step and LR schedule\n"
    "          too), pt (a torch.save file of the weights), gguf (a llama.cpp file: Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3;\n"
    "          the tokenizer embedded). Default: pt when --to ends in .pt/.pth, gguf for .gguf, hf from a titan checkpoint,\n"
    "          titan from anything else.\n"
    "  --gguf-type: the GGUF matrices' type (norms stay F32); default f32, or bf16/f16 as the weights are stored.\n"
    "  --model: the model family (model.name: llama3, qwen3, deepseek_v3) where the source does not record it (torch DCP, .pth;\n"
    "          default llama3); titan checkpoints and Hugging Face directories (model_type) carry theirs.\n"
    "  --flavor: the model's shape where the source does not record it (torch DCP, a .pth without params.json); titan\n"
    "          checkpoints, Hugging Face directories and Meta's params.json carry theirs, and a --flavor given is compared\n"
    "          with it field by field.\n"
    "  --dtype: of the written weights (default: as stored).\n"
    "  --tokenizer: for --format hf and gguf, the tokenizer whose files (tokenizer.json + tokenizer_config.json) go into the\n"
    "          export; for a titan checkpoint, the tokenizer it records; default: the one a titan checkpoint's run used,\n"
    "          or an HF directory's own.\n";

// `tokenizer`: recorded in the metadata (as a run records its own), so that `titan generate` and later exports find it.
void write_titan(const ModelSource& s, const std::string& to, const std::string& tokenizer) {
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
  if (!tokenizer.empty() && fs::exists(tokenizer)) metadata["tokenizer"] = fs::absolute(tokenizer).string();
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
void write_dcp(const ModelSource& s, const std::string& to) {
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
  std::string from, to, model_name, flavor_name, dtype_name, format, tokenizer_path, gguf_type;
  int64_t max_shard_mb = 5000;
  std::vector<std::string> job;  // --config and --model.KEY arguments
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << kConvertUsage << kModelChoiceUsage;
      return 0;
    }
    if (take_job_argument(args, i, job)) continue;
    static const std::vector<std::string> with_value = {"--from", "--to", "--model", "--flavor", "--dtype", "--format",
                                                        "--tokenizer", "--max-shard-mb", "--gguf-type"};
    // An unknown option is named as such even at the end of the line (not as one that "expects a value").
    if (std::find(with_value.begin(), with_value.end(), a) == with_value.end())
      fail("unknown option ", quote(a), " for `titan convert`\n", kConvertUsage);
    if (i + 1 >= args.size()) fail(a, " expects a value\n", kConvertUsage);
    const std::string v = args[++i];
    if (a == "--from") from = v;
    else if (a == "--to") to = v;
    else if (a == "--model") model_name = v;
    else if (a == "--flavor") flavor_name = v;
    else if (a == "--dtype") dtype_name = v;
    else if (a == "--format") format = v;
    else if (a == "--tokenizer") tokenizer_path = v;
    else if (a == "--max-shard-mb") max_shard_mb = positive_integer_argument(a, v);
    else if (a == "--gguf-type") gguf_type = v;
    else fail("unknown option ", quote(a), " for `titan convert`\n", kConvertUsage);
  }
  if (from.empty() || to.empty()) fail("`titan convert` needs --from and --to\n", kConvertUsage);
  // "out/" names the folder "out": the checkpoint is written beside it as "out.partial" and renamed into place.
  for (std::string* path : {&from, &to})
    while (path->size() > 1 && path->back() == '/') path->pop_back();
  if (!format.empty() && format != "titan" && format != "hf" && format != "dcp" && format != "pt" && format != "gguf")
    fail("--format ", quote(format), ": expected titan, hf, dcp, pt or gguf");

  bool from_titan = false;
  ModelSource source = read_model_source(from, model_choice(model_name, flavor_name, job), &from_titan);
  if (!dtype_name.empty()) {
    if (dtype_name != "float32" && dtype_name != "bfloat16" && dtype_name != "float16")
      fail("--dtype ", quote(dtype_name), ": expected float32, bfloat16 or float16 (the weights' dtype in the written files)");
    const at::ScalarType dtype = checkpoint::parse_dtype(dtype_name, "--dtype");
    if (source.training_state && format == "dcp")
      std::cerr << "warning: --dtype " << dtype_name << " casts the weights only; the AdamW state keeps its dtype, and a "
                << "run resuming from this checkpoint trains in the weights' new dtype\n";
    for (auto& [name, t] : source.weights) t = t.to(dtype);
    source.stored = dtype;
  }
  if (format.empty())
    format = ends_with(to, ".pt") || ends_with(to, ".pth") ? "pt" : ends_with(to, ".gguf") ? "gguf" : from_titan ? "hf" : "titan";
  if (!gguf_type.empty() && format != "gguf") fail("--gguf-type is for --format gguf (the output is ", format, ")");
  if (format == "gguf") {
    const std::string path = !tokenizer_path.empty() ? tokenizer_path : source.tokenizer_path;
    if (path.empty() || !fs::exists(path))
      fail("--format gguf embeds the tokenizer: ", source.description,
           path.empty() ? " records none" : " records " + path + ", which no longer exists", "; pass --tokenizer PATH");
    if (gguf_type.empty())
      gguf_type = source.stored == at::kBFloat16 ? "bf16" : source.stored == at::kHalf ? "f16" : "f32";
    write_gguf(source, to, gguf_type, *tokenizer::load(path));
    return 0;
  }
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
    write_titan(source, to, !tokenizer_path.empty() ? tokenizer_path : source.tokenizer_path);
  }
  return 0;
}

}  // namespace titan::cli
