// Qwen3's registration (models/registry.cpp).
#pragma once
#include "titan/protocols/model_spec.h"

namespace titan::qwen3 {

protocols::ModelSpec spec();

}  // namespace titan::qwen3
