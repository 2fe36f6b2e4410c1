// Hugging Face checkpoints: a directory with config.json (the family's, e.g. LlamaConfig or Qwen3Config) and
// model.safetensors, or shards listed in model.safetensors.index.json. Tensors are exchanged in titan's names and
// layout; the family's state-dict adapter gives the renaming and any layout change (Llama's q/k RoPE permutation).
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "titan/components/tokenizer/tokenizer.h"
#include "titan/protocols/model_args.h"
#include "titan/protocols/state_dict_adapter.h"

namespace titan::safetensors {
class File;
}

namespace titan::checkpoint {

// config.json fields of the adapter's model.
nlohmann::json hf_config(const protocols::StateDictAdapter& adapter, at::ScalarType dtype);

// Checks that `directory`'s config.json describes the adapter's model (sizes, heads, vocabulary, RoPE); throws
// UserError naming the fields that differ.
void check_hf_config(const std::string& directory, const protocols::StateDictAdapter& adapter);

// Writes config.json and the weights (titan names -> HF names and layout) in `dtype`, in shards of at most
// `max_shard_bytes` (one model.safetensors when everything fits), into `directory` (created; existing weight files
// there are refused). With the run's tokenizer also its files, tokenizer_config.json, BOS/EOS ids in config.json
// and generation_config.json, so that AutoTokenizer, pipeline("text-generation") and generate() work as is.
void save_hf(const std::string& directory, const protocols::ModelArgs& args, const protocols::StateDictAdapter& adapter,
             const std::vector<std::pair<std::string, at::Tensor>>& titan_tensors, at::ScalarType dtype,
             int64_t max_shard_bytes, const tokenizer::Tokenizer* tokenizer = nullptr);

// Reads parts of the weights of an HF directory under titan names and layout, touching only the rows a box needs
// (whole heads of wq/wk, whose rows HF permutes within each head): each rank of a sharded job reads its pieces.
class HfReader {
 public:
  // Checks config.json against `args` and that every weight is present with its shape.
  HfReader(const std::string& directory, const protocols::ModelArgs& args, const protocols::StateDictAdapter& adapter);
  ~HfReader();
  // Fills `out` (any device and dtype) with the box of `titan_name` that starts at `offsets`.
  void read_box(const std::string& titan_name, const std::vector<int64_t>& offsets, at::Tensor out) const;
  at::ScalarType dtype(const std::string& titan_name) const;  // as stored
  // Whether the files hold `titan_name` (state beside the parameters: DeepSeek-V3's e_score_correction_bias).
  bool contains(const std::string& titan_name) const;

 private:
  // Float8 weights beside `*.weight_scale_inv` block scales (config.json's quantization_config, DeepSeek-V3's
  // published checkpoints): read as float32, each block times its scale.
  void read_quantization(const std::string& directory,
                         const std::map<std::string, std::pair<const safetensors::File*, std::string>>& scale_tensors);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace titan::checkpoint
