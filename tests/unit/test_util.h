// Helpers for unit tests: temporary directories and the shared third-party data (skipped when absent).
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace titan_test {

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("titan_test_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }
  std::string write(const std::string& name, const std::string& content) const {
    auto p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

inline std::string shared_data_dir() {
  if (const char* env = std::getenv("TITAN_SHARED_DATA")) return env;
  return "../shared/data";
}

}  // namespace titan_test

// Skips the current test when ../shared/data (third-party data) is absent, as in a user's fresh clone.
#define TITAN_SHARED_OR_SKIP(var, relative)                                                         \
  std::string var = titan_test::shared_data_dir() + "/" + (relative);                               \
  if (!std::filesystem::exists(var)) GTEST_SKIP() << "skipped: third-party test data " << var << " is absent"
