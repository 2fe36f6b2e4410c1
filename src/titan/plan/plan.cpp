#include "titan/plan/plan.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/config/loader.h"
#include "titan/config/support.h"
#include "titan/distributed/pipeline/schedule.h"
#include "titan/distributed/pipeline/stages.h"

namespace titan::plan {

namespace {

// The CUDA/HIP context, kernels' modules and NCCL's buffers, which the allocator does not count.
constexpr double kContextBytes = 1.5e9;

std::string layout_of(const distributed::ParallelDims& dims, const config::JobConfig& c) {
  std::vector<std::string> parts;
  auto add = [&](const char* name, int64_t v) {
    if (v > 1) parts.push_back(cat(name, " ", v));
  };
  add("dp_replicate", dims.dp_replicate);
  add("dp_shard", dims.dp_shard);
  add("cp", dims.cp);
  add("tp", dims.tp);
  add("pp", dims.pp);
  add("ep", dims.ep);
  if (dims.ep > 1 && dims.tp > 1) add("etp", dims.etp);
  std::string out = parts.empty() ? "1 rank" : join(parts, " x ");
  const auto& ac = c.activation_checkpoint;
  out += ac.mode == "none" ? ", no AC" : ac.mode == "full" ? ", full AC" : cat(", selective AC ", ac.selective_ac_option);
  out += cat(", local batch ", c.training.local_batch_size);
  if (dims.pp > 1)
    out += cat(", micro-batch ", c.parallelism.pipeline_parallel_microbatch_size, ", ", c.parallelism.pipeline_parallel_schedule);
  return out;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) out.push_back(i);
  return out;
}

}  // namespace

Plan make_plan(const protocols::ModelSpec& spec, const protocols::ModelArgs& args, const config::JobConfig& config,
               const distributed::ParallelDims& dims, const ClusterProfile& cluster, protocols::Execution execution,
               bool per_pipeline_rank) {
  // What the trainer checks before it builds anything (divisibility of heads, widths, experts and sequence by the
  // degrees, float8 under TP, the global batch): a layout it refuses is no plan (UserError naming the key).
  spec.check_parallelism(args, dims, config);
  const int64_t per_step = config.training.local_batch_size * dims.dp_degree();
  if (config.training.global_batch_size > 0 && config.training.global_batch_size % per_step != 0)
    fail("training.global_batch_size = ", config.training.global_batch_size,
         " must be a multiple of training.local_batch_size x data-parallel degree = ", per_step);
  Plan plan;
  plan.dims = dims;
  plan.layout = layout_of(dims, config);
  const bool autocast = protocols::computes_under_autocast(config, dims);
  // On NVIDIA GPUs titan runs its CUDA kernels (SwiGLU, RoPE, the loss's row passes), which save less for backward.
  const protocols::FusedKernels kernels = cluster.vendor == "nvidia" ? protocols::FusedKernels::cuda : protocols::FusedKernels::none;
  const auto allocator = protocols::Allocator::device_caching;
  plan.memory = spec.estimate_memory(args, config, dims, autocast, 0, execution, -1, kernels, allocator);
  plan.reserved_bytes = plan.memory.total() * (1 + cluster.calibration.allocator_overhead);
  plan.device_bytes = plan.reserved_bytes + kContextBytes;
  plan.fits = plan.device_bytes <= cluster.memory_bytes;
  if (dims.pp > 1 && per_pipeline_rank) {
    const auto estimate = [&](int64_t rank) {
      return spec.estimate_memory(args, config, dims, autocast, 0, execution, rank, kernels, allocator);
    };
    // The ends: rank 0 (the embedding) and the last rank (the output and the loss), or under the V schedules
    // (ZBVZeroBubble, DualPipeV) rank 0 alone, which holds the first stage and the last. Of the ranks between, the
    // one with the largest estimate: more blocks or more micro-batches in flight (1F1B's rank 1 holds one fewer
    // than rank 0 but may have a block more, the embedding counting as pipeline_parallel_first_stage_less_layers).
    const bool v_shape = distributed::pipeline::schedule_traits(config.parallelism.pipeline_parallel_schedule).v_shape;
    plan.pipeline_ranks.push_back({v_shape ? "first_and_last" : "first", 0, estimate(0)});
    const int64_t middle_end = v_shape ? dims.pp : dims.pp - 1;
    std::optional<Plan::PipelineRank> middle;
    for (int64_t r = 1; r < middle_end; ++r) {
      protocols::MemoryEstimate m = estimate(r);
      if (!middle || m.total() > middle->memory.total()) middle = Plan::PipelineRank{"middle", r, std::move(m)};
    }
    if (middle) plan.pipeline_ranks.push_back(std::move(*middle));
    if (!v_shape) plan.pipeline_ranks.push_back({"last", dims.pp - 1, estimate(dims.pp - 1)});
  }
  plan.time = estimate_step_time(models::as_decoder(args, "titan plan's step-time model"), config, dims, cluster, execution);
  const Speedups s = speedups_of(config);
  // Float8 linears (every recipe, under every parallelism) and their FSDP all-gathers run (docs/float8.md).
  static const std::string compile = "torch.compile (compile.enable)",
                           block_causal_cp = "block-causal masks under context parallelism on GPUs (they run on CPUs)";
  if (s.compile) plan.not_runnable.push_back(compile);
  if (dims.cp > 1 && config.model.attn_mask_type == "block_causal") plan.not_runnable.push_back(block_causal_cp);
  return plan;
}

