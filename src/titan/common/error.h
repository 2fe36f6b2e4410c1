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

// The error of a rank that stops because another rank failed (a collective told it so): that rank's own error says
// why. The command reports this one only if that rank's report has not ended the job first (cli/main.cpp).
class PeerFailure : public UserError {
 public:
  explicit PeerFailure(const std::string& message) : UserError(message) {}
};

template <typename... Args>
[[noreturn]] void fail_after_peer(const Args&... args) {
  throw PeerFailure(cat(args...));
}

}  // namespace titan
