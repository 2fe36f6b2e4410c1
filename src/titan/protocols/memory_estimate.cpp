#include "titan/protocols/memory_estimate.h"

#include <algorithm>
#include <map>
#include <vector>

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

double MemoryEstimate::bytes(Phase phase) const {
  double sum = 0;
  for (const auto& term : terms)
    if (term.phase == phase) sum += term.bytes;
  return sum;
}

double MemoryEstimate::total() const {
  const double activations = bytes(Phase::activations), gradients = bytes(Phase::gradients);
  const double made = gradients + bytes(Phase::head_gradients) + bytes(Phase::last_gradients);
  return bytes(Phase::step) + std::max({activations + bytes(Phase::loss),
                                        std::max(activations, gradients) + bytes(Phase::blocks_backward) + bytes(Phase::head_gradients),
                                        made + bytes(Phase::embedding_backward), made + bytes(Phase::optimizer_step)});
}

std::string MemoryEstimate::describe() const {
  std::map<Phase, std::string> lists;
  for (const auto& term : terms) {
    if (term.bytes <= 0) continue;
    std::string& list = lists[term.phase];
    list += cat(list.empty() ? "" : ", ", term.name, " ", human(term.bytes));
  }
  const auto joined = [](std::initializer_list<std::string> parts) {
    std::string out;
    for (const auto& part : parts)
      if (!part.empty()) out += cat(out.empty() ? "" : ", ", part);
    return out;
  };
  const std::string &activations = lists[Phase::activations], &loss = lists[Phase::loss], &backward = lists[Phase::blocks_backward],
                    &optimizer = lists[Phase::optimizer_step], &gradients = lists[Phase::gradients],
                    &head = lists[Phase::head_gradients], &last = lists[Phase::last_gradients],
                    &embedding = lists[Phase::embedding_backward];
  std::string held;
  if (activations.empty() && gradients.empty() && head.empty() && last.empty() && embedding.empty()) {
    // The moments that hold something: the larger (or largest) counts.
    std::vector<std::string> moments;
    if (!loss.empty()) moments.push_back(cat("the loss's (", loss, ")"));
    if (!backward.empty()) moments.push_back(cat("the backward's (", backward, ")"));
    if (!optimizer.empty()) moments.push_back(cat("the optimizer step's (", optimizer, ")"));
    if (moments.size() == 1) {
      held = joined({loss, backward, optimizer});
    } else if (moments.size() > 1) {
      held = cat(moments.size() == 2 ? "and the larger of " : "and the largest of ", moments[0]);
      for (size_t i = 1; i < moments.size(); ++i) held += cat(i + 1 == moments.size() ? " and " : ", ", moments[i]);
    }
  } else {
    // Gradients are made as the activations are freed: three moments (four with the optimizer's temporaries), the
    // largest counts.
    const std::string larger = activations.empty() || gradients.empty() ? joined({activations, gradients})
                                                                        : cat("the larger of ", activations, " and ", gradients);
    held = cat("and the largest of the forward's end (", joined({activations, loss}), "), the blocks' backward (",
               joined({larger, backward, head}), ")", optimizer.empty() ? " and" : ",", " the embedding's (",
               joined({gradients, head, last, embedding}), ")",
               optimizer.empty() ? std::string() : cat(" and the optimizer step's (", joined({gradients, head, last, optimizer}), ")"));
  }
  return joined({lists[Phase::step], held}) + cat(": ", human(total()));
}

}  // namespace titan::protocols
