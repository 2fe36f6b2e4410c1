// JobConfig: every section and key of torchtitan v0.2.2's job config, with the same names and defaults.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::config {

using StringList = std::vector<std::string>;

struct Job {
  std::string config_file;
  std::string dump_folder = "./outputs";
  std::string description = "default job";
  bool print_config = false;
  std::optional<std::string> save_config_file;
  std::string custom_config_module;
};

struct Profiling {
  bool enable_profiling = false;
  std::string save_traces_folder = "profile_traces";
  int64_t profile_freq = 10;
  int64_t profiler_active = 1;
  int64_t profiler_warmup = 3;
  bool enable_memory_snapshot = false;
  std::string save_memory_snapshot_folder = "memory_snapshot";
};

struct Metrics {
  int64_t log_freq = 10;
  bool enable_tensorboard = false;
  bool disable_color_printing = false;
  std::string save_tb_folder = "tb";
  bool save_for_all_ranks = false;
  bool enable_wandb = false;
  bool enable_jsonl = false;  // titan.cpp: {dump_folder}/metrics.jsonl, one record per logged step
};

struct Model {
  std::string name = "llama3";
  std::string flavor = "debugmodel";
  std::string hf_assets_path = "./tests/assets/tokenizer";
  std::optional<std::string> tokenizer_path;
  StringList converters;
  bool print_after_conversion = false;
  std::string attn_mask_type = "causal";  // causal | block_causal (documents in a window do not attend to each other)
  // titan.cpp additions: any shape of the family. Each key that is set replaces the flavor's value.
  std::optional<int64_t> dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, multiple_of, hidden_dim, max_seq_len;
  std::optional<double> ffn_dim_multiplier, norm_eps, rope_theta;
  std::string rope_scaling = "flavor";  // "flavor" (its own) | "llama3" | "none"
  std::optional<double> rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor;
  std::optional<int64_t> rope_original_max_position_embeddings;
  bool tie_word_embeddings = false;  // replaces the flavor's only when set
  // Mixture-of-Experts flavors: experts per block, experts per token, each expert's width (torchtitan's
  // moe_args.num_experts, moe_args.top_k, moe_inter_dim).
  std::optional<int64_t> moe_num_experts, moe_top_k, moe_inter_dim;
  // The balancing bias's step (torchtitan's moe_args.load_balance_coeff, 1e-3 in its flavors); 0 turns balancing off.
  std::optional<double> moe_load_balance_coeff;
  // DeepSeek-V3: the dense blocks before the MoE ones, and the latent attention's widths (DeepSeekV3ModelArgs').
  std::optional<int64_t> n_dense_layers, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
};

struct Optimizer {
  std::string name = "AdamW";
  double lr = 8e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::string implementation = "fused";
  bool early_step_in_backward = false;
};

struct LRScheduler {
  int64_t warmup_steps = 200;
  std::optional<int64_t> total_steps;
  std::optional<double> decay_ratio;
  std::string decay_type = "linear";
  double min_lr_factor = 0.0;
};

// One source of a dataset mixture ([[training.datasets]] tables; a titan.cpp extension).
struct DatasetSource {
  std::string name;                 // for logs and state; default: the path
  std::string path;                 // file, directory or glob; "" with name "fortunes" = built-in corpus
  std::string format = "auto";      // auto | text | lines | paragraphs | jsonl | fortune | tokens | parquet | arrow
  double weight = 1.0;              // share of documents (rows) drawn from this source
  std::string text_field = "text";  // JSONL / Parquet column holding the text
  bool loop = true;                 // start a new epoch when exhausted; false: drop out of the mixture
  bool operator==(const DatasetSource&) const = default;
};
using DatasetSources = std::vector<DatasetSource>;

struct DataLoader {
  int64_t num_workers = 0;
  bool persistent_workers = false;
  bool pin_memory = false;
  std::optional<int64_t> prefetch_factor;
};

struct Training {
  std::string dataset = "c4_test";
  std::optional<std::string> dataset_path;
  int64_t local_batch_size = 8;
  int64_t global_batch_size = -1;
  int64_t seq_len = 2048;
  double max_norm = 1.0;
  int64_t steps = 10000;
  bool enable_cpu_offload = false;
  std::string dtype = "float32";
  std::string mixed_precision_param = "bfloat16";
  std::string mixed_precision_reduce = "float32";
  int64_t gc_freq = 50;
  bool gc_debug = false;
  DataLoader dataloader;
  // titan.cpp data pipeline extensions (see docs/data.md).
  DatasetSources datasets;            // a mixture; when set, dataset / dataset_path are not used
  std::string dataset_format = "auto";
  std::string text_field = "text";
  int64_t data_seed = 0;
  int64_t shuffle_buffer = 0;         // rows per shuffled block; 0 or 1 = file order
  bool shuffle_shards = false;
  int64_t data_lanes = -1;            // independent packing streams; -1 = data-parallel degree
  bool skip_malformed_rows = false;
  int64_t prefetch_batches = 4;
  // titan.cpp: a step whose loss or gradient norm is not finite is skipped (no update) instead of stopping the run,
  // up to this many in a row; 0 = stop at the first.
  int64_t skip_nonfinite_steps = 0;
  // titan.cpp: fused CPU kernels (kernels/fused_ops.h); false = plain ATen compositions.
  bool fused_kernels = true;
  // titan.cpp: under autocast, each weight's bf16 copy is kept for the whole step ("step") or made again in every
  // forward and recomputation ("forward", LibTorch's own behaviour).
  std::string autocast_weight_casts = "step";
};

