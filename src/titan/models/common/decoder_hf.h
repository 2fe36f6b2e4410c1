// Mapping between the decoders' (torchtitan) parameter names and layout and Hugging Face's LlamaForCausalLM,
// Qwen3ForCausalLM, Qwen3MoeForCausalLM and DeepseekV3ForCausalLM: names (model.layers.N.self_attn.q_proj.weight, ...) and, for Llama's interleaved rotary layout,
// the q/k row permutation to HF's half-split one (Qwen3 is half-split in both).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "titan/models/common/decoder_args.h"

namespace titan::models {

// HF name for a titan name, or nullopt for names HF does not store. Latent-attention models (DeepSeek-V3) take
// DeepseekV3ForCausalLM's attention names, and their routers' balancing biases are e_score_correction_bias.
std::optional<std::string> to_hf_name(const std::string& titan_name, const DecoderArgs& args);
std::optional<std::string> from_hf_name(const std::string& hf_name, const DecoderArgs& args);
// Why an HF tensor is skipped rather than mapped, or nullopt: with latent attention (DeepSeek-V3) the blocks past
// the model's last (model.layers.N for N >= n_layers: the published checkpoints' multi-token-prediction layer, whose
// count config.json's num_nextn_predict_layers gives), which neither titan's model nor torchtitan's has.
std::optional<std::string> skipped_hf_tensor(const std::string& hf_name, const DecoderArgs& args);

// Mixture-of-Experts expert weights (layers.N.moe.experts.w1/w2/w3, [experts, out, in]): HF stores one [out, in]
// tensor per expert (model.layers.N.mlp.experts.J.gate_proj/down_proj/up_proj.weight). The number of experts for
// such a name (0 for others), the HF name of expert `index`, and back.
int64_t hf_slices(const std::string& titan_name, const DecoderArgs& args);
std::string hf_slice_name(const std::string& titan_name, int64_t index);
std::optional<std::pair<std::string, int64_t>> from_hf_slice_name(const std::string& hf_name);

// Converts a tensor stored under `titan_name` to HF layout (permutes wq/wk rows), and back.
at::Tensor to_hf_tensor(const std::string& titan_name, const at::Tensor& t, const DecoderArgs& args);
at::Tensor from_hf_tensor(const std::string& titan_name, const at::Tensor& t, const DecoderArgs& args);

// Rows per head of a tensor whose rows the HF layout permutes within each head (wq, wk of an interleaved-layout
// model), or 0 for any other:
// a reader of part of such a tensor must read whole heads.
int64_t permuted_rows_per_head(const std::string& titan_name, const DecoderArgs& args);
// from_hf_tensor for a block of whole heads of such a tensor.
at::Tensor from_hf_head_rows(const at::Tensor& hf_rows, int64_t rows_per_head);

}  // namespace titan::models
