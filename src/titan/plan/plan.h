// `titan plan`: one layout's memory per rank (the start-up check's estimator plus what a GPU allocator adds) and
// step time on a cluster profile, and the search over layouts that recommends the fastest one that fits.
#pragma once
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/protocols/memory_estimate.h"
#include "titan/protocols/model_spec.h"
#include "titan/plan/cluster.h"
#include "titan/plan/step_time.h"

namespace titan::plan {

struct Plan {
  distributed::ParallelDims dims;
  std::string layout;           // "dp_shard 8 x tp 8 x pp 8, full AC, local batch 32, micro-batch 4, 1F1B"
  protocols::MemoryEstimate memory;  // allocated bytes per rank, term by term (under PP a bound over the pipeline ranks:
                                     // the most blocks and micro-batches any holds, with both ends and the loss)
  double reserved_bytes = 0;    // what the caching allocator holds at the peak (allocated + fragmentation)
  double device_bytes = 0;      // reserved + the CUDA/HIP context and communicator buffers outside it
  bool fits = false;
  // Under pipeline parallelism, each kind of pipeline rank: the first (embedding), the largest of the middle ones
  // and the last (output, logits), with its own layers and micro-batches in flight; under the V schedules
  // (ZBVZeroBubble, DualPipeV) rank 0, which holds the first and the last stage, and the largest of the others.
  // `memory` above bounds them all.
  struct PipelineRank {
    std::string kind;  // "first", "middle", "last"; "first_and_last" and "middle" in a V
    int64_t rank = 0;
    protocols::MemoryEstimate memory;
  };
  std::vector<PipelineRank> pipeline_ranks;
  StepTime time;
  std::vector<std::string> not_runnable;  // what titan models here but cannot run yet (float8, torch.compile, ...)
};

// `spec` is the family of `args` (models/registry.h); the step-time model covers the dense decoders.
Plan make_plan(const protocols::ModelSpec& spec, const protocols::ModelArgs& args, const config::JobConfig& config,
               const distributed::ParallelDims& dims, const ClusterProfile& cluster,
               protocols::Execution execution = protocols::Execution::titan,
               bool per_pipeline_rank = true);  // fill pipeline_ranks (the search skips them)

struct SearchOptions {
  int64_t gpus = 0;
  int64_t top = 5;
  protocols::Execution execution = protocols::Execution::titan;
};

// Every layout of `gpus` ranks (dp_replicate x dp_shard x cp x tp x pp, AC mode, micro-batch size, pipeline
// schedule) that keeps the config's global batch and sequence length, planned and ranked by tokens/s; those that
// do not fit are dropped. Also returns how many were tried and how many fit.
struct SearchResult {
  std::vector<Plan> best;
  int64_t tried = 0, fitting = 0;
};
SearchResult search_layouts(const protocols::ModelSpec& spec, const protocols::ModelArgs& args, const config::JobConfig& config,
                            const ClusterProfile& cluster, const SearchOptions& options);

}  // namespace titan::plan
