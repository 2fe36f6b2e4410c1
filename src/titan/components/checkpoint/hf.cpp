#include "titan/components/checkpoint/hf.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/logging.h"
#include "titan/common/progress.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/config/dtypes.h"

namespace titan::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

json hf_config(const protocols::StateDictAdapter& adapter, at::ScalarType dtype) {
  return adapter.hf_config(titan::config::dtype_name(dtype));
}

void check_hf_config(const std::string& directory, const protocols::StateDictAdapter& adapter) {
  const std::string path = directory + "/config.json";
  if (!fs::exists(path)) fail("no config.json in ", quote(directory), "; expected a Hugging Face model directory");
  const auto differences = adapter.hf_config_differences(path);
  if (differences.empty()) return;
  fail(path, " describes another model than this run's (config.json vs the configured model):\n  ",
       join(differences, "\n  "),
       "\nchoose the matching model.flavor or [model] shape keys, or model.flavor = \"hf\" to take the shape from "
       "config.json");
}

void save_hf(const std::string& directory, const protocols::ModelArgs& args, const protocols::StateDictAdapter& adapter,
             const std::vector<std::pair<std::string, at::Tensor>>& titan_tensors, at::ScalarType dtype,
             int64_t max_shard_bytes, const tokenizer::Tokenizer* tokenizer) {
  if (tokenizer && tokenizer->vocab_size() > args.vocabulary())  // before anything is written
    fail("the tokenizer ", tokenizer->source_path(), " has ", tokenizer->vocab_size(), " ids, more than the model's ",
         args.vocabulary(), "; it is not this model's tokenizer");
  fs::create_directories(directory);
  for (const auto& e : fs::directory_iterator(directory))
    if (e.path().extension() == ".safetensors")
      fail(quote(directory), " already holds weights (", e.path().filename().string(), "); choose an empty folder");
  std::vector<std::pair<std::string, at::Tensor>> hf;
  std::vector<std::string> dropped;  // non-zero tensors the format has no name for (Qwen3-MoE's routing biases)
  double dropped_max = 0;
  for (const auto& [name, t] : titan_tensors) {
    if (const int64_t slices = adapter.hf_slices(name)) {  // one HF tensor per expert
      const at::Tensor whole = t.detach().to(at::kCPU).to(dtype);
      for (int64_t j = 0; j < slices; ++j) hf.emplace_back(adapter.hf_slice_name(name, j), whole[j].contiguous());
      continue;
    }
    auto hf_name = adapter.to_hf_name(name);
    if (!hf_name) {
      if (const double largest = t.numel() ? t.detach().abs().max().item<double>() : 0.0; largest > 0) {
        dropped.push_back(name);
        dropped_max = std::max(dropped_max, largest);
      }
      continue;
    }
    hf.emplace_back(*hf_name, adapter.to_hf_tensor(name, t.detach().to(at::kCPU).to(dtype)).contiguous());
  }
  if (!dropped.empty())
    log::warn(quote(directory), ": the Hugging Face format of this model has no place for ", dropped.size(), " tensor(s), from ",
              quote(dropped.front()), " to ", quote(dropped.back()), " (largest magnitude ", dropped_max,
              "): left out, so the export differs from the checkpoint where they matter (Mixture-of-Experts routing biases "
              "decide near-tied expert choices; train with model.moe_load_balance_coeff = 0 for an exact export)");
  // config.json first: a model the Hugging Face class cannot express is refused before any file is written.
  json config = hf_config(adapter, dtype);
  // Shards in parameter order, each up to max_shard_bytes.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
  int64_t size = 0, total = 0;
  for (auto& item : hf) {
    const int64_t bytes = static_cast<int64_t>(item.second.nbytes());
    if (!shards.back().empty() && size + bytes > max_shard_bytes) {
      shards.emplace_back();
      size = 0;
    }
    shards.back().push_back(item);
    size += bytes;
    total += bytes;
  }
  json weight_map = json::object();
  Progress progress("writing " + directory, total, "bytes");
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shards.size() == 1 ? "model.safetensors"
                                                : strprintf("model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    safetensors::save(directory + "/" + file, shards[i], {{"format", "pt"}});
    for (const auto& [name, t] : shards[i]) {
      weight_map[name] = file;
      progress.advance(static_cast<int64_t>(t.nbytes()));
    }
  }
  if (shards.size() > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file(directory + "/model.safetensors.index.json", index.dump(2) + "\n");
  }
  if (tokenizer) {
    tokenizer->save_hf_files(directory);
    json generation = {{"_from_model_config", true}};
    for (const auto& [key, id] : {std::pair{"bos_token_id", tokenizer->bos_id()}, std::pair{"eos_token_id", tokenizer->eos_id()}}) {
      config[key] = id ? json(*id) : json(nullptr);
      generation[key] = config[key];
    }
    write_file(directory + "/generation_config.json", generation.dump(2) + "\n");
  }
  write_file(directory + "/config.json", config.dump(2) + "\n");
}

