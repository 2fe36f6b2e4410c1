#include "titan/trainer/control.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iterator>
#include <string>

#include "titan/common/strings.h"

namespace titan {
namespace {

std::atomic<int> g_stop_signal{0};

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGHUP};

void on_stop_signal(int signal) {
  if (g_stop_signal.exchange(signal) != 0) {
    // A second stop signal, of any kind, ends the process at once, even mid-step.
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  std::signal(signal, SIG_DFL);  // and a second one of the same kind gets the default behaviour directly
}

}  // namespace

StopSignals::StopSignals() {
  g_stop_signal = 0;
  for (int s : kStopSignals) previous_.push_back(std::signal(s, on_stop_signal));
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < previous_.size(); ++i) std::signal(kStopSignals[i], previous_[i]);
}

int StopSignals::received() { return g_stop_signal.load(); }

const char* signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGHUP: return "SIGHUP";
  }
  return "a signal";
}

Control exchange_control(distributed::Communicator& group, int64_t replica_size, bool exhausted, int64_t valid_tokens,
                         int signal, bool save_failed, int64_t& device_reads) {
  // Sums over all ranks: ranks out of data, failed background saves, valid label tokens, and for each stop signal
  // the ranks it reached. The ranks of one data-parallel replica hold the same batch, so the world's token sum is
  // the replicas' sum times their size.
  std::vector<int64_t> values = {exhausted ? 1 : 0, save_failed ? 1 : 0, valid_tokens};
  for (int s : kStopSignals) values.push_back(signal == s ? 1 : 0);
  if (group.size() > 1) {
    at::Tensor t = at::tensor(values, at::kLong).to(group.tensor_device());
    group.all_reduce(t, distributed::ReduceOp::Sum);
    if (!t.device().is_cpu()) ++device_reads;
    t = t.cpu();
    for (size_t i = 0; i < values.size(); ++i) values[i] = t[static_cast<int64_t>(i)].item<int64_t>();
    values[2] /= replica_size;
  }
  Control out;
  out.exhausted = values[0] > 0;
  out.save_failed = values[1] > 0;
  out.valid_tokens = values[2];
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    if (values[3 + i] > 0) out.signal = std::max(out.signal, kStopSignals[i]);
  return out;
}

bool rank_logs(int rank) {
  const char* env = std::getenv("LOG_RANK");
  if (!env || !*env) return rank == 0;
  if (std::string(env) == "all") return true;
  for (const auto& part : split(env, ','))
    if (trim(part) == std::to_string(rank)) return true;
  return false;
}

}  // namespace titan
