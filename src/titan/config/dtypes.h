// Dtype names as configs and checkpoint files spell them ("float32", "bfloat16", "int64", ...), both ways, parsed
// here once for the whole project.
#pragma once
#include <c10/core/ScalarType.h>

#include <string>

namespace titan::config {

// Throws UserError naming `where` and the known names for an unknown one.
at::ScalarType dtype_from_name(const std::string& name, const std::string& where);
// Throws UserError for a dtype without a name here.
std::string dtype_name(at::ScalarType dtype);
// Bytes per element of a floating-point dtype named in a config (training.dtype, mixed_precision_*).
double dtype_bytes(const std::string& name);

}  // namespace titan::config
