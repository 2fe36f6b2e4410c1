#include "titan/protocols/memory_estimate.h"

#include <algorithm>

#include "titan/common/error.h"
#include "titan/config/dtypes.h"
#include "titan/common/strings.h"

namespace titan::protocols {

namespace {


std::string human(double bytes) {
  if (bytes >= 1024.0 * 1024.0 * 1024.0) return strprintf("%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return strprintf("%.1f MiB", bytes / (1024.0 * 1024.0));
}

}  // namespace

bool computes_under_autocast(const config::JobConfig& config, const distributed::ParallelDims& dims) {
  return !dims.fsdp_enabled() && config.training.dtype == "float32" && config.training.mixed_precision_param == "bfloat16";
}

double compute_dtype_bytes(const config::JobConfig& config, const distributed::ParallelDims& dims) {
  const auto& training = config.training;
  if (dims.fsdp_enabled()) return titan::config::dtype_bytes(training.dtype == "float32" ? training.mixed_precision_param : training.dtype);
  return computes_under_autocast(config, dims) ? 2.0 : titan::config::dtype_bytes(training.dtype);
}

double MemoryEstimate::total() const {
  double step = 0, loss = 0, backward = 0;
  for (const auto& term : terms)
    (term.phase == Phase::loss ? loss : term.phase == Phase::blocks_backward ? backward : step) += term.bytes;
  return step + std::max(loss, backward);
}

std::string MemoryEstimate::describe() const {
  std::string out, loss, backward;
  for (const auto& term : terms) {
    if (term.bytes <= 0) continue;
    std::string& list = term.phase == Phase::loss ? loss : term.phase == Phase::blocks_backward ? backward : out;
    list += cat(list.empty() ? "" : ", ", term.name, " ", human(term.bytes));
  }
  if (!loss.empty() && !backward.empty()) out += cat(", and the larger of the loss's (", loss, ") and the backward's (", backward, ")");
  else if (!loss.empty() || !backward.empty()) out += cat(", ", loss, backward);
  return out + cat(": ", human(total()));
}

}  // namespace titan::protocols
