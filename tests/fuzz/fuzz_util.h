// Shared by the libFuzzer harnesses: scratch files for parsers that read paths, and the one acceptable way to
// refuse an input (titan::UserError). Any other exception, a crash or a sanitizer report is a finding.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "titan/common/error.h"
#include "titan/common/logging.h"

namespace titan_fuzz {

// A per-process folder in memory where possible (the harnesses write a file per input).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    titan::log::set_enabled(false);  // parsers' warnings would flood the fuzzer's output
    const std::filesystem::path base = std::filesystem::exists("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                                            : std::filesystem::temp_directory_path();
    const auto d = base / ("titan_fuzz_" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir;
}

// Writes `size` bytes to scratch_dir()/name (replacing it) and returns the path.
inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
  return path;
}

// Runs f; a UserError (a clear refusal naming the input) is fine, anything else propagates to libFuzzer.
template <typename F>
void refusals_allowed(F&& f) {
  try {
    f();
  } catch (const titan::UserError&) {
  }
}

}  // namespace titan_fuzz