struct HfReader::Impl {
  std::string directory;
  const protocols::StateDictAdapter* adapter = nullptr;
  std::vector<std::unique_ptr<safetensors::File>> files;
  std::map<std::string, std::pair<const safetensors::File*, std::string>> where;  // titan name -> (file, HF name)
  // Titan tensors HF stores one slice (expert) per tensor: titan name -> (file, HF name) per index.
  std::map<std::string, std::vector<std::pair<const safetensors::File*, std::string>>> slices;
  // Float8 weights with block scales (DeepSeek-V3's published checkpoints): HF weight name -> (file, scale name).
  std::map<std::string, std::pair<const safetensors::File*, std::string>> scales;
  int64_t block = 128;  // quantization_config.weight_block_size

  // A tensor as float32 values: float8 weights multiplied, block by block, by their scale_inv (what PyTorch's
  // QuantizedHuggingFaceStorageReader computes); any other tensor as stored.
  at::Tensor load(const safetensors::File& file, const std::string& hf_name) const {
    auto it = scales.find(hf_name);
    if (it == scales.end()) return file.load(hf_name);
    const at::Tensor weight = file.load(hf_name).to(at::kFloat);
    const at::Tensor scale = it->second.first->load(it->second.second).to(at::kFloat);
    const int64_t rows = weight.size(0), cols = weight.size(1);
    return weight * scale.repeat_interleave(block, 0).repeat_interleave(block, 1).narrow(0, 0, rows).narrow(1, 0, cols);
  }
};

