// Llama 3's registration (models/registry.cpp).
#pragma once
#include "titan/protocols/model_spec.h"

namespace titan::llama3 {

protocols::ModelSpec spec();

}  // namespace titan::llama3
