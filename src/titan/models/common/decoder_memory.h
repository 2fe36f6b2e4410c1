// How much memory one rank needs to train a decoder (Llama 3, Qwen3, DeepSeek-V3: dense and Mixture-of-Experts
// blocks, grouped-query and latent attention) under a job's layout, from shapes alone: parameters, gradients,
// optimizer state, compute copies of the weights, activations under the activation-checkpointing mode, logits and
// loss, the RoPE table. The start-up memory check and `titan plan` use it; the equations and their validation are in
// docs/metrics.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/models/common/decoder_args.h"
#include "titan/protocols/memory_estimate.h"

namespace titan::models {

using protocols::Allocator;
using protocols::Execution;
using protocols::FusedKernels;
using protocols::MemoryEstimate;
using protocols::MemoryTerm;
using protocols::Phase;

// One linear of a block: its weight's input and output widths, and how tensor parallelism splits it (the output
// column-wise, the input row-wise, or not at all: latent attention's wq_a and wkv_a run whole on every rank).
struct BlockLinear {
  enum class Split { column, row, none };
  // What it reads: a normalised residual stream (attention's or the feed-forward's input), the same tensor as an
  // earlier linear in the list (wk and wv as wq, w3 as w1, wkv_a as wq_a or wq), or a tensor of its own.
  enum class Input { stream, shared, own };
  double in = 0, out = 0;
  Split split = Split::none;
  Input input = Input::own;
};
// A block's linears in forward order, as op-level checkpointing counts them (nn/kept_ops.h: the 1st, 3rd, ... are
// kept, the others recomputed): attention's, then the dense feed-forward's or a MoE block's shared experts' (none
// without shared experts); the router's gate is not counted. The memory estimate and `titan plan` both use it.
std::vector<BlockLinear> block_linears(const DecoderArgs& args, bool moe_block);

// `autocast`: the trainer computes in bfloat16 under autocast (float32 parameters without FSDP), keeping a bf16
// copy of every weight for the step. `runtime_bytes`: what the process already holds (LibTorch, buffers) when
// the estimate is made, added as its own term. `pipeline_rank`: the rank's coordinate on the pipeline dimension
// (its stages' layers, the embedding on the first, the output and logits on the last); -1: the busiest rank.
// `kernels`: which of titan's fused kernels run (kernels/fused_ops.h, with training.fused_kernels), which save
// less for backward: the CPU's (attention, RMSNorm, SwiGLU, RoPE, the loss's row passes) or the CUDA ones (SwiGLU,
// RoPE, the loss's row passes), or none (the ATen compositions). `titan plan` counts the CUDA ones on NVIDIA GPUs and
// none on AMD's. `allocator`: whether the gradients made in backward can reuse the activations' freed memory
// (protocols::Allocator).
MemoryEstimate estimate_training_memory(const DecoderArgs& args, const config::JobConfig& config,
                                        const distributed::ParallelDims& dims, bool autocast, double runtime_bytes,
                                        Execution execution = Execution::titan, int64_t pipeline_rank = -1,
                                        FusedKernels kernels = FusedKernels::none,
                                        Allocator allocator = Allocator::device_caching);

}  // namespace titan::models