SearchResult search_layouts(const protocols::ModelSpec& spec, const protocols::ModelArgs& args, const config::JobConfig& base,
                            const ClusterProfile& cluster, const SearchOptions& options) {
  const models::DecoderArgs& decoder = models::as_decoder(args, "titan plan --search");
  const int64_t gpus = options.gpus;
  if (gpus < 1) fail("titan plan --search needs --gpus N (the number of GPUs to lay the job out on)");
  const int64_t global = base.training.global_batch_size;
  if (global < 1)
    fail("titan plan --search needs --training.global_batch_size (sequences per step): the layouts divide it among the data-parallel ranks");
  SearchResult result;
  std::vector<Plan> plans;
  std::map<std::tuple<std::string, int64_t, int64_t, int64_t>, bool> pipeline_ok;
  const std::vector<std::pair<std::string, std::string>> ac_modes = {{"none", ""}, {"selective", "op"}, {"selective", "2"}, {"full", ""}};
  for (int64_t tp : divisors(gpus)) {
    if (tp > cluster.gpus_per_node || decoder.n_heads % tp || decoder.kv_heads() % tp) continue;
    for (int64_t pp : divisors(gpus / tp)) {
      if (pp > 1 && decoder.n_layers / pp < 1) continue;
      if (pp > 1 && base.optimizer.early_step_in_backward) continue;  // the trainer refuses the two together
      for (int64_t cp : divisors(gpus / tp / pp)) {
        if (cp > 1 && base.training.seq_len % (2 * cp)) continue;
        const int64_t dp = gpus / tp / pp / cp;
        if (global % dp) continue;
        for (int64_t replicate : divisors(dp)) {
          const int64_t shard = dp / replicate;
          const int64_t local = global / dp;  // no gradient accumulation: every sequence of the step at once
          std::vector<std::pair<std::string, int64_t>> pipelines = {{"", 0}};
          if (pp > 1) {
            pipelines.clear();
            for (const std::string schedule : {"1F1B", "Interleaved1F1B", "ZBVZeroBubble"})
              for (int64_t micro : divisors(local)) pipelines.push_back({schedule, micro});
          }
          // MoE models: every expert-parallel degree that divides the experts and the ranks it borrows (dp_shard x
          // cp, x tp with ETP 1), with ETP 1 or TP; dense models keep the base's (1).
          std::vector<std::pair<int64_t, int64_t>> experts = {{base.parallelism.expert_parallel_degree,
                                                               base.parallelism.expert_tensor_parallel_degree}};
          if (decoder.moe) {
            experts.clear();
            for (int64_t etp : tp > 1 ? std::vector<int64_t>{1, tp} : std::vector<int64_t>{1})
              for (int64_t ep : divisors(shard * cp * (etp == 1 ? tp : 1)))
                if (decoder.moe->num_experts % ep == 0 && (ep > 1 || etp == 1)) experts.push_back({ep, etp});
          }
          for (const auto& [mode, option] : ac_modes)
            for (const auto& [schedule, micro] : pipelines)
              for (const auto& [ep, etp] : experts) {
                config::JobConfig c = base;
                c.parallelism.expert_parallel_degree = ep;
                c.parallelism.expert_tensor_parallel_degree = etp;
                c.parallelism.tensor_parallel_degree = tp;
                c.parallelism.pipeline_parallel_degree = pp;
                c.parallelism.context_parallel_degree = cp;
                c.parallelism.data_parallel_replicate_degree = replicate;
                c.parallelism.data_parallel_shard_degree = shard;
                c.training.local_batch_size = local;
                c.activation_checkpoint.mode = mode;
                if (!option.empty()) c.activation_checkpoint.selective_ac_option = option;
                if (pp > 1) {
                  c.parallelism.pipeline_parallel_schedule = schedule;
                  c.parallelism.pipeline_parallel_microbatch_size = micro;
                }
                ++result.tried;
                try {
                  if (pp > 1) {
                    // The stages and schedule as the trainer would build them (checked once per combination).
                    const auto key = std::make_tuple(schedule, pp, micro, local);
                    auto it = pipeline_ok.find(key);
                    if (it == pipeline_ok.end()) {
                      bool ok = true;
                      try {
                        distributed::pipeline::plan_stages(args.layers(), spec.tied_embeddings(args), c, pp);
                      } catch (const UserError&) {
                        ok = false;
                      }
                      it = pipeline_ok.emplace(key, ok).first;
                    }
                    if (!it->second) continue;
                  }
                  auto dims = distributed::ParallelDims::from_config(c.parallelism, gpus);
                  Plan plan = make_plan(spec, args, c, dims, cluster, options.execution, false);
                  if (!plan.fits) continue;
                  ++result.fitting;
                  plans.push_back(std::move(plan));
                } catch (const UserError&) {
                  // a schedule that cannot run this many micro-batches on this many stages
                }
              }
        }
      }
    }
  }
  std::sort(plans.begin(), plans.end(), [](const Plan& x, const Plan& y) {
    return x.time.tokens_per_second_per_device > y.time.tokens_per_second_per_device;
  });
  if (static_cast<int64_t>(plans.size()) > options.top) plans.resize(static_cast<size_t>(options.top));
  result.best = std::move(plans);
  return result;
}

}  // namespace titan::plan
