// A memory estimate's terms and the rules that every family's estimate shares (which dtype the trainer computes
// in, whose execution is described, which fused kernels run). Each family's spec computes its own terms.
#pragma once
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"

namespace titan::protocols {

// When a term is held:
//   step             through the whole step
//   loss             only while the loss runs (the unfused logits; the fused loss's chunk and what it keeps for its
//                    backward)
//   blocks_backward  only while the blocks run backward (a recomputed block, the gradients flowing through a block)
//   optimizer_step   only while the optimizer steps, after backward (the foreach implementation's temporaries)
// and, where the trainer frees the gradients before each forward and backward makes them (one micro-batch per step
// on an allocator that hands freed memory to requests of any size: protocols::Allocator):
//   activations      from the forward until the blocks' backward frees them, block by block
//   gradients        the blocks' gradients, made block by block as their activations are freed
//   head_gradients   made by the loss's backward, before the blocks' (the output's weight and the final norm's)
//   last_gradients   made once the blocks' backward is done (the embedding's, when the output has its own weight)
//   embedding_backward  only while the embedding runs backward: the table-sized gradient it makes before it lands
// The loss is done and its logits freed before the blocks' backward starts, so the peak holds the whole step's
// terms and the largest of
//   activations + loss                                           (the forward's end and the loss)
//   the larger of activations and gradients + blocks_backward + head_gradients
//                                     (the blocks' backward: as a block's activations are freed its gradients are
//                                      made, so what is held moves from the first to the second)
//   gradients + head_gradients + last_gradients + embedding_backward  (the embedding's backward)
//   gradients + head_gradients + last_gradients + optimizer_step      (the optimizer's step)
// Without the gradient phases (pipelines, accumulation, steps in backward, CPUs) that is the largest of the loss's,
// the backward's and the optimizer step's on top of the whole step's.
enum class Phase { step, loss, blocks_backward, optimizer_step, activations, gradients, head_gradients, last_gradients, embedding_backward };

struct MemoryTerm {
  std::string name;  // "parameters", "activations", ...
  double bytes = 0;
  Phase phase = Phase::step;
};

struct MemoryEstimate {
  std::vector<MemoryTerm> terms;  // this rank's peak, term by term (the rank with the most layers under PP)
  double total() const;           // the whole-step terms plus the largest of the moments above
  double bytes(Phase phase) const;  // the sum of one phase's terms
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

// Which allocator holds the memory. One that gives a freed block only to a request of about its own size
// (`host_cache`: titan's host block cache until 2026-12-03) gives the gradients that backward makes new blocks beside
// the activations' freed ones, so the peak holds both. One that splits its freed memory for requests of any size (a
// GPU's caching allocator; the host block cache since it splits and merges its blocks) lets the gradients reuse the
// activations' memory as backward frees it: the peak holds the larger (Phase::activations and Phase::gradients;
// measured within 10% on CPUs, docs/metrics.md, and on an H200, docs/plan.md). The trainer uses `host_cache`
// only on a CPU without titan's cache (TITAN_HOST_ALLOCATOR=malloc: glibc's heap keeps what it serves).
enum class Allocator { host_cache, device_caching };

}  // namespace titan::protocols
