// `titan convert`: titan checkpoints (titan-dcp) to Hugging Face safetensors directories and back.
#include <algorithm>
#include <filesystem>
#include <map>
#include <iostream>

#include "titan/cli/commands.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/torch_load.h"
#include "titan/components/checkpoint/torch_save.h"
#include "titan/models/llama3/args.h"
#include "titan/models/llama3/hf_config.h"

namespace titan::cli {
namespace {

const char* kConvertUsage =
    "usage: titan convert --from PATH --to DIR [--flavor F] [--dtype float32|bfloat16|float16] [--max-shard-mb N]\n"
    "  PATH a titan checkpoint step directory and --to FILE.pt (or .pth): a torch.save file of the model's weights\n"
    "       under titan's (torchtitan's) parameter names, which Python's torch.load reads.\n"
    "  PATH a titan checkpoint step directory (metadata.json): writes a Hugging Face directory (config.json,\n"
    "       model.safetensors or shards + model.safetensors.index.json), q/k rows permuted to HF's RoPE layout;\n"
    "       dtype defaults to the checkpoint's, the model shape to the one it was saved from.\n"
    "  PATH a Hugging Face directory (config.json + safetensors): writes a model-only titan checkpoint directory\n"
    "       DIR for checkpoint.initial_load_path (or place it as {folder}/step-0); the shape comes from config.json\n"
    "       (--flavor, when given, must describe the same model, field by field).\n"
    "  PATH Meta's consolidated.00.pth, a folder of consolidated.NN.pth model-parallel shards (merged), or any\n"
    "       torch.save state dict with titan's names: a model-only titan checkpoint directory DIR (--flavor required).\n";

// A model-only titan checkpoint directory at `to` from full tensors under titan names.
void write_model_only(const std::string& to, const std::string& flavor_name, const llama3::ModelArgs& model_args,
                      const std::map<std::string, at::Tensor>& weights, const std::string& dtype_name,
                      const std::string& from) {
  namespace fs = std::filesystem;
  for (const auto& p : llama3::parameter_shapes(model_args)) {
    auto it = weights.find(p.name);
    if (it == weights.end()) fail(quote(from), ": no tensor ", quote(p.name), " (is it a ", flavor_name, " model?)");
    if (it->second.sizes().vec() != p.shape)
      fail(quote(from), ": ", quote(p.name), " has shape ", it->second.sizes(), ", flavor ", flavor_name, " expects ",
           at::IntArrayRef(p.shape));
  }
  if (fs::exists(to)) fail("--to ", quote(to), " exists; choose a new directory so nothing is overwritten");
  const std::string partial = to + ".partial";
  fs::remove_all(partial);
  fs::create_directories(partial);
  checkpoint::RankWriter writer(partial, 0);
  for (const auto& p : llama3::parameter_shapes(model_args)) {
    at::Tensor t = weights.at(p.name);
    if (!dtype_name.empty()) t = t.to(checkpoint::parse_dtype(dtype_name, "--dtype"));
    writer.add("model." + p.name, t, std::vector<int64_t>(p.shape.size(), 0), p.shape);
  }
  nlohmann::json metadata = checkpoint::merge_rank_parts({writer.finish()});
  metadata.update(checkpoint::metadata_header(0, /*model_only=*/true, /*world_size=*/1, flavor_name));
  metadata["model"] = llama3::args_to_json(model_args);
  checkpoint::commit(partial, to, metadata);
  std::cerr << "wrote titan checkpoint " << to << " (" << flavor_name << ", model only) from " << from << "\n";
}

}  // namespace

int run_convert(const std::vector<std::string>& args) {
  std::string from, to, flavor_name, dtype_name;
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
    else if (a == "--flavor") flavor_name = v;
    else if (a == "--dtype") dtype_name = v;
    else if (a == "--max-shard-mb") max_shard_mb = std::stoll(v);
    else fail("unknown option ", quote(a), " for `titan convert`\n", kConvertUsage);
  }
  if (from.empty() || to.empty()) fail("`titan convert` needs --from and --to\n", kConvertUsage);
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(from) / "metadata.json")) {
    checkpoint::Reader reader(from);
    const auto& meta = reader.metadata();
    llama3::ModelArgs model_args;
    if (meta.contains("model")) {
      // The shape it was trained with; a --flavor must describe the same model.
      model_args = llama3::args_from_json(meta.at("model"), from + "/metadata.json: model");
      if (!flavor_name.empty()) {
        const auto differences = llama3::computation_differences(model_args, llama3::flavor(flavor_name));
        if (!differences.empty())
          fail("--flavor ", flavor_name, " is not the model ", from, " holds (checkpoint vs flavor):\n  ", join(differences, "\n  "),
               "\nleave --flavor out to convert the model as saved");
      }
      if (flavor_name.empty()) flavor_name = meta.value("flavor", "custom");
    } else {
      if (flavor_name.empty()) flavor_name = meta.value("flavor", "");
      if (flavor_name.empty()) fail(from, ": the checkpoint does not name its flavor; pass --flavor");
      model_args = llama3::flavor(flavor_name);
    }
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    at::ScalarType stored = at::kFloat;
    for (const auto& p : llama3::parameter_shapes(model_args)) {
      const std::string key = "model." + p.name;
      if (!reader.contains(key)) fail(from, ": no tensor ", quote(key), " (is it a ", flavor_name, " checkpoint?)");
      const auto& entry = reader.tensors().at(key);
      if (entry.shape != p.shape) fail(from, ": ", key, " has another shape than flavor ", flavor_name, " expects");
      at::Tensor full = at::empty(p.shape, at::TensorOptions().dtype(entry.dtype));
      reader.read_box(key, std::vector<int64_t>(p.shape.size(), 0), full);  // whatever layout saved it
      stored = entry.dtype;
      tensors.emplace_back(p.name, full);
    }
    const at::ScalarType dtype = dtype_name.empty() ? stored : checkpoint::parse_dtype(dtype_name, "--dtype");
    if (ends_with(to, ".pt") || ends_with(to, ".pth")) {
      if (fs::exists(to)) fail("--to ", quote(to), " exists; choose a new file name so nothing is overwritten");
      for (auto& [name, t] : tensors) t = t.to(dtype);
      checkpoint::save_torch(to, tensors);
      std::cerr << "wrote torch.save file " << to << " (" << tensors.size() << " tensors, "
                << checkpoint::dtype_string(dtype) << ") from " << from << "\n";
      return 0;
    }
    checkpoint::save_hf(to, model_args, tensors, dtype, max_shard_mb * 1000 * 1000);
    std::cerr << "wrote Hugging Face model " << to << " (" << flavor_name << ", " << checkpoint::dtype_string(dtype)
              << ") from " << from << "\n";
    return 0;
  }
  if (fs::exists(fs::path(from) / "config.json")) {
    // The shape is config.json's; a --flavor is checked against it field by field (load_hf).
    llama3::ModelArgs model_args = llama3::read_hf_config((fs::path(from) / "config.json").string());
    if (!flavor_name.empty()) {
      const int64_t max_seq_len = model_args.max_seq_len;
      model_args = llama3::flavor(flavor_name);
      model_args.max_seq_len = max_seq_len;
    }
    write_model_only(to, flavor_name.empty() ? "custom" : flavor_name, model_args, checkpoint::load_hf(from, model_args),
                     dtype_name, from);
    return 0;
  }
  // Meta's original checkpoints: consolidated.00.pth, or consolidated.00..NN.pth model-parallel shards (70B: 8).
  std::vector<std::string> parts;
  if (fs::is_directory(from)) {
    for (const auto& e : fs::directory_iterator(from))
      if (e.path().filename().string().starts_with("consolidated.") && e.path().extension() == ".pth") parts.push_back(e.path().string());
    std::sort(parts.begin(), parts.end());
  } else if (fs::is_regular_file(from) && (ends_with(from, ".pth") || ends_with(from, ".pt"))) {
    parts = {from};
  }
  if (!parts.empty()) {
    if (flavor_name.empty()) fail("converting .pth files needs --flavor (the titan model they hold)");
    auto model_args = llama3::flavor(flavor_name);
    std::vector<std::map<std::string, at::Tensor>> shards;
    for (const auto& part : parts) {
      shards.push_back(checkpoint::load_torch(part));
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
    write_model_only(to, flavor_name, model_args, weights, dtype_name, parts.size() == 1 ? parts[0] : from);
    return 0;
  }
  fail(quote(from), " is neither a titan checkpoint directory (metadata.json) nor a Hugging Face one (config.json)");
}

}  // namespace titan::cli
