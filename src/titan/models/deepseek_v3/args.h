// DeepSeek-V3's named flavors, with torchtitan v0.2.2's arguments (models/deepseek_v3): multi-head latent
// attention with YaRN RoPE in the interleaved layout, n_dense_layers dense SwiGLU blocks and then Mixture-of-Experts
// blocks with shared experts, the final norm at the dtype's machine epsilon.
#pragma once
#include <string>
#include <vector>

#include "titan/models/common/decoder_args.h"

namespace titan::deepseek_v3 {

using models::DecoderArgs;

std::vector<std::string> flavor_names();
// Throws UserError naming the known flavors when `name` is not one of them.
DecoderArgs flavor(const std::string& name);
// What every DeepSeek-V3 model shares with torchtitan's DeepSeekV3ModelArgs defaults (RoPE theta 1e4, YaRN factor
// 40 over 4,096 positions with beta_fast 32 and beta_slow 1, norm eps 1e-5, MoE FLOPs counting).
DecoderArgs base_args();

}  // namespace titan::deepseek_v3
