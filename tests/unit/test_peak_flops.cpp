// The CPU peak used for MFU: a measured matmul rate, cached per machine, and the override.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "titan/components/metrics/peak_flops.h"

namespace {

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(PeakFlops, CpuPeakIsAMeasuredMatmulRateCachedPerMachine) {
  titan_test::TempDir dir;
  ScopedEnv cache("XDG_CACHE_HOME", dir.path());
  unsetenv("TITAN_PEAK_FLOPS");
  const auto first = titan::metrics::peak_flops(at::Device(at::kCPU), at::kFloat);
  EXPECT_GT(first.flops, 1e8);  // any CPU of this century multiplies 1024^3 faster than 0.1 GFLOP/s
  EXPECT_NE(first.derivation.find("measured now"), std::string::npos) << first.derivation;
  EXPECT_NE(first.derivation.find("instruction-rate bound"), std::string::npos) << first.derivation;
  const std::string file = dir.path() + "/titan/peak_flops.json";
  ASSERT_TRUE(std::ifstream(file).good());
  // The second run reads the cache: the same figure, said to be cached.
  const auto second = titan::metrics::peak_flops(at::Device(at::kCPU), at::kFloat);
  EXPECT_DOUBLE_EQ(second.flops, first.flops);
  EXPECT_NE(second.derivation.find("cached in " + file), std::string::npos) << second.derivation;
  // bf16 is a different entry, measured on its own.
  const auto bf16 = titan::metrics::peak_flops(at::Device(at::kCPU), at::kBFloat16);
  EXPECT_NE(bf16.derivation.find("measured now: bf16"), std::string::npos) << bf16.derivation;
  // A damaged cache is measured again and rewritten, not an error.
  std::ofstream(file) << "{ not json";
  const auto again = titan::metrics::peak_flops(at::Device(at::kCPU), at::kFloat);
  EXPECT_NE(again.derivation.find("measured now"), std::string::npos) << again.derivation;
  EXPECT_NE(titan::metrics::peak_flops(at::Device(at::kCPU), at::kFloat).derivation.find("cached in"), std::string::npos);
  // So is valid JSON with fields of the wrong type.
  nlohmann::json edited;
  std::ifstream(file) >> edited;
  for (auto& [key, entry] : edited.items()) entry["flops"] = "fast", entry["measured"] = 7;
  std::ofstream(file) << edited.dump();
  const auto retyped = titan::metrics::peak_flops(at::Device(at::kCPU), at::kFloat);
  EXPECT_GT(retyped.flops, 1e8);
  EXPECT_NE(retyped.derivation.find("measured now"), std::string::npos) << retyped.derivation;
  // Caching can be turned off (several ranks on one machine): measured, and said not to be cached.
  const auto uncached = titan::metrics::peak_flops(at::Device(at::kCPU), at::kFloat, /*may_cache=*/false);
  EXPECT_NE(uncached.derivation.find("not cached"), std::string::npos) << uncached.derivation;
}

TEST(PeakFlops, EnvironmentOverrides) {
  ScopedEnv peak("TITAN_PEAK_FLOPS", "1.5e12");
  const auto p = titan::metrics::peak_flops(at::Device(at::kCPU), at::kBFloat16);
  EXPECT_DOUBLE_EQ(p.flops, 1.5e12);
  EXPECT_NE(p.derivation.find("TITAN_PEAK_FLOPS"), std::string::npos);
}

}  // namespace
