// The CPU peak used for MFU: a measured matmul rate, cached per machine, and the override.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <ATen/Parallel.h>
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
  ScopedEnv quiet("TITAN_TEST_CPU_SHARE", "1");  // the suite's other tests may be busy beside this one
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
  EXPECT_NE(bf16.derivation.find("measured now: best of bf16"), std::string::npos) << bf16.derivation;
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

TEST(PeakFlops, APoisonedCacheIsMeasuredAgainWhenAStepBeatsIt) {
  titan_test::TempDir dir;
  ScopedEnv cache("XDG_CACHE_HOME", dir.path());
  ScopedEnv quiet("TITAN_TEST_CPU_SHARE", "1");  // the suite's other tests may be busy beside this one
  unsetenv("TITAN_PEAK_FLOPS");
  const auto cpu = at::Device(at::kCPU);
  const auto first = titan::metrics::peak_flops(cpu, at::kFloat);
  EXPECT_NE(first.derivation.find("1024x1024x1024, 2048x2048x2048, 4096x1024x2048"), std::string::npos) << first.derivation;
  // The key names what changes the answer: the threads, LibTorch and this very binary.
  const std::string file = dir.path() + "/titan/peak_flops.json";
  nlohmann::json entries;
  std::ifstream(file) >> entries;
  ASSERT_EQ(entries.size(), 1u);
  const std::string key = entries.begin().key();
  EXPECT_NE(key.find(std::to_string(at::get_num_threads()) + " threads"), std::string::npos) << key;
  EXPECT_NE(key.find("titan_unit_tests"), std::string::npos) << key;
  EXPECT_NE(key.find("LibTorch"), std::string::npos) << key;
  // Poisoned: a figure 1000x too low, as one measured in a slow moment and then kept.
  entries[key]["flops"] = 1e6;
  std::ofstream(file) << entries.dump();
  const auto poisoned = titan::metrics::peak_flops(cpu, at::kFloat);
  ASSERT_DOUBLE_EQ(poisoned.flops, 1e6);
  ASSERT_TRUE(poisoned.measured);
  // A step at 5 MFLOP/s beats it: measured again, and the cache now holds the new figure.
  const auto again = titan::metrics::remeasured_peak_flops(poisoned, 5e6);
  EXPECT_GT(again.flops, 1e8);
  EXPECT_NE(again.derivation.find("measured again"), std::string::npos) << again.derivation;
  EXPECT_NE(again.derivation.find("above the peak of 0.0 GFLOP/s"), std::string::npos) << again.derivation;
  EXPECT_DOUBLE_EQ(titan::metrics::peak_flops(cpu, at::kFloat).flops, again.flops);
  // A step faster than any matmul here: its own rate is the peak, so MFU stays at most 100%.
  const auto beyond = titan::metrics::remeasured_peak_flops(again, again.flops * 100);
  EXPECT_DOUBLE_EQ(beyond.flops, again.flops * 100);
  EXPECT_NE(beyond.derivation.find("the step's own rate is the peak"), std::string::npos) << beyond.derivation;
  // Figures titan did not measure (a GPU's table, TITAN_PEAK_FLOPS) are left as they are.
  titan::metrics::PeakFlops table;
  table.flops = 989e12;
  EXPECT_DOUBLE_EQ(titan::metrics::remeasured_peak_flops(table, 2e15).flops, 989e12);
}

TEST(PeakFlops, AFigureMeasuredOnABusyMachineIsMeasuredAgainAtAQuieterStart) {
  titan_test::TempDir dir;
  ScopedEnv cache("XDG_CACHE_HOME", dir.path());
  unsetenv("TITAN_PEAK_FLOPS");
  const auto cpu = at::Device(at::kCPU);
  const std::string file = dir.path() + "/titan/peak_flops.json";
  const auto share_in_cache = [&] {
    nlohmann::json entries;
    std::ifstream(file) >> entries;
    return entries.begin().value()["cpu_share"].get<double>();
  };
  {
    ScopedEnv busy("TITAN_TEST_CPU_SHARE", "0.5");
    const auto first = titan::metrics::peak_flops(cpu, at::kFloat);
    EXPECT_NE(first.derivation.find("measured now"), std::string::npos) << first.derivation;
    EXPECT_NE(first.derivation.find("while other work held the CPUs (its threads had 50% of their time"), std::string::npos)
        << first.derivation;
    EXPECT_DOUBLE_EQ(share_in_cache(), 0.5);
    // Still busy: the figure is used, said to be a busy one.
    const auto second = titan::metrics::peak_flops(cpu, at::kFloat);
    EXPECT_DOUBLE_EQ(second.flops, first.flops);
    EXPECT_NE(second.derivation.find("cached in"), std::string::npos) << second.derivation;
    EXPECT_NE(second.derivation.find("while other work held the CPUs"), std::string::npos) << second.derivation;
  }
  ScopedEnv quiet("TITAN_TEST_CPU_SHARE", "1");
  const auto third = titan::metrics::peak_flops(cpu, at::kFloat);
  EXPECT_NE(third.derivation.find("measured now"), std::string::npos) << third.derivation;
  EXPECT_NE(third.derivation.find("the cached figure had been measured while the CPUs were busy"), std::string::npos)
      << third.derivation;
  EXPECT_DOUBLE_EQ(share_in_cache(), 1.0);
  const auto fourth = titan::metrics::peak_flops(cpu, at::kFloat);
  EXPECT_DOUBLE_EQ(fourth.flops, third.flops);
  EXPECT_NE(fourth.derivation.find("cached in"), std::string::npos) << fourth.derivation;
}

TEST(PeakFlops, TheBusyCheckSeesOtherProcessesOnTheCores) {
  unsetenv("TITAN_TEST_CPU_SHARE");
  // As many spinning processes as the machine has cores: this process's threads get about half of their time.
  std::vector<pid_t> spinners;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned i = 0; i < cores; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      volatile unsigned long x = 0;
      while (std::chrono::steady_clock::now() < until) x = x + 1;
      _exit(0);
    }
    ASSERT_GT(pid, 0);
    spinners.push_back(pid);
  }
  const double share = titan::metrics::cpu_share_now(at::get_num_threads());
  for (pid_t pid : spinners) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
  EXPECT_LT(share, 0.85) << cores << " spinning processes beside " << at::get_num_threads() << " threads";
  EXPECT_GT(share, 0.0);
}

TEST(PeakFlops, EnvironmentOverrides) {
  ScopedEnv peak("TITAN_PEAK_FLOPS", "1.5e12");
  const auto p = titan::metrics::peak_flops(at::Device(at::kCPU), at::kBFloat16);
  EXPECT_DOUBLE_EQ(p.flops, 1.5e12);
  EXPECT_NE(p.derivation.find("TITAN_PEAK_FLOPS"), std::string::npos);
}

}  // namespace
