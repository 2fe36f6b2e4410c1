// Helpers for the CUDA tests: skipping without a GPU, a CPU dry run, a synthetic corpus and tokenizer, tensor
// comparisons and the "[figure]" lines that scripts/test_gpu.sh collects into its summary.
#pragma once
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "titan/components/tokenizer/bpe_trainer.h"

namespace titan_gpu_test {

inline bool cuda_available() { return torch::cuda::is_available(); }

// TITAN_GPU_TESTS_DRY_RUN=1 runs the tests that can run on a CPU there (the device assertions relaxed), so that the
// test code itself is checked on machines without a GPU. NCCL tests always need a GPU.
inline bool dry_run() {
  const char* env = std::getenv("TITAN_GPU_TESTS_DRY_RUN");
  return env && std::string(env) == "1" && !cuda_available();
}

inline at::Device test_device() { return cuda_available() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU); }

// One line per measured number, "[figure] name = value", printed as soon as it is known.
inline void figure(const std::string& name, double value) {
  std::printf("[figure] %s = %.6g\n", name.c_str(), value);
  std::fflush(stdout);
}
inline void figure(const std::string& name, const std::string& value) {
  std::printf("[figure] %s = %s\n", name.c_str(), value.c_str());
  std::fflush(stdout);
}

// Largest elementwise difference relative to the reference's largest magnitude (float64 on the host).
inline double max_relative_difference(const at::Tensor& actual, const at::Tensor& reference) {
  at::Tensor a = actual.detach().to(at::kCPU, at::kDouble), r = reference.detach().to(at::kCPU, at::kDouble);
  const double scale = std::max(r.abs().max().item<double>(), 1e-12);
  return (a - r).abs().max().item<double>() / scale;
}

inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().to(at::kCPU), y = b.detach().to(at::kCPU);
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() && at::equal(x, y);
}

// A directory removed at exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& stem) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string sub(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Text with a small grammar: a model learns it within a few dozen steps, so a falling loss is a clear signal. The
// corpus is the same on every machine (a fixed generator, modulo reduction, no library distributions).
struct SyntheticData {
  std::string corpus_dir;  // one .txt file per document
  std::string tokenizer;   // tiktoken file, 1024 ids (768 byte-level merges' room + 256 specials)
};

inline const SyntheticData& synthetic_data() {
  static ScratchDir dir("titan_gpu_data");
  static SyntheticData data = [] {
    static const char* const subjects[] = {"the engineer", "a small robot", "the old sailor", "my neighbour", "the teacher",
                                           "a curious cat", "the night guard", "our captain"};
    static const char* const verbs[] = {"repairs", "paints", "watches", "carries", "counts", "builds", "cleans", "finds"};
    static const char* const objects[] = {"the red boat", "seven lanterns", "a wooden bridge", "the tall tower",
                                          "twelve letters", "a broken clock", "the green door", "three maps"};
    static const char* const places[] = {"near the harbour", "before sunrise", "in the quiet village", "after the storm",
                                         "under the bridge", "at the market"};
    SyntheticData d;
    d.corpus_dir = dir.sub("corpus");
    std::filesystem::create_directories(d.corpus_dir);
    std::mt19937_64 rng(20261123);
    for (int file = 0; file < 160; ++file) {
      std::string text;
      for (int sentence = 0; sentence < 40; ++sentence) {
        std::string s = std::string(subjects[rng() % 8]) + " " + verbs[rng() % 8] + " " + objects[rng() % 8] + " " +
                        places[rng() % 6] + ". ";
        s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
        text += s;
      }
      char name[32];
      std::snprintf(name, sizeof(name), "doc-%04d.txt", file);
      std::ofstream(std::filesystem::path(d.corpus_dir) / name) << text << "\n";
    }
    d.tokenizer = dir.sub("synthetic.tiktoken");
    titan::tokenizer::BpeTrainerOptions options;
    options.vocab_size = 1024;
    titan::tokenizer::train_bpe_files({d.corpus_dir}, options, d.tokenizer);
    return d;
  }();
  return data;
}

// `titan train` options for the debug model on the synthetic corpus; `extra` comes last and wins.
inline std::vector<std::string> debug_trainer_args(const std::string& dump_folder, const std::vector<std::string>& extra) {
  const SyntheticData& data = synthetic_data();
  std::vector<std::string> args = {"--model.flavor", "debugmodel", "--model.hf_assets_path", data.tokenizer,
                                   "--training.dataset_path", data.corpus_dir, "--training.seq_len", "128",
                                   "--training.local_batch_size", "8", "--lr_scheduler.warmup_steps", "2",
                                   "--optimizer.lr", "3e-3", "--metrics.log_freq", "1000", "--debug.seed", "11",
                                   "--job.dump_folder", dump_folder};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

}  // namespace titan_gpu_test

// Every CUDA test starts with one of these. Without a GPU the test is skipped with the reason, so the binary runs
// harmlessly (and passes) on CPU-only machines.
#define TITAN_REQUIRE_CUDA()                                                                                  \
  do {                                                                                                        \
    if (!titan_gpu_test::cuda_available())                                                                    \
      GTEST_SKIP() << "no CUDA device: torch::cuda::is_available() is false; this test needs an NVIDIA GPU"; \
  } while (0)

// As TITAN_REQUIRE_CUDA, but with TITAN_GPU_TESTS_DRY_RUN=1 the test runs on the CPU instead (checks of the test
// code; device-specific assertions are guarded by titan_gpu_test::cuda_available()).
#define TITAN_REQUIRE_CUDA_OR_DRY_RUN()                                                                        \
  do {                                                                                                         \
    if (!titan_gpu_test::cuda_available() && !titan_gpu_test::dry_run())                                       \
      GTEST_SKIP() << "no CUDA device: torch::cuda::is_available() is false; this test needs an NVIDIA GPU "   \
                      "(TITAN_GPU_TESTS_DRY_RUN=1 runs it on the CPU to check the test itself)";               \
  } while (0)
