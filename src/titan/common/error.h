// UserError: the exception for bad input (config, data, tokenizer, command line); the CLI prints its message.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace titan {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message) {}
};

// Concatenates any streamable values into a string: cat("expected ", n, " got ", m).
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw UserError(cat(args...));
}

}  // namespace titan
