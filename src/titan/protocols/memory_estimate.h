// A memory estimate's terms and the rules that every family's estimate shares (which dtype the trainer computes
// in, whose execution is described, which fused kernels run). Each family's spec computes its own terms.
#pragma once
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"

namespace titan::protocols {

// When a term is held: through the whole step, or only while the loss runs (the unfused logits), or only while the
// blocks run backward (a recomputed block, the gradients flowing through a block). The loss is done and its logits
// freed before the blocks' backward starts, so the peak holds the larger of the last two, not both.
enum class Phase { step, loss, blocks_backward };

struct MemoryTerm {
  std::string name;  // "parameters", "activations", ...
  double bytes = 0;
  Phase phase = Phase::step;
};

struct MemoryEstimate {
  std::vector<MemoryTerm> terms;  // this rank's peak, term by term (the rank with the most layers under PP)
  double total() const;           // the whole-step terms plus the larger of the loss's and the blocks' backward's
  std::string describe() const;   // "parameters 24.7 MiB, ..., runtime ..., and the larger of ...: 1.23 GiB"
};

// Whose execution the estimate describes: titan's own (the start-up check, `titan plan`), or torchtitan's as of its
// published benchmarks (`titan plan --as torchtitan`): under TP its op-level selective AC also keeps the
// reduce-scatters' outputs, and its loss keeps float32 logits (12 bytes per logit at the peak instead of titan's
// compute-dtype copy on top).
enum class Execution { titan, torchtitan };

// The trainer's mixed-precision rule: without FSDP, float32 parameters with mixed_precision_param = bfloat16 compute
// under autocast; FSDP gathers the weights in mixed_precision_param instead.
bool computes_under_autocast(const config::JobConfig& config, const distributed::ParallelDims& dims);
// Bytes per element of the compute dtype that rule gives (2 for bfloat16, 4 for float32).
double compute_dtype_bytes(const config::JobConfig& config, const distributed::ParallelDims& dims);

// Which fused kernels run (kernels/fused_ops.h, with training.fused_kernels); they save less for backward: the
// CPU's (attention, RMSNorm, SwiGLU, RoPE, the loss's row passes), the CUDA ones (SwiGLU, RoPE, the loss's row
// passes), or none (the ATen compositions).
enum class FusedKernels { none, cpu, cuda };

}  // namespace titan::protocols
