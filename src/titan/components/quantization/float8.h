// torchtitan's float8 converter (model.converters = ["quantize.linear.float8"], or "float8"): between building a
// model and parallelizing it, the selected linear units get an innermost wrapper that computes them as float8
// linears (nn/float8.h) with the [quantize.linear.float8] recipe. The model code, its parameters and checkpoints
// stay as they are: a checkpoint saved with float8 loads without it and the other way round.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "titan/config/loader.h"
#include "titan/distributed/data_parallel.h"
#include "titan/nn/model.h"

namespace titan::quantization {

// Whether model.converters asks for float8 linears.
bool float8_enabled(const config::JobConfig& config);
// The float8 recipe's name ([quantize.linear.float8] recipe_name; unset is tensorwise).
std::string float8_recipe_name(const config::JobConfig& config);
// Errors for what model.converters and the [quantize.linear.float8] / [quantize.linear.mx] keys ask that titan cannot
// run, each naming the key (empty: runnable). `device` is where training runs (a device without a float8 matmul needs emulate = true).
std::vector<std::string> float8_config_errors(const config::LoadedConfig& loaded, const at::Device& device);

// Whether a linear layer of weight shape [out_features, in_features] named `fqn` is converted: both dimensions
// divide by 16, no entry of filter_fqns is a substring of the name, and with "auto_filter_small_kn" among them the
// shape is above torchao's thresholds for the recipe.
bool float8_converts(const std::string& fqn, int64_t out_features, int64_t in_features, const config::Float8Linear& settings);

struct Float8Conversion {
  std::vector<std::string> converted, kept;  // the linear units' names
  // With enable_fsdp_float8_all_gather: the converted weights, by parameter, with the slots FSDP fills.
  std::shared_ptr<distributed::FsdpOptions::Float8AllGather> fsdp_float8;
};
// Wraps the selected linear units of `model` (before any parallelism) and logs which were converted.
Float8Conversion convert_to_float8(nn::Model& model, const config::JobConfig& config);

// Whether model.converters asks for MXFP8 linears ("quantize.linear.mx", or "mx").
bool mx_enabled(const config::JobConfig& config);
// Whether a linear layer is converted to MXFP8: both dimensions divide by 32 (the block size) and no entry of
// quantize.linear.mx.filter_fqns is a substring of its name.
bool mx_converts(const std::string& fqn, int64_t out_features, int64_t in_features, const config::MXLinear& settings);
// Wraps the selected linear units of `model` as MXFP8 linears (emulated) and logs which were converted.
Float8Conversion convert_to_mx(nn::Model& model, const config::JobConfig& config);

// Whether model.converters asks for MXFP8 grouped matmuls ("quantize.grouped_mm.mx"), or float8 ones
// ("quantize.grouped_mm.float8").
bool grouped_mx_enabled(const config::JobConfig& config);
bool grouped_float8_enabled(const config::JobConfig& config);
// Switches the experts of every MoE layer whose name contains an entry of quantize.grouped_mm.mx.fqns (or .float8's) to
// MXFP8 (float8 rowwise) grouped matmuls, emulated, and linear units under those names to MXFP8 (float8 rowwise)
// linears, as torchao converts what torchtitan names; logs and returns the expert units' names. A UserError when the
// entries name no experts, or one MoE layer under both converters.
std::vector<std::string> convert_grouped(torch::nn::Module& model, const config::JobConfig& config);

}  // namespace titan::quantization
