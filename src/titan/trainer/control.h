// What every rank must agree on before a step: the stop signals that end training after the current step, and the
// one control reduction per step (data exhausted, a failed background checkpoint write, the step's valid tokens, a
// stop signal that reached any rank). Also which ranks print (LOG_RANK).
#pragma once
#include <cstdint>
#include <vector>

#include "titan/distributed/communicator.h"

namespace titan {

// Installs the stop handlers for SIGINT (Ctrl-C), SIGTERM (scancel, preemption), SIGUSR1 (SLURM's --signal=USR1
// warning) and SIGHUP (a closed terminal) for its lifetime; a second stop signal ends the process at once.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  // The stop signal received since construction, or 0.
  static int received();

 private:
  std::vector<void (*)(int)> previous_;
};

const char* signal_name(int signal);

struct Control {
  bool exhausted = false, save_failed = false;
  int signal = 0;            // the stop signal that reached some rank (the highest-numbered), or 0
  int64_t valid_tokens = 0;  // valid label tokens of the step's global batch
};

// One all-reduce over `group` (all ranks; on the host where the launcher gives an MPI world): every rank gets the
// same answer. `replica_size`: the ranks of one data-parallel replica (TP x CP x PP), which hold the same batch.
// `device_reads` counts reads of device memory.
Control exchange_control(distributed::Communicator& group, int64_t replica_size, bool exhausted, int64_t valid_tokens,
                         int signal, bool save_failed, int64_t& device_reads);

// Ranks that print: LOG_RANK (comma-separated ranks, or "all"), rank 0 by default, as torchtitan's launcher.
bool rank_logs(int rank);

}  // namespace titan
