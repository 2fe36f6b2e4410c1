// Fault injection for titan's own tests, all in one place: each switch is an environment variable named TITAN_TEST_*
// that no user setting needs, read once here (docs/architecture.md lists them). None changes what a healthy run
// computes; each makes a test's failure or rare path happen on demand.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace titan::test_faults {

// TITAN_TEST_CHECKPOINT_CRASH: "bytes:K" kills the saving rank (SIGKILL) once it has written K bytes of its data
// file; "before_metadata" / "before_rename" kill rank 0 at those points of the commit. TITAN_TEST_CHECKPOINT_CRASH_RANK
// restricts it to one rank.
struct CheckpointCrash {
  int64_t after_bytes = -1;
  std::string at;
  int rank = -1;
  bool applies_to(int r) const { return rank < 0 || rank == r; }
};
const CheckpointCrash& checkpoint_crash();

// TITAN_TEST_STOP_BEFORE=<step>:<action> (e.g. "4:1B0"): the pipeline rank that runs that action stops itself
// (SIGSTOP) just before it: a stage that hangs at a known point. step is -1 when unset.
struct StopBefore {
  int64_t step = -1;
  std::string action;
};
StopBefore stop_before();

// TITAN_TEST_AVAILABLE_MEMORY_BYTES: the memory check's "available" figure.
std::optional<double> available_memory_bytes();

// TITAN_TEST_BF16_PRODUCTS_IN_FLOAT=1 or 0: compute bf16 matmuls as float32 products of the bf16 inputs (the path of
// CPUs without AVX512_BF16), or not, whatever the CPU (nn/matmul.h).
std::optional<bool> bf16_products_in_float();

// TITAN_TEST_MOE_COLLAPSE=1: every MoE router sends each token's k-th choice to expert k (expert 0 gets every
// token): a collapsed router, for the tests of what expert parallelism does then.
bool moe_collapse();

// TITAN_TEST_EXPERT_RECEIVE_LIMIT_BYTES: the memory each rank says it has for the tokens expert parallelism sends it.
std::optional<double> expert_receive_limit_bytes();

// TITAN_TEST_TORCH_SAVE_FORCE_ZIP64: torch.save files use ZIP64 records however small (the >4 GiB layout).
bool torch_save_force_zip64();

}  // namespace titan::test_faults
