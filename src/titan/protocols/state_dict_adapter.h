// A family's Hugging Face state-dict adapter (torchtitan's StateDictAdapter): parameter names and layouts both ways,
// and config.json. The model spec (model_spec.h) makes one for a model's arguments.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace titan::protocols {

class StateDictAdapter {
 public:
  virtual ~StateDictAdapter() = default;
  // HF name for a titan name, or nullopt for names HF does not store; and back.
  virtual std::optional<std::string> to_hf_name(const std::string& titan_name) const = 0;
  virtual std::optional<std::string> from_hf_name(const std::string& hf_name) const = 0;
  // A tensor stored under `titan_name` in HF's layout, and back.
  virtual at::Tensor to_hf_tensor(const std::string& titan_name, const at::Tensor& t) const = 0;
  virtual at::Tensor from_hf_tensor(const std::string& titan_name, const at::Tensor& t) const = 0;
  // Rows per head of a tensor whose rows the HF layout permutes within each head, or 0: a reader of part of such a
  // tensor must read whole heads, and converts a block of them with from_hf_head_rows.
  virtual int64_t permuted_rows_per_head(const std::string& titan_name) const = 0;
  virtual at::Tensor from_hf_head_rows(const at::Tensor& hf_rows, int64_t rows_per_head) const = 0;
  // A titan tensor that HF stores as one tensor per index of its first dimension (a Mixture-of-Experts layer's 3-D
  // expert weights, one HF tensor per expert, in the same [out, in] layout): how many, or 0 for any other tensor
  // (those go through to_hf_name). hf_slice_name names slice `index`; from_hf_slice_name maps an HF name that is
  // one slice back to (titan name, index).
  virtual int64_t hf_slices(const std::string& /*titan_name*/) const { return 0; }
  virtual std::string hf_slice_name(const std::string& titan_name, int64_t index) const {
    TORCH_CHECK(false, "internal: ", titan_name, " is not stored one slice per HF tensor (slice ", index, ")");
  }
  virtual std::optional<std::pair<std::string, int64_t>> from_hf_slice_name(const std::string& /*hf_name*/) const {
    return std::nullopt;
  }
  // Why an HF tensor this model has no place for is skipped rather than refused (a published DeepSeek-V3
  // checkpoint's multi-token-prediction layer), or nullopt: every other tensor must map to the model.
  virtual std::optional<std::string> skipped_hf_tensor(const std::string& /*hf_name*/) const { return std::nullopt; }
  // The config.json fields of the model; `torch_dtype` is "float32", "bfloat16" or "float16".
  virtual nlohmann::json hf_config(const std::string& torch_dtype) const = 0;
  // One line per field where the model a config.json describes computes differently from this one (UserError naming
  // the file when it cannot be read as this family's).
  virtual std::vector<std::string> hf_config_differences(const std::string& config_json_path) const = 0;
};

}  // namespace titan::protocols
