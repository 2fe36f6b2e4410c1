// Accelerator and cluster profiles for `titan plan`: peak FLOP/s, memory, bandwidths, GPUs per node and the
// sustained matmul efficiency, built in for common GPUs or read from a TOML file (docs/plan.md).
#pragma once
#include <string>
#include <vector>

namespace titan::plan {

// The figures fitted to published torchtitan runs rather than derived from datasheets or counted (docs/plan.md, "The
// constants"): the speed of what titan has not run on GPUs itself and the allocator's reserve. A profile may set its
// own, for example those `titan plan --calibrate` fits to runs measured on that cluster.
struct Calibration {
  double compile_memory_share = 0.5;                // torch.compile: the memory-bound kernels' bytes shrink to this share
  double float8_relative_efficiency = 0.8;          // float8 GEMMs' share of their peak against bf16 GEMMs' share of theirs
  double ring_attention_overhead_per_rank = 0.09;   // ring attention's loss of efficiency per further CP rank
  double allocator_overhead = 0.02;                 // the caching allocator's reserve above the allocated bytes
};

struct ClusterProfile {
  std::string name;                 // "h100-sxm", or the TOML file's `name`
  std::string description;          // "NVIDIA H100 SXM5 80GB (700 W)"
  double peak_bf16_flops = 0;       // dense, per GPU (the vendor's figure MFU is measured against)
  double peak_fp8_flops = 0;        // dense, per GPU; 0 where the GPU has no fp8 matmul
  double memory_bytes = 0;          // device memory usable by the allocator
  double memory_bandwidth = 0;      // bytes/s
  double intra_node_bandwidth = 0;  // bytes/s per GPU, one direction, inside a node (NVLink, xGMI)
  double inter_node_bandwidth = 0;  // bytes/s per GPU, one direction, across nodes (the NIC share of one GPU)
  int64_t gpus_per_node = 8;        // GPUs sharing the intra-node link (the NVLink domain on GB200 NVL72)
  double matmul_efficiency = 0.7;   // fraction of peak_bf16_flops that large bf16 matmuls sustain (8192 cubed)
  // Streaming multiprocessors (NVIDIA) or compute units (AMD): a GEMM's output tiles run in waves of this many, so a
  // small matmul leaves part of the last wave idle (docs/plan.md, "Matmul shapes"). 0: shapes not modelled.
  int64_t multiprocessors = 0;
  // The fixed time one matmul launch takes beyond its tiles' work (launch, prologue and epilogue, the pipeline's
  // fill and drain), which small products feel most: chosen per architecture on the same published GEMM table.
  double gemm_launch_seconds = 0;
  // "nvidia" or "amd": which of titan's kernels the trainer runs there (its CUDA kernels are NVIDIA's only), for the
  // memory its fused kernels save.
  std::string vendor = "nvidia";
  std::string source;               // where the figures come from
  Calibration calibration;
};

const std::vector<ClusterProfile>& builtin_cluster_profiles();

// `spec` is a built-in profile name or a TOML file (see docs/plan.md); throws UserError naming the file, the key
// or the known names.
ClusterProfile load_cluster_profile(const std::string& spec);

}  // namespace titan::plan