struct Parallelism {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;
  std::string fsdp_reshard_after_forward = "default";
  int64_t tensor_parallel_degree = 1;
  bool disable_loss_parallel = false;
  bool enable_async_tensor_parallel = false;
  int64_t pipeline_parallel_degree = 1;
  std::optional<std::vector<StringList>> module_fqns_per_model_part;
  int64_t pipeline_parallel_first_stage_less_layers = 1;
  int64_t pipeline_parallel_last_stage_less_layers = 1;
  std::optional<int64_t> pipeline_parallel_layers_per_stage;
  std::string pipeline_parallel_schedule = "1F1B";
  std::optional<std::string> pipeline_parallel_schedule_csv = std::string();
  int64_t pipeline_parallel_microbatch_size = 1;
  bool pipeline_parallel_expert_parallel_overlap = true;
  int64_t context_parallel_degree = 1;
  std::optional<std::string> context_parallel_load_balancer = std::string("headtail");
  std::string context_parallel_rotate_method = "allgather";
  int64_t expert_parallel_degree = 1;
  int64_t expert_tensor_parallel_degree = 1;
  std::string expert_parallel_comm_backend = "standard";
};

struct Checkpoint {
  bool enable = false;
  bool enable_ft_dataloader_checkpoints = true;
  std::string folder = "checkpoint";
  int64_t interval = 500;
  std::optional<std::string> initial_load_path;
  bool initial_load_model_only = true;
  bool initial_load_in_hf = false;
  bool initial_load_in_hf_quantized = false;
  bool last_save_model_only = true;
  bool last_save_in_hf = false;
  std::string export_dtype = "float32";
  std::string async_mode = "disabled";
  int64_t keep_latest_k = 10;
  int64_t load_step = -1;
  StringList exclude_from_loading;
  bool enable_first_step_checkpoint = false;
  bool create_seed_checkpoint = false;
  bool load_only = false;
};

struct ActivationCheckpoint {
  std::string mode = "selective";
  std::string selective_ac_option = "2";
  StringList per_op_sac_force_recompute_mm_shapes_by_fqns = {"moe.router.gate"};
  bool early_stop = false;
  double memory_budget = 0.5;
  bool visualize_memory_budget_pareto = false;
  bool preserve_rng_state = true;
  std::string determinism_check = "default";
  bool debug = false;
};

struct Compile {
  bool enable = false;
  StringList components = {"model", "loss"};
  std::string backend = "inductor";
};

struct Float8Linear {
  bool enable_fsdp_float8_all_gather = false;
  bool precompute_float8_dynamic_scale_for_fsdp = false;
  std::optional<std::string> recipe_name;
  StringList filter_fqns;
  bool emulate = false;
};

struct MXLinear {
  std::string mxfp8_dim1_cast_kernel_choice = "triton";
  std::string recipe_name = "mxfp8_cublas";
  StringList filter_fqns = {"output"};
  bool emulate = false;  // titan's key: MX matmuls emulated (dequantised, multiplied in high precision) on any device
};

struct Float8GroupedMM {
  StringList fqns;
};

struct MXGroupedMM {
  std::string recipe_name = "mxfp8";
  StringList fqns;
};

struct Quantize {
  struct Linear {
    Float8Linear float8;
    MXLinear mx;
  } linear;
  struct GroupedMM {
    Float8GroupedMM float8;
    MXGroupedMM mx;
  } grouped_mm;
};

struct Comm {
  int64_t init_timeout_seconds = 300;
  int64_t train_timeout_seconds = 100;
  int64_t trace_buf_size = 20000;
  std::string save_traces_folder = "comm_traces";
  std::string save_traces_file_prefix = "rank_";
  std::string mode = "default";
};

struct MemoryEstimation {
  bool enable = false;
  bool disable_fake_mode = false;
};

struct FaultTolerance {
  bool enable = false;
  std::string process_group = "gloo";
  int64_t process_group_timeout_ms = 10000;
  int64_t replica_id = 0;
  int64_t group_size = 0;
  int64_t min_replica_size = 1;
  std::optional<std::string> semi_sync_method;
};

struct Experimental {
  std::string custom_import;
  std::string custom_args_module;
};

struct Validation {
  bool enable = false;
  std::string dataset = "c4_validation";
  std::optional<std::string> dataset_path;
  std::string dataset_format = "auto";  // as training.dataset_format (titan.cpp)
  int64_t local_batch_size = 8;
  int64_t seq_len = 2048;
  int64_t freq = 10;
  int64_t steps = -1;
  DataLoader dataloader;
};

struct Debug {
  std::optional<int64_t> seed;
  bool deterministic = false;
  bool deterministic_warn_only = false;
  bool moe_force_load_balance = false;
  // titan.cpp: write every pipeline action's start/end per rank to {dump_folder}/pipeline_timeline/rank-R.csv.
  bool pipeline_timeline = false;
  // titan.cpp: start even when the memory estimate exceeds the memory available (models/common/decoder_memory.h).
  bool skip_memory_check = false;
};

struct JobConfig {
  Job job;
  Profiling profiling;
  Metrics metrics;
  Model model;
  Optimizer optimizer;
  LRScheduler lr_scheduler;
  Training training;
  Parallelism parallelism;
  Checkpoint checkpoint;
  ActivationCheckpoint activation_checkpoint;
  Compile compile;
  Quantize quantize;
  Comm comm;
  MemoryEstimation memory_estimation;
  FaultTolerance fault_tolerance;
  Experimental experimental;
  Validation validation;
  Debug debug;
};

}  // namespace titan::config
