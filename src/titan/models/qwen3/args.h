// Qwen3's named flavors, with torchtitan v0.2.2's arguments: explicit head_dim 128, q/k norms, RoPE theta 1e6 in the
// half-split layout, norm eps 1e-6, tied embeddings up to 4B; the Mixture-of-Experts flavors debugmodel_moe, 30B-A3B
// and 235B-A22B.
#pragma once
#include <string>
#include <vector>

#include "titan/models/common/decoder_args.h"

namespace titan::qwen3 {

using models::DecoderArgs;

std::vector<std::string> flavor_names();
// Throws UserError naming the known flavors when `name` is not one of them.
DecoderArgs flavor(const std::string& name);
// The fields every Qwen3 model shares (what config.json does not say): q/k norms, the half-split rotary layout, no
// RoPE scaling, torchtitan's FLOPs counting.
DecoderArgs base_args();

}  // namespace titan::qwen3
