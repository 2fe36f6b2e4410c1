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

}  // namespace titan::llama3
