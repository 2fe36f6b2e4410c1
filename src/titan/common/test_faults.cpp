#include "titan/common/test_faults.h"

#include <cstdlib>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::test_faults {
namespace {

const char* variable(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

}  // namespace

const CheckpointCrash& checkpoint_crash() {
  static const CheckpointCrash plan = [] {
    CheckpointCrash p;
    if (const char* v = variable("TITAN_TEST_CHECKPOINT_CRASH")) {
      const std::string s = v;
      if (starts_with(s, "bytes:")) p.after_bytes = std::stoll(s.substr(6));
      else p.at = s;
    }
    if (const char* r = variable("TITAN_TEST_CHECKPOINT_CRASH_RANK")) p.rank = std::atoi(r);
    return p;
  }();
  return plan;
}

StopBefore stop_before() {
  const char* v = variable("TITAN_TEST_STOP_BEFORE");
  if (!v) return {};
  const std::string text = v;
  const auto colon = text.find(':');
  char* end = nullptr;
  const long long step = colon == std::string::npos ? -1 : std::strtoll(text.c_str(), &end, 10);
  if (colon == std::string::npos || end != text.c_str() + colon || step < 1)
    fail("TITAN_TEST_STOP_BEFORE=", text, ": expected <step>:<action>, e.g. 4:1B0");
  return {step, text.substr(colon + 1)};
}

std::optional<double> available_memory_bytes() {
  if (const char* v = variable("TITAN_TEST_AVAILABLE_MEMORY_BYTES")) return std::atof(v);
  return std::nullopt;
}

std::optional<bool> bf16_products_in_float() {
  const char* v = variable("TITAN_TEST_BF16_PRODUCTS_IN_FLOAT");
  if (!v) return std::nullopt;
  if (std::string(v) == "1") return true;
  if (std::string(v) == "0") return false;
  fail("TITAN_TEST_BF16_PRODUCTS_IN_FLOAT=", v, ": expected 1 or 0");
}

bool moe_collapse() {
  const char* v = variable("TITAN_TEST_MOE_COLLAPSE");
  return v && std::string(v) == "1";
}

std::optional<double> expert_receive_limit_bytes() {
  if (const char* v = variable("TITAN_TEST_EXPERT_RECEIVE_LIMIT_BYTES")) return std::atof(v);
  return std::nullopt;
}

bool torch_save_force_zip64() { return variable("TITAN_TEST_TORCH_SAVE_FORCE_ZIP64") != nullptr; }

}  // namespace titan::test_faults
