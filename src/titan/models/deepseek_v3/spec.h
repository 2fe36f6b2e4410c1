// DeepSeek-V3's registration (models/registry.cpp).
#pragma once
#include "titan/protocols/model_spec.h"

namespace titan::deepseek_v3 {

protocols::ModelSpec spec();

}  // namespace titan::deepseek_v3