HfReader::HfReader(const std::string& directory, const protocols::ModelArgs& args, const protocols::StateDictAdapter& adapter)
    : impl_(std::make_unique<Impl>()) {
  impl_->directory = directory;
  impl_->adapter = &adapter;
  check_hf_config(directory, adapter);
  std::vector<std::string> files;
  std::map<std::string, std::string> indexed;  // the index's weight_map: tensor -> file
  const std::string index_path = directory + "/model.safetensors.index.json";
  if (fs::exists(index_path)) {
    json index;
    try {
      std::ifstream in(index_path);
      index = json::parse(in);
    } catch (const json::exception& e) {
      fail(index_path, ": not valid JSON: ", e.what());
    }
    const auto map = index.find("weight_map");
    if (map == index.end() || !map->is_object())
      fail(index_path, ": no \"weight_map\" object (tensor name -> safetensors file)");
    std::set<std::string> unique;
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string()) fail(index_path, ": weight_map[", quote(name), "] is ", file.dump(), ", expected a file name");
      unique.insert(file.get<std::string>());
      indexed[name] = file.get<std::string>();
    }
    files.assign(unique.begin(), unique.end());
  } else if (fs::exists(directory + "/model.safetensors")) {
    files = {"model.safetensors"};
  } else {
    fail("no model.safetensors or model.safetensors.index.json in ", quote(directory));
  }
  std::map<std::string, std::vector<std::string>> skipped;  // why -> the tensors skipped for it
  std::map<std::string, std::pair<const safetensors::File*, std::string>> scale_tensors;  // weight name -> its scale
  std::map<std::string, std::string> found;  // tensor -> the file holding it
  for (const auto& file : files) {
    impl_->files.push_back(std::make_unique<safetensors::File>(directory + "/" + file));
    const safetensors::File& f = *impl_->files.back();
    for (const auto& [hf_name, info] : f.tensors()) {
      // A tensor in two files, or not where the index says (files of two downloads mixed, or a shard replaced):
      // which copy is meant cannot be known.
      if (auto [it, fresh] = found.emplace(hf_name, file); !fresh)
        fail(quote(directory), ": tensor ", quote(hf_name), " is in both ", it->second, " and ", file,
             "; a checkpoint holds each tensor once (files of two checkpoints mixed?)");
      if (auto it = indexed.find(hf_name); it != indexed.end() && it->second != file)
        fail(index_path, " says ", quote(hf_name), " is in ", it->second, ", but ", file, " holds it (files of two checkpoints mixed?)");
      if (auto why = adapter.skipped_hf_tensor(hf_name)) {
        skipped[*why].push_back(hf_name);
        continue;
      }
      if (ends_with(hf_name, ".weight_scale_inv")) {
        scale_tensors[hf_name.substr(0, hf_name.size() - std::string("_scale_inv").size())] = {&f, hf_name};
        continue;
      }
      if (auto slice = adapter.from_hf_slice_name(hf_name)) {
        auto& list = impl_->slices[slice->first];
        if (slice->second >= static_cast<int64_t>(list.size())) list.resize(static_cast<size_t>(slice->second) + 1);
        list[static_cast<size_t>(slice->second)] = {&f, hf_name};
        continue;
      }
      auto name = adapter.from_hf_name(hf_name);
      if (!name) fail(directory, "/", file, ": unexpected tensor ", quote(hf_name), " for a ", args.family(), " model");
      impl_->where[*name] = {&f, hf_name};
    }
  }
  // The model's tensors, by titan name.
  std::set<std::string> known;
  for (const auto& p : args.parameter_shapes()) known.insert(p.name);
  for (const auto& b : args.buffer_shapes()) known.insert(b.name);
  // Index entries their file does not hold: an error where the model needs the tensor, else (a tensor the adapter
  // skips or the model does not have) a warning.
  {
    std::vector<std::string> absent;
    for (const auto& [name, file] : indexed) {
      if (found.count(name)) continue;
      std::optional<std::string> ours;
      if (!adapter.skipped_hf_tensor(name)) {
        if (auto slice = adapter.from_hf_slice_name(name)) ours = slice->first;
        else ours = adapter.from_hf_name(name);
      }
      if (ours && known.count(*ours))
        fail(index_path, " says ", quote(name), " is in ", file, ", which does not hold it (an incomplete or replaced file?)");
      absent.push_back(name);
    }
    if (!absent.empty())
      log::warn(index_path, " lists ", absent.size(), " tensor(s) its files do not hold, from ", quote(absent.front()), " to ",
                quote(absent.back()), "; the model needs none of them");
  }
  for (const auto& [why, names] : skipped)
    log::warn(quote(directory), ": skipped ", names.size(), " tensor(s) of ", why, ", from ", quote(names.front()), " to ",
              quote(names.back()));
  read_quantization(directory, scale_tensors);
  // Tensors the adapter can name but this model does not have (a layer past num_hidden_layers, say) are not read:
  // said once, as transformers says of unused weights.
  {
    std::vector<std::string> unused;
    for (const auto& [name, where] : impl_->where) {
      if (known.count(name)) continue;
      if (name == "output.weight") {  // the model has no output matrix of its own: it reads the embedding's
        log::warn(quote(directory), ": ", quote(where.second), " is not read: the model's output uses the embedding's table "
                  "(tie_word_embeddings), as transformers does with such a file");
        continue;
      }
      unused.push_back(where.second);
    }
    for (const auto& [name, list] : impl_->slices)
      if (!known.count(name) && !list.empty()) unused.push_back(list.front().second);
    if (!unused.empty())
      log::warn(quote(directory), ": ", unused.size(), " tensor(s) this model does not have are not read, from ",
                quote(unused.front()), " to ", quote(unused.back()), " (a layer past num_hidden_layers?)");
  }
  for (const auto& p : args.parameter_shapes()) {
    if (const int64_t count = adapter.hf_slices(p.name)) {
      auto it = impl_->slices.find(p.name);
      const std::vector<int64_t> slice_shape(p.shape.begin() + 1, p.shape.end());
      for (int64_t j = 0; j < count; ++j) {
        const std::string hf_name = adapter.hf_slice_name(p.name, j);
        if (it == impl_->slices.end() || j >= static_cast<int64_t>(it->second.size()) || !it->second[static_cast<size_t>(j)].first)
          fail(quote(directory), ": no weight for ", quote(hf_name), " (expert ", j, " of ", count, ")");
        const auto& [file, name] = it->second[static_cast<size_t>(j)];
        const auto& shape = file->tensors().at(name).shape;
        if (shape != slice_shape)
          fail(quote(directory), ": ", quote(hf_name), " has shape ", at::IntArrayRef(shape), ", expected ", at::IntArrayRef(slice_shape));
      }
      if (it->second.size() > static_cast<size_t>(count))
        fail(quote(directory), ": ", quote(it->second.back().second), " is an expert beyond the model's ", count, " experts");
      continue;
    }
    auto it = impl_->where.find(p.name);
    if (it == impl_->where.end()) fail(quote(directory), ": no weight for ", quote(adapter.to_hf_name(p.name).value_or(p.name)));
    const auto& shape = it->second.first->tensors().at(it->second.second).shape;
    if (shape != p.shape)
      fail(quote(directory), ": ", quote(adapter.to_hf_name(p.name).value_or(p.name)), " has shape ", at::IntArrayRef(shape), ", expected ",
           at::IntArrayRef(p.shape));
  }
}

