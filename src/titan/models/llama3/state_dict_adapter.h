// Mapping between titan's (Meta/torchtitan) parameter names and layout and Hugging Face's LlamaForCausalLM:
// names (model.layers.N.self_attn.q_proj.weight, ...) and the q/k row permutation between interleaved (Meta) and
// half-split (HF) rotary layouts.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "titan/models/llama3/args.h"

namespace titan::llama3 {

// HF name for a titan name, or nullopt for names HF does not store.
std::optional<std::string> to_hf_name(const std::string& titan_name);
std::optional<std::string> from_hf_name(const std::string& hf_name);

// Converts a tensor stored under `titan_name` to HF layout (permutes wq/wk rows), and back.
at::Tensor to_hf_tensor(const std::string& titan_name, const at::Tensor& t, const ModelArgs& args);
at::Tensor from_hf_tensor(const std::string& titan_name, const at::Tensor& t, const ModelArgs& args);

// Rows per head of a tensor whose rows the HF layout permutes within each head (wq, wk), or 0 for any other:
// a reader of part of such a tensor must read whole heads.
int64_t permuted_rows_per_head(const std::string& titan_name, const ModelArgs& args);
// from_hf_tensor for a block of whole heads of such a tensor.
at::Tensor from_hf_head_rows(const at::Tensor& hf_rows, int64_t rows_per_head);

}  // namespace titan::llama3
