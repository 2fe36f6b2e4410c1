// Precompiled header for titan_core and its executables: the heavy, stable third-party headers only.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <nlohmann/json.hpp>