void HfReader::read_quantization(const std::string& directory,
                                 const std::map<std::string, std::pair<const safetensors::File*, std::string>>& scale_tensors) {
  if (scale_tensors.empty()) return;
  json config;
  try {
    std::ifstream in(directory + "/config.json");
    config = json::parse(in);
  } catch (const json::exception&) {
  }
  if (const auto q = config.find("quantization_config"); q != config.end() && q->is_object()) {
    if (q->contains("quant_method") && (*q)["quant_method"] != "fp8")
      fail(quote(directory), ": quantization_config.quant_method is ", (*q)["quant_method"].dump(),
           "; titan reads float8 weights with block scales (\"fp8\", DeepSeek-V3's) only");
    if (const auto b = q->find("weight_block_size"); b != q->end()) {
      if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || (*b)[0] != (*b)[1] || (*b)[0].get<int64_t>() < 1)
        fail(quote(directory), ": quantization_config.weight_block_size is ", b->dump(), "; expected two equal positive integers");
      impl_->block = (*b)[0].get<int64_t>();
    }
  }
  for (const auto& [weight, scale] : scale_tensors) {
    const safetensors::File* file = nullptr;
    for (const auto& f : impl_->files)
      if (f->tensors().count(weight)) file = f.get();
    if (!file) fail(quote(directory), ": ", quote(scale.second), " scales a weight the files do not hold (", quote(weight), ")");
    const auto& shape = file->tensors().at(weight).shape;
    const auto& scale_shape = scale.first->tensors().at(scale.second).shape;
    const int64_t b = impl_->block;
    if (shape.size() != 2 || scale_shape != std::vector<int64_t>{(shape[0] + b - 1) / b, (shape[1] + b - 1) / b})
      fail(quote(directory), ": ", quote(scale.second), " has shape ", at::IntArrayRef(scale_shape), "; a ", at::IntArrayRef(shape),
           " weight in ", b, " x ", b, " blocks needs [", (shape.size() == 2 ? (shape[0] + b - 1) / b : 0), ", ",
           (shape.size() == 2 ? (shape[1] + b - 1) / b : 0), "]");
    impl_->scales[weight] = scale;
  }
  log::info(quote(directory), ": ", impl_->scales.size(), " float8 weights dequantized to float32 with their ", impl_->block, " x ",
            impl_->block, " block scales (weight_scale_inv)");
}

HfReader::~HfReader() = default;

void HfReader::read_box(const std::string& titan_name, const std::vector<int64_t>& offsets, at::Tensor out) const {
  if (auto sliced = impl_->slices.find(titan_name); sliced != impl_->slices.end()) {
    // Rows of the first dimension are whole HF tensors (experts): read each one the box covers.
    for (int64_t row = 0; row < out.size(0); ++row) {
      const auto& [file, hf_name] = sliced->second.at(static_cast<size_t>(offsets[0] + row));
      at::Tensor source = impl_->load(*file, hf_name);
      for (int64_t d = 1; d < out.dim(); ++d) source = source.narrow(d - 1, offsets[static_cast<size_t>(d)], out.size(d));
      out[row].copy_(source);
    }
    return;
  }
  auto it = impl_->where.find(titan_name);
  if (it == impl_->where.end()) fail(quote(impl_->directory), ": no weight for ", quote(titan_name));
  const auto& [file, hf_name] = it->second;
  if (out.dim() == 0 || out.numel() == 0) {
    if (out.numel()) out.copy_(impl_->load(*file, hf_name));
    return;
  }
  int64_t begin = offsets[0], end = offsets[0] + out.size(0);
  const int64_t per_head = impl_->adapter->permuted_rows_per_head(titan_name);
  if (per_head) begin = begin / per_head * per_head, end = (end + per_head - 1) / per_head * per_head;
  at::Tensor rows = impl_->scales.count(hf_name) ? impl_->load(*file, hf_name).narrow(0, begin, end - begin)
                                                 : file->load_rows(hf_name, begin, end - begin);
  if (per_head) rows = impl_->adapter->from_hf_head_rows(rows, per_head);
  at::Tensor source = rows.narrow(0, offsets[0] - begin, out.size(0));
  for (int64_t d = 1; d < out.dim(); ++d) source = source.narrow(d, offsets[static_cast<size_t>(d)], out.size(d));
  out.copy_(source);
}

bool HfReader::contains(const std::string& titan_name) const {
  return impl_->where.count(titan_name) > 0 || impl_->slices.count(titan_name) > 0;
}

at::ScalarType HfReader::dtype(const std::string& titan_name) const {
  if (auto sliced = impl_->slices.find(titan_name); sliced != impl_->slices.end() && !sliced->second.empty()) {
    if (impl_->scales.count(sliced->second.front().second)) return at::kFloat;  // dequantized
    return sliced->second.front().first->tensors().at(sliced->second.front().second).dtype;
  }
  auto it = impl_->where.find(titan_name);
  if (it == impl_->where.end()) fail(quote(impl_->directory), ": no weight for ", quote(titan_name));
  if (impl_->scales.count(it->second.second)) return at::kFloat;
  return it->second.first->tensors().at(it->second.second).dtype;
}

}  // namespace titan::checkpoint
