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

using protocols::Execution;
using protocols::FusedKernels;
using protocols::MemoryEstimate;
using protocols::MemoryTerm;
using protocols::Phase;

// `autocast`: the trainer computes in bfloat16 under autocast (float32 parameters without FSDP), keeping a bf16
// copy of every weight for the step. `runtime_bytes`: what the process already holds (LibTorch, buffers) when
// the estimate is made, added as its own term. `pipeline_rank`: the rank's coordinate on the pipeline dimension
// (its stages' layers, the embedding on the first, the output and logits on the last); -1: the busiest rank.
// `kernels`: which of titan's fused kernels run (kernels/fused_ops.h, with training.fused_kernels), which save
// less for backward: the CPU's (attention, RMSNorm, SwiGLU, RoPE, the loss's row passes) or the CUDA ones (SwiGLU,
// RoPE, the loss's row passes), or none (the ATen compositions). `titan plan` counts none: the CUDA kernels' saving
// is not measured on a GPU yet, and AMD GPUs run without them.
MemoryEstimate estimate_training_memory(const DecoderArgs& args, const config::JobConfig& config,
                                        const distributed::ParallelDims& dims, bool autocast, double runtime_bytes,
                                        Execution execution = Execution::titan, int64_t pipeline_rank = -1,
                                        FusedKernels kernels = FusedKernels::none);

}  // namespace titan::models
