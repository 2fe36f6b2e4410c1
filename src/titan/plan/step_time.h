// The speed half of `titan plan`: the time of one training step on one rank of a layout, term by term (matmuls,
// attention, memory-bound kernels, the loss, the optimizer, the communication each parallelism exposes, the
// pipeline bubble), and the tokens/s and MFU that follow. The equations and calibration constants are in
// docs/plan.md.
#pragma once
#include <string>
#include <vector>

#include "titan/config/job_config.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/models/common/decoder_args.h"
#include "titan/protocols/memory_estimate.h"
#include "titan/plan/cluster.h"

namespace titan::plan {

struct TimeTerm {
  std::string name;     // "matmuls", "fsdp", ...
  double seconds = 0;   // on the step's critical path (communication: the part compute does not hide)
  double total = 0;     // communication: the whole transfer time, hidden or not; compute: as `seconds`
  std::string detail;   // "intra-node 360 GB/s", ...
};

// How far published runs lay from predictions made without them: the 32 runs of
// ../shared/data/published/torchtitan_runs.csv, each predicted with the calibrated constants fitted without its
// source (`titan plan --calibrate`, one fold per source), and the 26 of tests/plan/published_heldout.csv, on which
// nothing was fitted (`titan plan --evaluate`); docs/plan.md. For 80% of those 58 runs the predicted/measured
// tokens/s lay between these two. tests/cli/test_plan.py recomputes them and holds these to its result.
constexpr double kHeldOutSpeedRatioP10 = 0.861;
constexpr double kHeldOutSpeedRatioP90 = 1.794;

struct StepTime {
  std::vector<TimeTerm> terms;
  double bubble_fraction = 0;   // share of the step the pipeline schedule leaves idle
  double step_seconds = 0;
  double tokens_per_second_per_device = 0;
  // The band a measured rate fell in for 80% of held-out published runs: tokens/s / P90 to tokens/s / P10.
  double tokens_per_second_low = 0, tokens_per_second_high = 0;
  double mfu = 0;               // torchtitan's FLOPs formula against the profile's peak bf16 FLOP/s
  std::string bound;            // the largest term, or "pipeline bubble"
};

// Matmul efficiency by shape: the rate of `batch` products of (m x k) by (k x n), the output tiled in waves over
// the device's `multiprocessors`, relative to one 8192-cubed product (the size `matmul_efficiency` is quoted at).
// 1 when `multiprocessors` is 0. `launch_flops` is what the device computes at its large-GEMM rate in the fixed time
// one launch takes (ClusterProfile::gemm_launch_seconds times that rate), added to every launch. The tiles, the
// per-tile overhead and the launch times were chosen on OpenXLA's published GEMM table (docs/plan.md, "Matmul
// shapes"), never on training runs.
double matmul_shape_factor(double batch, double m, double n, double k, int64_t multiprocessors, double launch_flops = 0);

// What the layout runs that titan does not (yet): modelled as stated in docs/plan.md.
struct Speedups {
  bool compile = false;           // compile.enable: torch.compile fuses the memory-bound kernels
  bool float8 = false;            // model.converters has "float8": linear layers' matmuls in float8
  bool float8_all_gather = false; // quantize.linear.float8.enable_fsdp_float8_all_gather
  // quantize.linear.float8.recipe_name: "tensorwise" (unset), "rowwise" or "rowwise_with_gw_hp"
  std::string float8_recipe = "tensorwise";
};
Speedups speedups_of(const config::JobConfig& config);

StepTime estimate_step_time(const models::DecoderArgs& args, const config::JobConfig& config,
                            const distributed::ParallelDims& dims, const ClusterProfile& cluster,
                            protocols::Execution execution = protocols::Execution::titan);

}  // namespace titan::plan
