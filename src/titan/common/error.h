// UserError: the exception for bad input (config, data, tokenizer, command line); the CLI prints its message.
#pragma once
#include <atomic>
#include <chrono>
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

// Whether this process has learnt that another rank failed: a collective said so (PeerFailure), or the communicator
// reported a peer's abort (NCCL's remote error). An error this rank then meets is likely a consequence; it waits
// kPeerFailureReportDelay before reporting, so that the failing rank's own report comes first and its exit ends the
// job (cli/main.cpp, distributed/nccl_communicator.cpp).
inline std::atomic<bool>& peer_failure_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
inline void note_peer_failure() { peer_failure_flag() = true; }
inline bool peer_failure_noted() { return peer_failure_flag(); }
constexpr std::chrono::seconds kPeerFailureReportDelay{10};

// The error of a rank that stops because another rank failed (a collective told it so): that rank's own error says
// why. The command reports this one only if that rank's report has not ended the job first (cli/main.cpp).
class PeerFailure : public UserError {
 public:
  explicit PeerFailure(const std::string& message) : UserError(message) { note_peer_failure(); }
};

template <typename... Args>
[[noreturn]] void fail_after_peer(const Args&... args) {
  throw PeerFailure(cat(args...));
}

}  // namespace titan
