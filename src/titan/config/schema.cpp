#include "titan/config/schema.h"

#include <algorithm>
#include <set>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::config {
namespace {

struct Builder {
  std::vector<KeySpec> keys;
  std::string section;

  Builder& in(std::string s) {
    section = std::move(s);
    return *this;
  }
  KeySpec& add(std::string name, ValuePtr value, std::string doc) {
    keys.push_back(KeySpec{section, std::move(name), value, std::move(doc), {}, {}, {}, false, {}});
    return keys.back();
  }
};

KeySpec& choices(KeySpec& k, std::vector<std::string> c) {
  k.choices = std::move(c);
  return k;
}
KeySpec& at_least(KeySpec& k, double v) {
  k.min = v;
  return k;
}
KeySpec& positive(KeySpec& k) {
  k.min = 0;
  k.min_exclusive = true;
  return k;
}
KeySpec& between(KeySpec& k, double lo, double hi) {
  k.min = lo;
  k.max = hi;
  return k;
}

std::string number_string(double v) {
  std::string s = strprintf("%.10g", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string list_string(const StringList& list) {
  std::vector<std::string> quoted_items;
  for (const auto& s : list) quoted_items.push_back(quote(s));
  return "[" + join(quoted_items, ", ") + "]";
}

}  // namespace

std::string KeySpec::type_name() const {
  struct Visitor {
    std::string operator()(bool*) const { return "bool"; }
    std::string operator()(int64_t*) const { return "int"; }
    std::string operator()(double*) const { return "float"; }
    std::string operator()(std::string*) const { return "str"; }
    std::string operator()(std::optional<std::string>*) const { return "str | None"; }
    std::string operator()(std::optional<int64_t>*) const { return "int | None"; }
    std::string operator()(std::optional<double>*) const { return "float | None"; }
    std::string operator()(StringList*) const { return "list[str]"; }
    std::string operator()(std::optional<std::vector<StringList>>*) const { return "list[list[str]] | None"; }
    std::string operator()(DatasetSources*) const { return "list[table]"; }
  };
  return std::visit(Visitor{}, value);
}

std::string KeySpec::value_string() const {
  struct Visitor {
    std::string operator()(bool* v) const { return *v ? "true" : "false"; }
    std::string operator()(int64_t* v) const { return std::to_string(*v); }
    std::string operator()(double* v) const { return number_string(*v); }
    std::string operator()(std::string* v) const { return quote(*v); }
    std::string operator()(std::optional<std::string>* v) const { return *v ? quote(**v) : "None"; }
    std::string operator()(std::optional<int64_t>* v) const { return *v ? std::to_string(**v) : "None"; }
    std::string operator()(std::optional<double>* v) const { return *v ? number_string(**v) : "None"; }
    std::string operator()(StringList* v) const { return list_string(*v); }
    std::string operator()(std::optional<std::vector<StringList>>* v) const {
      if (!*v) return "None";
      std::vector<std::string> inner;
      for (const auto& l : **v) inner.push_back(list_string(l));
      return "[" + join(inner, ", ") + "]";
    }
    std::string operator()(DatasetSources* v) const {
      std::vector<std::string> tables;
      for (const auto& d : *v)
        tables.push_back(cat("{name = ", quote(d.name), ", path = ", quote(d.path), ", format = ", quote(d.format),
                             ", weight = ", number_string(d.weight), ", text_field = ", quote(d.text_field),
                             ", loop = ", d.loop ? "true" : "false", "}"));
      return "[" + join(tables, ", ") + "]";
    }
  };
  return std::visit(Visitor{}, value);
}

std::vector<KeySpec> describe(JobConfig& c) {
  Builder b;

  auto add_dataloader = [&b](const char* section, DataLoader* dl) {
    b.in(section);
    at_least(b.add("num_workers", &dl->num_workers, "torchtitan's data-loader worker processes (accepted with a warning: titan prepares "
                                                     "batches on one background thread per rank, which outpaces training)"), 0);
    b.add("persistent_workers", &dl->persistent_workers, "keep workers alive between epochs (no workers here: no effect)");
    b.add("pin_memory", &dl->pin_memory, "pinned host memory for batches (on GPUs titan always pins them: no effect)");
    at_least(b.add("prefetch_factor", &dl->prefetch_factor, "batches each worker loads ahead (no workers here: see training.prefetch_batches)"), 1);
  };

  b.in("job");
  b.add("config_file", &c.job.config_file, "TOML file to read the job config from");
  b.add("dump_folder", &c.job.dump_folder, "folder for all job outputs (checkpoints, traces, tokenizer caches)");
  b.add("description", &c.job.description, "free-text description of the job, printed at start");
  b.add("print_config", &c.job.print_config, "print the resolved config as JSON at start");
  b.add("save_config_file", &c.job.save_config_file, "file name under dump_folder to save the resolved config as JSON");
  b.add("custom_config_module", &c.job.custom_config_module, "torchtitan Python config extension (accepted, unused by titan.cpp)");

  b.in("profiling");
  b.add("enable_profiling", &c.profiling.enable_profiling, "record profiler traces");
  b.add("save_traces_folder", &c.profiling.save_traces_folder, "folder under dump_folder for profiler traces");
  at_least(b.add("profile_freq", &c.profiling.profile_freq, "steps between profiler trace captures"), 1);
  at_least(b.add("profiler_active", &c.profiling.profiler_active, "steps the profiler records in each cycle"), 1);
  at_least(b.add("profiler_warmup", &c.profiling.profiler_warmup, "warm-up steps before each recorded profiler cycle"), 0);
  b.add("enable_memory_snapshot", &c.profiling.enable_memory_snapshot, "dump allocator memory snapshots");
  b.add("save_memory_snapshot_folder", &c.profiling.save_memory_snapshot_folder, "folder under dump_folder for memory snapshots");

  b.in("metrics");
  at_least(b.add("log_freq", &c.metrics.log_freq, "steps between metric log lines (step 1 is always logged)"), 1);
  b.add("enable_tensorboard", &c.metrics.enable_tensorboard, "write TensorBoard event files");
  b.add("disable_color_printing", &c.metrics.disable_color_printing, "print log lines without ANSI colors");
  b.add("save_tb_folder", &c.metrics.save_tb_folder, "folder under dump_folder for TensorBoard files");
  b.add("save_for_all_ranks", &c.metrics.save_for_all_ranks, "write metrics (TensorBoard, JSONL) on every rank into rank_R folders / metrics_rank_R.jsonl, not only rank 0");
  b.add("enable_wandb", &c.metrics.enable_wandb, "write a Weights & Biases offline run beside the TensorBoard files (`wandb sync` uploads it)");
  b.add("enable_jsonl", &c.metrics.enable_jsonl,
        "titan.cpp: append every logged step's metrics (torchtitan's TensorBoard keys) to {dump_folder}/metrics.jsonl");

  b.in("model");
  b.add("name", &c.model.name, "model family to train");
  b.add("flavor", &c.model.flavor, "model size within the family (debugmodel, 1B, 3B, 8B, 70B, 405B, ...; hf: the shape of the Hugging Face config.json loaded by checkpoint.initial_load_in_hf)");
  b.add("hf_assets_path", &c.model.hf_assets_path,
        "directory with tokenizer.json or tokenizer.model (or a tokenizer file); \"builtin\" trains a small BPE on the built-in corpus");
  b.add("tokenizer_path", &c.model.tokenizer_path, "deprecated alias of hf_assets_path");
  choices(b.add("attn_mask_type", &c.model.attn_mask_type,
                "causal, or block_causal: tokens attend only within their own document (torchtitan model arg)"),
          {"causal", "block_causal"});
  b.add("converters", &c.model.converters, "model converters to apply, comma-separated (e.g. float8)");
  b.add("print_after_conversion", &c.model.print_after_conversion, "print the model structure after converters ran");
  // titan.cpp: the model's shape key by key, over the flavor's (docs/configuration.md, "Model shape").
  positive(b.add("dim", &c.model.dim, "titan.cpp: model width (HF hidden_size); replaces the flavor's"));
  positive(b.add("n_layers", &c.model.n_layers, "titan.cpp: transformer blocks (HF num_hidden_layers)"));
  positive(b.add("n_heads", &c.model.n_heads, "titan.cpp: attention heads (HF num_attention_heads)"));
  positive(b.add("n_kv_heads", &c.model.n_kv_heads, "titan.cpp: key/value heads for grouped-query attention (HF num_key_value_heads)"));
  positive(b.add("head_dim", &c.model.head_dim, "titan.cpp: width of each attention head (default: the flavor's, else dim / n_heads)"));
  positive(b.add("vocab_size", &c.model.vocab_size, "titan.cpp: embedding and output rows"));
  positive(b.add("multiple_of", &c.model.multiple_of, "titan.cpp: the feed-forward width is rounded up to a multiple of this"));
  positive(b.add("ffn_dim_multiplier", &c.model.ffn_dim_multiplier, "titan.cpp: scales the feed-forward width int(8 * dim / 3)"));
  positive(b.add("hidden_dim", &c.model.hidden_dim,
                 "titan.cpp: the feed-forward width outright (HF intermediate_size), instead of multiple_of/ffn_dim_multiplier"));
  positive(b.add("norm_eps", &c.model.norm_eps, "titan.cpp: RMSNorm epsilon (HF rms_norm_eps)"));
  positive(b.add("rope_theta", &c.model.rope_theta, "titan.cpp: RoPE base frequency"));
  choices(b.add("rope_scaling", &c.model.rope_scaling,
                "titan.cpp: RoPE frequency scaling: llama3 (Llama 3.1), none, or the flavor's"),
          {"flavor", "llama3", "none"});
  positive(b.add("rope_scaling_factor", &c.model.rope_scaling_factor, "titan.cpp: llama3 RoPE scaling factor (8 for 3.1, 32 for 3.2)"));
  positive(b.add("rope_low_freq_factor", &c.model.rope_low_freq_factor, "titan.cpp: llama3 RoPE scaling low_freq_factor"));
  positive(b.add("rope_high_freq_factor", &c.model.rope_high_freq_factor, "titan.cpp: llama3 RoPE scaling high_freq_factor"));
  positive(b.add("rope_original_max_position_embeddings", &c.model.rope_original_max_position_embeddings,
                 "titan.cpp: llama3 RoPE scaling original_max_position_embeddings"));
  positive(b.add("moe_num_experts", &c.model.moe_num_experts, "titan.cpp: routed experts per block of a Mixture-of-Experts flavor"));
  positive(b.add("moe_top_k", &c.model.moe_top_k, "titan.cpp: experts each token is routed to (Mixture-of-Experts flavors)"));
  positive(b.add("moe_inter_dim", &c.model.moe_inter_dim, "titan.cpp: each expert's SwiGLU width (Mixture-of-Experts flavors)"));
  at_least(b.add("moe_load_balance_coeff", &c.model.moe_load_balance_coeff,
                 "titan.cpp: step of the MoE balancing bias after each optimizer step (torchtitan's 1e-3); 0 turns it off"), 0);
  at_least(b.add("n_dense_layers", &c.model.n_dense_layers,
                 "titan.cpp: dense blocks before the Mixture-of-Experts ones (DeepSeek-V3: HF first_k_dense_replace; Qwen3-MoE: HF mlp_only_layers [0..k-1])"), 0);
  at_least(b.add("q_lora_rank", &c.model.q_lora_rank,
                 "titan.cpp: latent attention (DeepSeek-V3): the queries' low-rank width, 0 for one projection"), 0);
  positive(b.add("kv_lora_rank", &c.model.kv_lora_rank, "titan.cpp: latent attention (DeepSeek-V3): the compressed key/value width"));
  at_least(b.add("qk_nope_head_dim", &c.model.qk_nope_head_dim,
                 "titan.cpp: latent attention (DeepSeek-V3): each head's query/key columns without RoPE"), 0);
  positive(b.add("qk_rope_head_dim", &c.model.qk_rope_head_dim,
                 "titan.cpp: latent attention (DeepSeek-V3): each head's rotary query/key columns (the key's shared by all heads)"));
  positive(b.add("v_head_dim", &c.model.v_head_dim, "titan.cpp: latent attention (DeepSeek-V3): each head's value width"));
  b.add("tie_word_embeddings", &c.model.tie_word_embeddings,
        "titan.cpp: share the embedding with the output projection; replaces the flavor's only when set");
  positive(b.add("max_seq_len", &c.model.max_seq_len,
                 "titan.cpp: longest sequence the model is for (HF max_position_embeddings); default training.seq_len"));

  b.in("optimizer");
  choices(b.add("name", &c.optimizer.name, "optimizer"), {"AdamW", "Adam"});
  positive(b.add("lr", &c.optimizer.lr, "peak learning rate"));
  between(b.add("beta1", &c.optimizer.beta1, "Adam first-moment decay"), 0, 1);
  between(b.add("beta2", &c.optimizer.beta2, "Adam second-moment decay"), 0, 1);
  positive(b.add("eps", &c.optimizer.eps, "Adam denominator epsilon"));
  at_least(b.add("weight_decay", &c.optimizer.weight_decay, "decoupled weight decay"), 0);
  choices(b.add("implementation", &c.optimizer.implementation, "optimizer kernels: fused, foreach or for-loop"),
          {"fused", "foreach", "for-loop"});
  b.add("early_step_in_backward", &c.optimizer.early_step_in_backward, "step the optimizer per parameter during backward");

  b.in("lr_scheduler");
  at_least(b.add("warmup_steps", &c.lr_scheduler.warmup_steps, "steps of linear warm-up ((step+1)/warmup_steps)"), 0);
  at_least(b.add("total_steps", &c.lr_scheduler.total_steps, "steps the schedule spans (default: training.steps)"), 1);
  between(b.add("decay_ratio", &c.lr_scheduler.decay_ratio, "share of steps spent decaying; the rest after warm-up is stable (WSD)"), 0, 1);
  choices(b.add("decay_type", &c.lr_scheduler.decay_type, "decay curve: linear, sqrt or cosine"), {"linear", "sqrt", "cosine"});
  between(b.add("min_lr_factor", &c.lr_scheduler.min_lr_factor, "final learning rate as a fraction of optimizer.lr"), 0, 1);

  b.in("training");
  b.add("dataset", &c.training.dataset, "dataset name; \"fortunes\" is the built-in corpus");
  b.add("dataset_path", &c.training.dataset_path, "a .txt or .jsonl file, or a directory of them; overrides the dataset's location");
  at_least(b.add("local_batch_size", &c.training.local_batch_size, "sequences per device per micro-batch"), 1);
  b.add("global_batch_size", &c.training.global_batch_size,
        "sequences per optimizer step over all ranks; -1 means local_batch_size x data-parallel degree")
      .also_allowed = {-1};
  b.keys.back().min = 1;
  at_least(b.add("seq_len", &c.training.seq_len, "tokens per sequence"), 1);
  positive(b.add("max_norm", &c.training.max_norm, "gradient clipping threshold on the total L2 norm"));
  at_least(b.add("steps", &c.training.steps, "optimizer steps to run"), 1);
  b.add("enable_cpu_offload", &c.training.enable_cpu_offload, "keep FSDP parameters, gradients and optimizer state on the CPU");
  choices(b.add("dtype", &c.training.dtype, "dtype of parameters, gradients and optimizer state"), {"float32", "bfloat16"});
  choices(b.add("mixed_precision_param", &c.training.mixed_precision_param,
                "compute dtype under mixed precision (autocast on one device or DDP, FSDP's param dtype)"),
          {"bfloat16", "float32"});
  choices(b.add("mixed_precision_reduce", &c.training.mixed_precision_reduce, "dtype of FSDP gradient reductions"), {"float32"});
  at_least(b.add("gc_freq", &c.training.gc_freq, "Python GC interval in torchtitan (accepted, no effect here)"), 1);
  b.add("gc_debug", &c.training.gc_debug, "Python GC debugging in torchtitan (accepted, no effect here)");
  add_dataloader("training.dataloader", &c.training.dataloader);
  b.in("training");
  b.add("datasets", &c.training.datasets,
        "a mixture: [[training.datasets]] tables {name, path, format, weight, text_field, loop}; on the command line "
        "a TOML array, e.g. '[{path=\"a.jsonl.zst\", weight=0.7}, {path=\"b/\", weight=0.3}]' (titan.cpp)");
  choices(b.add("dataset_format", &c.training.dataset_format, "format of training.dataset_path files (titan.cpp)"),
          {"auto", "text", "lines", "paragraphs", "jsonl", "fortune", "tokens", "parquet", "arrow"});
  b.add("text_field", &c.training.text_field, "JSONL/Parquet/Arrow field holding the text for training.dataset_path (titan.cpp)");
  at_least(b.add("data_seed", &c.training.data_seed, "seed of shard order, row shuffle and mixture draws; may change at a restart (titan.cpp)"), 0);
  at_least(b.add("shuffle_buffer", &c.training.shuffle_buffer, "rows per shuffled block; memory holds one block per source (titan.cpp)"), 0);
  b.add("shuffle_shards", &c.training.shuffle_shards, "visit each source's files in a seeded random order every epoch (titan.cpp)");
  at_least(b.add("data_lanes", &c.training.data_lanes,
                 "packing streams; batches are identical for any data-parallel degree dividing it (-1 = that degree) (titan.cpp)"), 1)
      .also_allowed = {-1};
  b.add("skip_malformed_rows", &c.training.skip_malformed_rows, "skip bad JSON lines/rows with a counted warning instead of failing (titan.cpp)");
  at_least(b.add("prefetch_batches", &c.training.prefetch_batches, "batches prepared ahead by the background data thread; 0 = none (titan.cpp)"), 0);
  at_least(b.add("skip_nonfinite_steps", &c.training.skip_nonfinite_steps,
                 "skip steps whose loss or gradient norm is NaN/inf (no update), up to this many in a row; 0 = stop at the first (titan.cpp)"), 0);
  b.add("fused_kernels", &c.training.fused_kernels,
        "titan's fused CPU kernels (attention, RMSNorm, SwiGLU, RoPE); false composes ATen ops instead (titan.cpp)");
  choices(b.add("autocast_weight_casts", &c.training.autocast_weight_casts,
                "under autocast, keep each weight's bf16 copy for the whole step (step) or cast again in every forward "
                "and recomputation (forward, LibTorch's behaviour) (titan.cpp)"),
          {"step", "forward"});

  b.in("parallelism");
  at_least(b.add("data_parallel_replicate_degree", &c.parallelism.data_parallel_replicate_degree,
                 "replicas of the weights (DDP, or HSDP with sharding)"), 1);
  b.add("data_parallel_shard_degree", &c.parallelism.data_parallel_shard_degree,
        "ranks the weights are sharded over (FSDP); -1 takes the ranks left over")
      .also_allowed = {-1};
  b.keys.back().min = 1;
  choices(b.add("fsdp_reshard_after_forward", &c.parallelism.fsdp_reshard_after_forward,
                "FSDP: free gathered parameters after forward: default, always or never"),
          {"default", "always", "never"});
  at_least(b.add("tensor_parallel_degree", &c.parallelism.tensor_parallel_degree, "tensor-parallel degree"), 1);
  b.add("disable_loss_parallel", &c.parallelism.disable_loss_parallel, "compute the loss on gathered logits under TP");
  b.add("enable_async_tensor_parallel", &c.parallelism.enable_async_tensor_parallel, "overlap TP communication with matmuls");
  at_least(b.add("pipeline_parallel_degree", &c.parallelism.pipeline_parallel_degree, "pipeline stages' ranks"), 1);
  b.add("module_fqns_per_model_part", &c.parallelism.module_fqns_per_model_part, "explicit module names of each pipeline stage");
  at_least(b.add("pipeline_parallel_first_stage_less_layers", &c.parallelism.pipeline_parallel_first_stage_less_layers,
                 "layers fewer on the first stage (it holds the embedding)"), 0);
  at_least(b.add("pipeline_parallel_last_stage_less_layers", &c.parallelism.pipeline_parallel_last_stage_less_layers,
                 "layers fewer on the last stage (it holds the output)"), 0);
  at_least(b.add("pipeline_parallel_layers_per_stage", &c.parallelism.pipeline_parallel_layers_per_stage,
                 "layers per virtual pipeline stage"), 1);
  b.add("pipeline_parallel_schedule", &c.parallelism.pipeline_parallel_schedule,
        "pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV");
  b.add("pipeline_parallel_schedule_csv", &c.parallelism.pipeline_parallel_schedule_csv, "CSV file describing a custom pipeline schedule");
  at_least(b.add("pipeline_parallel_microbatch_size", &c.parallelism.pipeline_parallel_microbatch_size,
                 "sequences per pipeline micro-batch"), 1);
  b.add("pipeline_parallel_expert_parallel_overlap", &c.parallelism.pipeline_parallel_expert_parallel_overlap,
        "overlap each DualPipeV forward/backward pair's EP communication with the other's computation; titan runs the pair "
        "one after the other (no effect here)");
  at_least(b.add("context_parallel_degree", &c.parallelism.context_parallel_degree, "context-parallel degree"), 1);
  b.add("context_parallel_load_balancer", &c.parallelism.context_parallel_load_balancer, "CP load balancer: headtail, ptrr or None");
  choices(b.add("context_parallel_rotate_method", &c.parallelism.context_parallel_rotate_method,
                "CP key/value exchange: allgather or alltoall"),
          {"allgather", "alltoall"});
  at_least(b.add("expert_parallel_degree", &c.parallelism.expert_parallel_degree, "expert-parallel degree (MoE only)"), 1);
  at_least(b.add("expert_tensor_parallel_degree", &c.parallelism.expert_tensor_parallel_degree, "TP degree inside experts (MoE only)"), 1);
  choices(b.add("expert_parallel_comm_backend", &c.parallelism.expert_parallel_comm_backend, "EP all-to-all backend"),
          {"standard", "deepep"});

  b.in("checkpoint");
  b.add("enable", &c.checkpoint.enable, "save and resume checkpoints");
  b.add("enable_ft_dataloader_checkpoints", &c.checkpoint.enable_ft_dataloader_checkpoints,
        "checkpoint dataloader state under fault tolerance (torchft, which titan refuses: no effect here)");
  b.add("folder", &c.checkpoint.folder, "checkpoint folder under dump_folder");
  at_least(b.add("interval", &c.checkpoint.interval, "steps between checkpoints"), 1);
  b.add("initial_load_path", &c.checkpoint.initial_load_path, "checkpoint to start from when the run's folder is empty");
  b.add("initial_load_model_only", &c.checkpoint.initial_load_model_only, "load only the model from initial_load_path");
  b.add("initial_load_in_hf", &c.checkpoint.initial_load_in_hf, "initial_load_path is a Hugging Face safetensors model");
  b.add("initial_load_in_hf_quantized", &c.checkpoint.initial_load_in_hf_quantized,
        "the HF initial checkpoint has float8 weights with block scales (DeepSeek-V3's); titan finds and dequantizes them "
        "whether or not this is set");
  b.add("last_save_model_only", &c.checkpoint.last_save_model_only, "the final save holds only the model");
  b.add("last_save_in_hf", &c.checkpoint.last_save_in_hf, "write the final save as Hugging Face safetensors");
  choices(b.add("export_dtype", &c.checkpoint.export_dtype, "dtype of a model-only final save"), {"float16", "bfloat16", "float32"});
  choices(b.add("async_mode", &c.checkpoint.async_mode, "checkpoint writing: disabled (synchronous), async or async_with_pinned_mem"),
          {"disabled", "async", "async_with_pinned_mem"});
  b.add("keep_latest_k", &c.checkpoint.keep_latest_k, "checkpoints to keep (0 keeps all; 1 is not allowed)").also_allowed = {0};
  b.keys.back().min = 2;
  b.add("load_step", &c.checkpoint.load_step, "step to resume from; -1 means the latest complete one").also_allowed = {-1};
  b.keys.back().min = 0;
  b.add("exclude_from_loading", &c.checkpoint.exclude_from_loading, "state parts not to load, comma-separated (optimizer,lr_scheduler,dataloader)");
  b.add("enable_first_step_checkpoint", &c.checkpoint.enable_first_step_checkpoint, "save right after step 1");
  b.add("create_seed_checkpoint", &c.checkpoint.create_seed_checkpoint, "write an initial checkpoint of the unsharded model and exit");
  b.add("load_only", &c.checkpoint.load_only, "load checkpoints but never save one (no interval, last or signal saves)");

  b.in("activation_checkpoint");
  choices(b.add("mode", &c.activation_checkpoint.mode, "activation checkpointing: none, selective, full or memory_budget"),
          {"selective", "full", "memory_budget", "none"});
  b.add("selective_ac_option", &c.activation_checkpoint.selective_ac_option,
        "selective mode: an integer N checkpoints every N-th block; \"op\" keeps attention's and every other linear's "
        "outputs and recomputes the rest (torchtitan's policy)");
  b.add("per_op_sac_force_recompute_mm_shapes_by_fqns", &c.activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns,
        "linears (by name substring) that op-level AC always recomputes, uncounted: the MoE router's gate");
  b.add("early_stop", &c.activation_checkpoint.early_stop, "stop recomputation early (PyTorch non-reentrant checkpoint option; no effect here)");
  between(b.add("memory_budget", &c.activation_checkpoint.memory_budget, "memory_budget mode's compute/memory trade-off"), 0, 1);
  b.add("visualize_memory_budget_pareto", &c.activation_checkpoint.visualize_memory_budget_pareto, "plot the memory budget trade-off");
  b.add("preserve_rng_state", &c.activation_checkpoint.preserve_rng_state, "replay RNG state during recomputation (Llama has no random ops: no effect)");
  b.add("determinism_check", &c.activation_checkpoint.determinism_check, "PyTorch checkpoint determinism check (no effect here)");
  b.add("debug", &c.activation_checkpoint.debug, "PyTorch checkpoint debug output (no effect here)");

  b.in("compile");
  b.add("enable", &c.compile.enable, "compile the model and loss (torch.compile)");
  b.add("components", &c.compile.components, "what to compile: model, loss");
  b.add("backend", &c.compile.backend, "compiler backend (no compiler in titan.cpp)");

  b.in("quantize.linear.float8");
  b.add("enable_fsdp_float8_all_gather", &c.quantize.linear.float8.enable_fsdp_float8_all_gather, "all-gather float8 weights under FSDP");
  b.add("precompute_float8_dynamic_scale_for_fsdp", &c.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp,
        "precompute float8 scales for FSDP");
  b.add("recipe_name", &c.quantize.linear.float8.recipe_name, "float8 recipe: tensorwise, rowwise or rowwise_with_gw_hp");
  b.add("filter_fqns", &c.quantize.linear.float8.filter_fqns, "linear layers to keep in high precision");
  b.add("emulate", &c.quantize.linear.float8.emulate, "emulate float8 matmuls (testing)");

  b.in("quantize.linear.mx");
  choices(b.add("mxfp8_dim1_cast_kernel_choice", &c.quantize.linear.mx.mxfp8_dim1_cast_kernel_choice,
                "torchao's kernel for the MX casts (titan casts with its own ATen code: no effect here)"),
          {"triton", "cuda", "torch"});
  b.add("recipe_name", &c.quantize.linear.mx.recipe_name, "MX recipe");
  b.add("filter_fqns", &c.quantize.linear.mx.filter_fqns, "linear layers to keep in high precision");
  b.add("emulate", &c.quantize.linear.mx.emulate, "emulate MX matmuls (titan's key; any device)");

  b.in("quantize.grouped_mm.float8");
  b.add("fqns", &c.quantize.grouped_mm.float8.fqns, "MoE layers with float8 grouped matmuls");

  b.in("quantize.grouped_mm.mx");
  choices(b.add("recipe_name", &c.quantize.grouped_mm.mx.recipe_name, "MX grouped-matmul recipe"), {"mxfp8"});
  b.add("fqns", &c.quantize.grouped_mm.mx.fqns, "MoE layers with MX grouped matmuls");

  b.in("comm");
  positive(b.add("init_timeout_seconds", &c.comm.init_timeout_seconds, "collective timeout during start-up and the first step"));
  positive(b.add("train_timeout_seconds", &c.comm.train_timeout_seconds, "collective timeout after the first step"));
  at_least(b.add("trace_buf_size", &c.comm.trace_buf_size, "NCCL flight-recorder entries in torchtitan (no effect here: titan names a "
                                                           "stuck collective itself, comm.train_timeout_seconds)"), 0);
  b.add("save_traces_folder", &c.comm.save_traces_folder, "flight-recorder dump folder (no effect here, as trace_buf_size)");
  b.add("save_traces_file_prefix", &c.comm.save_traces_file_prefix, "flight-recorder file prefix (no effect here, as trace_buf_size)");
  choices(b.add("mode", &c.comm.mode, "communication mode: default; fake_backend (a dry run: one process plays rank RANK of NGPU, no communication); "
                                         "local_tensor (not supported yet)"),
          {"default", "fake_backend", "local_tensor"});

  b.in("memory_estimation");
  b.add("enable", &c.memory_estimation.enable, "estimate FSDP memory use before training");
  b.add("disable_fake_mode", &c.memory_estimation.disable_fake_mode, "estimate with real tensors");

  b.in("fault_tolerance");
  b.add("enable", &c.fault_tolerance.enable, "fault-tolerant training (TorchFT)");
  choices(b.add("process_group", &c.fault_tolerance.process_group, "fault-tolerance process group"), {"gloo", "nccl"});
  positive(b.add("process_group_timeout_ms", &c.fault_tolerance.process_group_timeout_ms, "fault-tolerance timeout"));
  at_least(b.add("replica_id", &c.fault_tolerance.replica_id, "this replica's id"), 0);
  at_least(b.add("group_size", &c.fault_tolerance.group_size, "number of replica groups"), 0);
  at_least(b.add("min_replica_size", &c.fault_tolerance.min_replica_size, "minimum replicas per step"), 1);
  b.add("semi_sync_method", &c.fault_tolerance.semi_sync_method, "semi-synchronous method: local_sgd or diloco");

  b.in("experimental");
  b.add("custom_import", &c.experimental.custom_import, "torchtitan Python module import (accepted, unused by titan.cpp)");
  b.add("custom_args_module", &c.experimental.custom_args_module, "deprecated alias of job.custom_config_module");

  b.in("validation");
  b.add("enable", &c.validation.enable, "run validation during training");
  b.add("dataset", &c.validation.dataset, "validation dataset name");
  b.add("dataset_path", &c.validation.dataset_path, "validation data file or directory");
  choices(b.add("dataset_format", &c.validation.dataset_format, "format of validation.dataset_path files, as training.dataset_format (titan.cpp)"),
          {"auto", "text", "lines", "paragraphs", "jsonl", "fortune", "tokens", "parquet", "arrow"});
  at_least(b.add("local_batch_size", &c.validation.local_batch_size, "validation sequences per device"), 1);
  at_least(b.add("seq_len", &c.validation.seq_len, "validation sequence length"), 1);
  at_least(b.add("freq", &c.validation.freq, "steps between validations"), 1);
  at_least(b.add("steps", &c.validation.steps, "validation batches per run; -1 consumes the whole set"), 1).also_allowed = {-1};
  b.keys.back().min = 1;
  add_dataloader("validation.dataloader", &c.validation.dataloader);

  b.in("debug");
  b.add("seed", &c.debug.seed, "base random seed (None: a fresh seed each run)");
  b.add("deterministic", &c.debug.deterministic, "use deterministic kernels only (may be slower)");
  b.add("deterministic_warn_only", &c.debug.deterministic_warn_only, "warn instead of failing on non-deterministic kernels");
  b.add("skip_memory_check", &c.debug.skip_memory_check,
        "titan.cpp: start even when the estimated memory of a rank exceeds the memory available to it");
  b.add("pipeline_timeline", &c.debug.pipeline_timeline,
        "titan.cpp: record each pipeline action's start and end per rank under {dump_folder}/pipeline_timeline/");
  b.add("moe_force_load_balance", &c.debug.moe_force_load_balance, "round-robin tokens over experts (MoE debugging)");

  return std::move(b.keys);
}

std::vector<std::string> section_names() {
  JobConfig scratch;
  std::set<std::string> names;
  for (const auto& key : describe(scratch)) {
    std::string path;
    for (const auto& part : split(key.section, '.')) {
      path = path.empty() ? part : path + "." + part;
      names.insert(path);
    }
  }
  return {names.begin(), names.end()};
}

}  // namespace titan::config
