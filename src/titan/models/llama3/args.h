// Llama 3's named flavors: torchtitan's dimensions, Llama 3.2 1B/3B, and titan's test and benchmark shapes.
#pragma once
#include <string>
#include <vector>

#include "titan/models/common/decoder_args.h"

namespace titan::llama3 {

using models::DecoderArgs;

std::vector<std::string> flavor_names();
// Throws UserError naming the known flavors when `name` is not one of them.
DecoderArgs flavor(const std::string& name);

}  // namespace titan::llama3
