#include "titan/models/common/decoder_memory.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "titan/common/error.h"
#include "titan/config/dtypes.h"
#include "titan/common/strings.h"
#include "titan/distributed/loss_parallel.h"
#include "titan/distributed/pipeline/schedule.h"
#include "titan/distributed/pipeline/stages.h"
#include "titan/nn/matmul.h"

namespace titan::models {

namespace {

// Per token of one block: what its attention saves for backward beyond the residual stream (counted by the caller),
// under titan's fused CPU kernels (`fused`) or its CUDA ones (`cuda`), split over `t` tensor-parallel ranks where
// the heads are. Autocast's compute-dtype copies of the normalised input are counted here for each projection that
// reads it.
double attention_saved(const DecoderArgs& a, double c, bool autocast, bool fused, bool cuda, double t) {
  const double d = static_cast<double>(a.dim), heads = static_cast<double>(a.n_heads);
  if (a.mla) {
    // Multi-head latent attention (LatentAttention::forward): the attention core's q, k and zero-padded v and its
    // output, all `w` = heads x (nope + rope) wide, split over TP by heads; the output's value columns copied for wo;
    // the log-sum-exp per head. Unsplit under TP (wq_a, wkv_a and their norms run whole on every rank): the
    // down-projected kv (latent + shared rotary key) kept by kv_norm and kv_norm's output kept by wkv_b; with
    // low-rank queries wq_a's output and q_norm's. Its RoPE (rope_reference) keeps only the angle table, and wkv_b's
    // expanded output and the pre-RoPE queries die within the forward. The fused and the ATen attention keep the same.
    const auto& m = *a.mla;
    const double w = heads * static_cast<double>(m.qk_head_dim()), value = heads * static_cast<double>(m.v_head_dim);
    const double latent = static_cast<double>(m.kv_lora_rank), rope = static_cast<double>(m.qk_rope_head_dim);
    const double low_rank = static_cast<double>(m.q_lora_rank);
    double saved = (4 * w + value) * c / t + heads / t * 4 + (2 * latent + rope) * c + 2 * low_rank * c;
    if (autocast) saved += 2 * d * c;  // the normalised input cast for wq (or wq_a) and wkv_a
    return saved;
  }
  // Grouped-query attention (Attention::forward): q (the query width: dim for Llama 3; heads x head_dim for Qwen3),
  // k and v (the key width), RoPE's float32 view of q and k, the attention output and its contiguous copy, the
  // log-sum-exp per head; Qwen3's q/k norms keep their inputs beside the rotated q and k. titan's fused CPU kernels
  // keep neither RoPE's float32 view nor a second copy of the output; its CUDA ones keep no float32 view.
  const double q = static_cast<double>(a.n_heads * a.head_dim()), k = static_cast<double>(a.kv_heads() * a.head_dim());
  double saved = (q + k) * 4 + (q + 2 * k) * c + 2 * q * c + heads * 4;
  if (a.qk_norm) saved += (q + k) * c;
  if (fused) saved -= (q + k) * 4 + q * c;
  if (cuda) saved -= (q + k) * 4;
  if (autocast) saved += 3 * d * c;  // the normalised input cast for wq, wk and wv
  return saved / t;
}

// Bytes one block saves for backward per token, counted from what titan's block keeps alive (decoder.cpp): the
// residual stream in the parameter dtype `r` (block input, both norms' normalised outputs, the attention residual);
// the attention's share (above); the feed-forward's w1 and w3 outputs, the SiLU output and the product (4 x hidden in
// `c`), and under autocast the compute-dtype copies of the normalised input w1 and w3 save. titan's fused CPU and
// CUDA kernels keep no SiLU output. `moe_block`: the block's feed-forward is the Mixture of Experts (a model's
// blocks differ where DeepSeek-V3's dense blocks come first).
struct BlockActivations {
  double full = 0;         // no checkpointing
  double input_only = 0;   // a checkpointed block keeps its input only
  double backward_buffers = 0;  // what a block's backward allocates beside what it saved
};

BlockActivations block_activations(const DecoderArgs& a, bool moe_block, double r, double c, bool autocast, int64_t tp,
                                   FusedKernels kernels, bool experts_local, bool weights_deferred) {
  const bool fused = kernels == FusedKernels::cpu, cuda = kernels == FusedKernels::cuda;
  const double d = static_cast<double>(a.dim), t = static_cast<double>(tp);
  const double h = static_cast<double>(moe_block ? (a.moe->top_k + a.moe->num_shared_experts) * a.moe->hidden_dim : a.ffn_hidden_dim());
  double sharded = 4 * d * r + 4 * h * c;
  if (moe_block) {
    // A Mixture-of-Experts block: `h` above counts the routed experts' SwiGLU for each of a token's top_k copies
    // (and the shared experts'); beside them the router's float32 scores, what the gate and up products keep of
    // their input, and what the combination keeps: the experts' outputs in the compute dtype for the weighted sum, or
    // with the scores applied before the experts the float32 copies they scale (MoE::forward; measured:
    // docs/moe.md). The gate and up products keep the copies sorted by expert in the compute dtype (one for both,
    // also under autocast) where the tokens are dispatched (expert parallelism) or scaled first; otherwise the
    // block's input once, which without autocast is the normalised input counted above and under autocast a copy of
    // it in the compute dtype.
    const double experts = static_cast<double>(a.moe->num_experts), top_k = static_cast<double>(a.moe->top_k);
    const double combine = a.moe->score_before_experts ? 4 : c;
    const bool gathered_in_backward = experts_local && !a.moe->score_before_experts;
    sharded += 2 * experts * 4 + top_k * d * ((gathered_in_backward ? 0 : c) + combine) + (gathered_in_backward && autocast ? d * c : 0);
  }
  double gathered = 0;  // under sequence parallelism the attention and feed-forward inputs are gathered whole
  if (autocast) sharded += 2 * d * c;
  // Fused kernels: no SiLU output; and under autocast the norms' float32 outputs die as soon as the linears have
  // their bf16 copies (measured: docs/metrics.md). (Under tensor parallelism the measured peak keeps them: 0.83x
  // without them at TP 2.) The CUDA kernels save their inputs only (not measured on a GPU yet).
  if (fused) sharded -= h * c + (autocast && tp == 1 ? 2 * d * r : 0);
  if (cuda) sharded -= h * c;
  if (tp > 1) gathered = 2 * d * c;
  BlockActivations out;
  out.full = sharded / t + attention_saved(a, c, autocast, fused, cuda, t) + gathered;
  if (weights_deferred && autocast) {
    // Zero-bubble schedules' deferrable linears (distributed/pipeline/zero_bubble.cpp) save the normalised input
    // they are given, in the residual dtype, instead of autocast's compute-dtype copy: the copies of attention's
    // linears and of a dense feed-forward's or a MoE block's shared experts' w1 and w3 are not kept. Without TP,
    // under the fused kernels, the norms' outputs they read stay alive instead; under TP the gathered streams stay
    // in the residual dtype (a MoE block's routed experts keep their own gathered copy).
    const bool shared_experts = moe_block && a.moe->num_shared_experts > 0;
    const double ffn_linears = !moe_block || shared_experts ? 2 : 0;
    const double streams = 1 + (ffn_linears > 0 ? 1 : 0);
    out.full -= (a.mla ? 2 * d * c : 3 * d * c / t) + ffn_linears * d * c / t;  // as attention_saved and `sharded` count them
    if (tp > 1) out.full += streams * d * r - (moe_block ? 1 : 2) * d * c;
    else if (fused) out.full += streams * d * r;
  }
  // The fused kernels' backward allocates less beside what they saved, but with the loss fused (no logits held
  // through the blocks' backward) the measured peak of the fused path sits in the blocks' backward: about what
  // the block saved (debug model, full AC, 4 x 2048: 0.66x with half of it).
  out.backward_buffers = out.full;
  out.input_only = d * r / t;
  return out;
}

// Zero-bubble schedules: per token of one block, what an input-gradient step leaves for its weight step
// (distributed/pipeline/zero_bubble.cpp): each deferred linear's input and its output's gradient, in the compute
// dtype but for the normalised streams, kept as given: in the residual dtype, whole under tensor parallelism (a
// sequence-parallel stream is gathered before the cast; autocast casts inside the linear). A Mixture-of-Experts
// block's routed experts compute their weight gradients at once. `inputs` false: the output gradients only
// (torch.distributed.pipelining keeps the inputs in the retained graph, counted with the activations).
double deferred_per_token(const DecoderArgs& a, bool moe_block, double r, double c, int64_t tp, bool inputs) {
  using Split = BlockLinear::Split;
  using Input = BlockLinear::Input;
  const double t = static_cast<double>(tp);
  double bytes = 0;
  for (const auto& l : block_linears(a, moe_block)) {
    bytes += l.out / (l.split == Split::column ? t : 1.0) * c;
    if (!inputs) continue;
    if (l.input == Input::stream) bytes += l.in * r;
    else if (l.input == Input::own) bytes += l.in / (l.split == Split::row ? t : 1.0) * c;
  }
  return bytes;
}

}  // namespace

std::vector<BlockLinear> block_linears(const DecoderArgs& a, bool moe_block) {
  using Split = BlockLinear::Split;
  using Input = BlockLinear::Input;
  const double d = static_cast<double>(a.dim), heads = static_cast<double>(a.n_heads);
  std::vector<BlockLinear> out;
  if (a.mla) {
    const auto& m = *a.mla;
    const double w = heads * static_cast<double>(m.qk_head_dim()), latent = static_cast<double>(m.kv_lora_rank);
    const double kv_a = latent + static_cast<double>(m.qk_rope_head_dim);
    if (m.q_lora_rank > 0) {
      const double low_rank = static_cast<double>(m.q_lora_rank);
      out.push_back({d, low_rank, Split::none, Input::stream});  // wq_a
      out.push_back({low_rank, w, Split::column});                // wq_b
      out.push_back({d, kv_a, Split::none, Input::shared});       // wkv_a (reads wq_a's input)
    } else {
      out.push_back({d, w, Split::column, Input::stream});  // wq
      out.push_back({d, kv_a, Split::none, Input::shared});  // wkv_a
    }
    out.push_back({latent, heads * static_cast<double>(m.qk_nope_head_dim + m.v_head_dim), Split::column});  // wkv_b
    out.push_back({heads * static_cast<double>(m.v_head_dim), d, Split::row});                               // wo
  } else {
    const double q = static_cast<double>(a.n_heads * a.head_dim()), k = static_cast<double>(a.kv_heads() * a.head_dim());
    out.insert(out.end(), {{d, q, Split::column, Input::stream}, {d, k, Split::column, Input::shared},
                           {d, k, Split::column, Input::shared}, {q, d, Split::row}});
  }
  const double h = moe_block ? static_cast<double>(a.moe->num_shared_experts * a.moe->hidden_dim) : static_cast<double>(a.ffn_hidden_dim());
  if (h > 0)  // w1, w3, w2
    out.insert(out.end(), {{d, h, Split::column, Input::stream}, {d, h, Split::column, Input::shared}, {h, d, Split::row}});
  return out;
}

namespace {

// What op-level selective checkpointing keeps of a block per token (nn/kept_ops.h, torchtitan's policy): the
// block's input, attention's output and float32 log-sum-exp, and the outputs of every other linear in forward
// order (the 1st, 3rd, ...), counted without the router's gate (float8 and MX linears count as the others). Under
// TP a column-parallel output is split; a row-parallel one (wo, w2) is each rank's whole partial sum before its
// reduce-scatter, and latent attention's wq_a and wkv_a run whole. torchtitan keeps the
// reduce-scatters' outputs too.
double op_kept_per_token(const DecoderArgs& a, bool moe_block, double r, double c, int64_t tp, Execution execution) {
  const double d = static_cast<double>(a.dim), t = static_cast<double>(tp), heads = static_cast<double>(a.n_heads);
  // The attention core's output: the query width (latent attention's values are padded to it).
  double kept = d * r / t + static_cast<double>(a.n_heads * a.head_dim()) / t * c + heads / t * 4;
  const auto linears = block_linears(a, moe_block);
  for (size_t i = 0; i < linears.size(); i += 2) kept += linears[i].out / (linears[i].split == BlockLinear::Split::column ? t : 1.0) * c;
  if (execution == Execution::torchtitan && tp > 1) kept += 2 * d / t * c;
  return kept;
}

// The blocks a rank runs, by kind: every block, or under pipeline parallelism its stages' (the trainer's split:
// distributed/pipeline/stages.h). For the busiest pipeline rank (`pipeline_rank` < 0) `busiest` blocks, the
// Mixture-of-Experts kind first (the heavier: DeepSeek-V3's dense blocks come first and are few).
struct RankBlocks {
  int64_t dense = 0, moe = 0;
  int64_t total() const { return dense + moe; }
};

RankBlocks rank_blocks(const DecoderArgs& a, const config::JobConfig& config, const distributed::ParallelDims& dims,
                       int64_t pipeline_rank, int64_t busiest) {
  RankBlocks out;
  if (dims.pp > 1 && pipeline_rank >= 0) {
    try {
      const auto plan = distributed::pipeline::plan_stages(a.n_layers, a.tie_word_embeddings, config, dims.pp);
      if (plan.actions) {
        for (int stage : plan.actions->stages_of(static_cast<int>(pipeline_rank)))
          for (const auto& name : plan.names[static_cast<size_t>(stage)])
            if (name.rfind("layers.", 0) == 0) (a.is_moe_layer(std::stoll(name.substr(7))) ? out.moe : out.dense) += 1;
        return out;
      }
    } catch (const UserError&) {
      // A layout the trainer refuses: it says why; the estimate falls back on the count below.
    }
  }
  const int64_t n = dims.pp > 1 ? busiest : a.n_layers;
  out.moe = std::min(n, a.moe_layers());
  out.dense = n - out.moe;
  return out;
}

// Whether a step runs several micro-batches per data-parallel rank, adding their gradients up.
bool accumulates_gradients(const config::JobConfig& config, const distributed::ParallelDims& dims) {
  const auto& training = config.training;
  return training.global_batch_size > 0 && training.global_batch_size > training.local_batch_size * dims.dp_degree();
}

// Gradient elements held at once. optimizer.early_step_in_backward without gradient accumulation steps and frees
// each gradient once it is final: at most a unit's shards under FSDP (`unit`), three buckets under DDP (one filling,
// one reducing, one being stepped), a block's gradients on one data-parallel rank (`unit`). Otherwise (and under
// pipeline parallelism, which the trainer refuses with it) every local gradient.
double gradient_bytes(const config::JobConfig& config, const distributed::ParallelDims& dims, double local, double unit) {
  if (!config.optimizer.early_step_in_backward || accumulates_gradients(config, dims) || dims.pp > 1) return local;
  if (dims.ddp_enabled()) return std::min(local, 3.0 * (25 << 20) / titan::config::dtype_bytes(config.training.dtype));
  return std::min(local, unit);
}

}  // namespace

MemoryEstimate estimate_training_memory(const DecoderArgs& a, const config::JobConfig& config,
                                        const distributed::ParallelDims& dims, bool autocast, double runtime_bytes,
                                        Execution execution, int64_t pipeline_rank, FusedKernels kernels,
                                        Allocator allocator) {
  if (execution != Execution::titan || !config.training.fused_kernels) kernels = FusedKernels::none;
  const auto& training = config.training;
  const auto& parallelism = config.parallelism;
  const double p_bytes = titan::config::dtype_bytes(training.dtype);
  const bool fsdp = dims.fsdp_enabled();
  // Compute dtype: FSDP gathers in mixed_precision_param; autocast computes in bfloat16; else the parameters'.
  const double c = fsdp ? (training.dtype == "float32" ? titan::config::dtype_bytes(training.mixed_precision_param) : p_bytes)
                        : (autocast ? 2.0 : p_bytes);
  const double tp = static_cast<double>(dims.tp), shards = static_cast<double>(dims.dp_shard * dims.cp);

  // This rank's share of the model: the stage with the most parameters under pipeline parallelism (torchtitan's
  // split counts the embedding and the output as one layer each; the remainder goes to the first stages).
  const double d = static_cast<double>(a.dim), vocab = static_cast<double>(a.vocab_size);
  // A block's parameters by kind (a dense model's blocks are all dense; DeepSeek-V3's dense blocks come first), with
  // the routed experts' apart. The share of a block a rank computes with (after TP; FSDP gathers it whole): under
  // expert parallelism only its E / EP routed experts, split over TP too when ETP is TP.
  const double expert_split = static_cast<double>(dims.ep) * (dims.ep > 1 && dims.etp == 1 ? 1.0 : static_cast<double>(dims.tp));
  struct Kind {
    double params = 0, experts = 0, here = 0;
  };
  const auto kind_of = [&](int64_t layer) {
    Kind k;
    const std::string experts_prefix = "layers." + std::to_string(layer) + ".moe.experts.";
    for (const auto& p : a.layer_parameter_shapes(layer)) {
      k.params += static_cast<double>(p.numel());
      if (p.name.rfind(experts_prefix, 0) == 0) k.experts += static_cast<double>(p.numel());
    }
    k.here = (k.params - k.experts) / static_cast<double>(dims.tp) + k.experts / expert_split;
    return k;
  };
  const Kind dense_block = a.moe_layers() < a.n_layers ? kind_of(0) : Kind{};
  const Kind moe_block = a.moe_layers() > 0 ? kind_of(a.n_layers - 1) : Kind{};
  const bool pipelined = dims.pp > 1;
  const distributed::pipeline::ScheduleTraits schedule =
      pipelined ? distributed::pipeline::schedule_traits(parallelism.pipeline_parallel_schedule) : distributed::pipeline::ScheduleTraits{};
  const int64_t stages_per_rank = pipelined && !schedule.single_stage ? 2 : 1;
  const int64_t stages = dims.pp * stages_per_rank;
  const int64_t units = a.n_layers + 2;  // the embedding and the output count as one layer each
  const int64_t per_stage = (units + stages - 1) / stages;
  // Which ends of the model this rank holds: both without a pipeline; for a given pipeline rank its stages' (rank
  // 0 holds the first, the last rank the last, or rank 0 both on a V-shaped schedule); else the busiest rank's.
  bool holds_first = true, holds_last = true;
  if (pipelined && pipeline_rank >= 0) {
    holds_first = pipeline_rank == 0;
    holds_last = schedule.v_shape ? pipeline_rank == 0 : pipeline_rank == dims.pp - 1;
  }
  int64_t layers_here = a.n_layers;
  if (pipelined) {
    layers_here = per_stage * stages_per_rank;
    if (pipeline_rank >= 0) layers_here -= (holds_first ? 1 : 0) + (holds_last ? 1 : 0);
    layers_here = std::clamp<int64_t>(layers_here, 0, a.n_layers);
  }
  const double embed = vocab * d, output = a.tie_word_embeddings ? 0 : vocab * d;
  double ends = embed + output + d;
  if (pipelined) ends = pipeline_rank < 0 ? std::max(embed, output + d) : (holds_first ? embed : 0) + (holds_last ? output + d : 0);
  const RankBlocks blocks = rank_blocks(a, config, dims, pipeline_rank, layers_here);
  layers_here = blocks.total();
  const double dense_here = static_cast<double>(blocks.dense), moe_here = static_cast<double>(blocks.moe);
  const double rank_params = dense_here * dense_block.params + moe_here * moe_block.params + ends;
  const double local = rank_params / tp / shards;
  // What this rank computes with: every block's TP share (its experts' EP share) and the ends' TP share.
  const double rank_compute_params = dense_here * dense_block.here + moe_here * moe_block.here + ends / tp;
  const double block_here = std::max(blocks.dense > 0 ? dense_block.here : 0, blocks.moe > 0 ? moe_block.here : 0);

  MemoryEstimate e;
  e.terms.push_back({"parameters", local * p_bytes});
  // A unit's local share: a block's parameters over TP and the data-parallel shards (under EP its experts' shards,
  // over efsdp, hold the same share of them), or the embedding's.
  const double unit_local = std::max({dense_block.params, moe_block.params, embed}) / tp / shards;
  // The trainer frees the gradients before each step's forward (Adam::zero_grad), and backward makes them as it goes:
  // with one micro-batch per step they do not exist while the forward runs. The output's (and the final norm's) are
  // made by the loss's backward, before the first block's; the blocks' and the embedding's as the blocks' activations
  // are freed, whose memory the allocator gives them (a GPU's caching allocator, titan's host block cache:
  // protocols::Allocator). Accumulating over micro-batches, a pipeline's later micro-batches and steps in
  // backward keep them through the step. torchtitan's training loop does the same (zero_grad with set_to_none; FSDP2
  // makes each unit's gradient shards at its reduce-scatter): its published 8B peaks came 4-5% closer this way. Not
  // its pure data parallelism: PyTorch's DDP keeps its gradient buckets from step to step.
  const bool made_in_backward = allocator == Allocator::device_caching && !pipelined && !accumulates_gradients(config, dims) &&
                                !config.optimizer.early_step_in_backward &&
                                !(execution == Execution::torchtitan && dims.ddp_enabled());
  const double gradients = gradient_bytes(config, dims, local, unit_local) * p_bytes;
  if (made_in_backward) {
    // Tied or not, the output's weight gradient comes first; an embedding of its own gets its gradient last.
    const double head = std::min(gradients, (vocab * d + d) / tp / shards * p_bytes);
    const double last = std::min(gradients - head, output > 0 ? embed / tp / shards * p_bytes : 0.0);
    e.terms.push_back({"gradients", gradients - head - last, Phase::gradients});
    e.terms.push_back({"the output's gradients", head, Phase::head_gradients});
    e.terms.push_back({"the embedding's gradients", last, Phase::last_gradients});
    // The embedding's backward makes a whole table-sized gradient before it lands: under FSDP unsharded in the
    // compute dtype until its reduce-scatter; with the output's weight tied, beside the output's gradient it is then
    // added to.
    const double table = fsdp && shards > 1 ? embed / tp * c : a.tie_word_embeddings ? embed / tp * p_bytes : 0.0;
    e.terms.push_back({"the embedding's backward", table, Phase::embedding_backward});
  } else {
    e.terms.push_back({"gradients", gradients});
  }
  e.terms.push_back({"optimizer", 2 * local * p_bytes});
  if (config.optimizer.implementation == "foreach") {
    // The foreach AdamW's step (components/optimizer.cpp, as PyTorch's _multi_tensor_adamw) makes one new tensor per
    // parameter for the denominator, sqrt(v) / sqrt(1 - beta2^t) + eps, over every gradient it steps at once; Adam's
    // L2 weight decay makes the gradients plus decay anew beside them. With steps in backward it runs on what each
    // step takes (the gradients held at once), while the blocks run backward. Measured: the 100M flavor, one
    // process, 1 x 64 tokens: 2.20 GiB peak fused, 2.56 foreach (its parameters 0.39 GiB).
    const bool adam_decay = config.optimizer.name == "Adam" && config.optimizer.weight_decay != 0;
    const bool in_backward = config.optimizer.early_step_in_backward && !accumulates_gradients(config, dims) && dims.pp == 1;
    e.terms.push_back({"foreach optimizer temporaries", gradients * (adam_decay ? 2 : 1),
                       in_backward ? Phase::blocks_backward : Phase::optimizer_step});
  }
  // Weights in the compute dtype: autocast's per-step cache of every weight; FSDP's gathered units (the current one
  // and the prefetched next, or all of them when they stay gathered between forward and backward).
  double copies = 0, reduced_unit = 0;
  if (autocast) copies = rank_compute_params * 2.0;
  if (fsdp && shards > 1) {
    const bool reshard = parallelism.fsdp_reshard_after_forward == "always" ||
                         (parallelism.fsdp_reshard_after_forward == "default" && !pipelined);
    // A block's unit: under EP its dense part over dp_shard x cp and its experts over efsdp, gathered together.
    const double unit = std::max(block_here, embed / tp);
    copies = reshard ? 2 * unit * c + unit * titan::config::dtype_bytes(training.mixed_precision_reduce) : rank_compute_params * c;
    reduced_unit = unit;
  }
  e.terms.push_back({"weight copies", copies});
  // torchtitan's pipeline keeps FSDP from reduce-scattering until the last micro-batch: the stage's gradients
  // accumulate unsharded in the compute dtype.
  if (execution == Execution::torchtitan && pipelined && fsdp && shards > 1) e.terms.push_back({"unsharded gradients", rank_params / tp * c});

  // Activations of the micro-batches in flight.
  const double cp = static_cast<double>(dims.cp);
  const int64_t microbatch = pipelined ? parallelism.pipeline_parallel_microbatch_size : training.local_batch_size;
  const double tokens = static_cast<double>(microbatch) * static_cast<double>(training.seq_len) / cp;
  // What the rank holds at once, in (stage, micro-batch) pairs: one forward's activations without a pipeline.
  using Held = distributed::pipeline::Schedule::Held;
  std::vector<Held> held{{1, 0}};
  bool splits_backward = false;  // zero-bubble: weight steps apart from input steps
  if (pipelined) {
    const int64_t m = training.local_batch_size / std::max<int64_t>(1, parallelism.pipeline_parallel_microbatch_size);
    // The schedule says how many micro-batches' activations a rank holds at once (1F1B: pp - rank on rank `rank`)
    // and, on zero-bubble schedules, how many input steps wait for their weight steps; the states of the busiest
    // rank's when no rank is given. A schedule that cannot run these numbers is reported by the trainer.
    held = {{static_cast<int>(std::min<int64_t>(m, dims.pp * stages_per_rank)), 0}};
    // Per (schedule, its CSV order if any, ranks, micro-batches, execution): `titan plan --search` asks for the
    // same ones many times. A custom order (pipeline_parallel_schedule_csv) is what the trainer runs: its input and
    // weight steps, not its name's, say whether and how long weight steps wait. torch.distributed.pipelining's input
    // step retains the forward's graph for the weight step, so under `--as torchtitan` a forward's activations stay
    // until then.
    struct Orders {
      std::vector<std::vector<Held>> per_rank;
      bool splits_backward = false;
    };
    static std::map<std::tuple<std::string, std::string, int64_t, int64_t, bool>, Orders> per_rank_cache;
    const std::string csv = parallelism.pipeline_parallel_schedule_csv.value_or("");
    const bool graph_until_weight_step = execution == Execution::torchtitan;
    const auto key = std::make_tuple(parallelism.pipeline_parallel_schedule, csv, dims.pp, m, graph_until_weight_step);
    auto it = per_rank_cache.find(key);
    if (it == per_rank_cache.end()) {
      Orders orders;
      orders.splits_backward = schedule.splits_backward;
      try {
        const auto order = csv.empty() ? distributed::pipeline::Schedule::make(parallelism.pipeline_parallel_schedule, static_cast<int>(dims.pp),
                                                                               static_cast<int>(stages), static_cast<int>(m))
                                       : distributed::pipeline::Schedule::from_csv(csv, static_cast<int>(dims.pp), static_cast<int>(stages),
                                                                                   static_cast<int>(m), schedule.v_shape);
        for (int r = 0; r < dims.pp; ++r) orders.per_rank.push_back(order.held(r, graph_until_weight_step));
        orders.splits_backward = order.splits_backward();
      } catch (const UserError&) {
      }
      it = per_rank_cache.emplace(key, std::move(orders)).first;
    }
    splits_backward = it->second.splits_backward;
    if (!it->second.per_rank.empty()) {
      held.clear();
      for (int r = 0; r < dims.pp; ++r)
        if (pipeline_rank < 0 || r == pipeline_rank)
          held.insert(held.end(), it->second.per_rank[static_cast<size_t>(r)].begin(), it->second.per_rank[static_cast<size_t>(r)].end());
    }
  }
  // The residual stream: titan keeps it in the parameter dtype (measured: docs/metrics.md); torchtitan's FSDP
  // computes it in the gathered weights' dtype.
  const double r = fsdp && execution == Execution::torchtitan ? c : p_bytes;
  const auto& ac = config.activation_checkpoint;
  // Per token: what the rank's blocks keep through the step, and the most one block holds while it runs backward
  // (recomputed, and its gradients' buffers).
  double per_token = 0, recompute = 0, backward_buffers = 0, deferred_per_token_here = 0;
  for (const bool moe_kind : {false, true}) {
    const int64_t count = moe_kind ? blocks.moe : blocks.dense;
    if (count == 0) continue;
    const auto n = static_cast<double>(count);
    const BlockActivations block = block_activations(a, moe_kind, r, c, autocast, dims.tp, kernels, dims.ep == 1,
                                                     splits_backward && execution == Execution::titan);
    if (splits_backward) deferred_per_token_here += n * deferred_per_token(a, moe_kind, r, c, dims.tp, execution == Execution::titan);
    backward_buffers = std::max(backward_buffers, block.backward_buffers);
    if (ac.mode == "full") {
      per_token += n * block.input_only;
      recompute = std::max(recompute, block.full);
    } else if (ac.mode == "selective" && ac.selective_ac_option == "op") {
      const double kept = op_kept_per_token(a, moe_kind, r, c, dims.tp, execution);
      per_token += n * kept;
      // The recomputed block reuses what was kept rather than holding a second copy.
      recompute = std::max(recompute, std::max(block.input_only, block.full - (kept - block.input_only)));
    } else if (ac.mode == "selective") {
      const int64_t every = std::max<int64_t>(1, std::atoll(ac.selective_ac_option.c_str()));
      const int64_t checkpointed = count / every;
      per_token += static_cast<double>(count - checkpointed) * block.full + static_cast<double>(checkpointed) * block.input_only;
      if (checkpointed > 0) recompute = std::max(recompute, block.full);
    } else {
      per_token += n * block.full;
    }
  }
  if (holds_last) per_token += d * (p_bytes + c) / tp;  // the final norm and the output projection's input
  // Under a multi-stage schedule `held` counts (stage, micro-batch) pairs, each holding one stage's layers.
  const double stage_share = 1.0 / static_cast<double>(stages_per_rank);
  // titan's own execution: a micro-batch's loss is done and its logits freed before the blocks' backward, where a
  // checkpointed block is recomputed and its gradients flow, so the peak holds the larger of the two (`titan plan
  // --as torchtitan` keeps the sum its published figures were compared with).
  // GPipe and LoopedBFS run every forward (and loss) of a step before any backward: the last stage holds the other
  // micro-batches' loss graphs while its blocks run backward, so there the sum stays.
  const bool all_forwards_first = pipelined && (schedule.name == "GPipe" || schedule.name == "LoopedBFS");
  const bool phased = execution == Execution::titan && !all_forwards_first;
  const Phase backward_phase = phased ? Phase::blocks_backward : Phase::step;
  // The schedule's state that holds the most of both.
  const double per_pair = tokens * per_token * stage_share, deferred_per_pair = tokens * deferred_per_token_here * stage_share;
  const Held most = *std::max_element(held.begin(), held.end(), [&](const Held& x, const Held& y) {
    return x.forwards * per_pair + x.deferred * deferred_per_pair < y.forwards * per_pair + y.deferred * deferred_per_pair;
  });
  e.terms.push_back({"activations", per_pair * most.forwards, made_in_backward ? Phase::activations : Phase::step});
  if (most.deferred > 0) e.terms.push_back({"deferred weight gradients' operands", deferred_per_pair * most.deferred});
  e.terms.push_back({"recomputed block", layers_here > 0 ? tokens * recompute : 0, backward_phase});
  // While a block runs backward, the gradients flowing through it and its kernels' temporaries take about what it
  // saved in forward (measured: docs/metrics.md).
  e.terms.push_back({"backward buffers", tokens * backward_buffers, backward_phase});
  // FSDP reduces a unit once all its gradients exist: they are held unsharded, in the compute dtype, until they are
  // copied into the reduction's buffer (counted with the weight copies). Small beside a dense block's activations;
  // a unit of many experts is not (debugmodel_moe's block with 128 experts on FSDP 4: 151 MB; docs/moe.md).
  if (execution == Execution::titan && reduced_unit > 0)
    e.terms.push_back({"a unit's gradients", reduced_unit * c, backward_phase});
  // Logits in the compute dtype, their float32 copy for the loss, its log-softmax and the gradients in both dtypes
  // (vocabulary-sharded under loss parallelism), for one micro-batch on the last stage.
  const double vocab_here = parallelism.disable_loss_parallel ? vocab : vocab / tp;
  const bool loss_in_forward = execution == Execution::titan && training.fused_kernels && (dims.tp == 1 || !parallelism.disable_loss_parallel);
  if (holds_last && loss_in_forward) {
    // The fused projection and loss (distributed/loss_parallel.cpp): one chunk's logits in the compute dtype, and,
    // kept from forward to backward, d loss / d x and the float32 weight gradient; beside that one weight-sized
    // tensor in the compute dtype (bf16 only), in forward a chunk's weight-gradient product before it is added, in
    // backward the weight gradient's cast (never both at once; float32 adds in place and needs no cast).
    const double chunk = static_cast<double>(
        distributed::linear_cross_entropy_chunk(static_cast<int64_t>(tokens), static_cast<int64_t>(vocab_here)));
    // Without titan's kernels (devices that have none, or kernels that do not apply) the two passes are ATen ops
    // with a float32 temporary of the chunk.
    const double aten_temporary = kernels != FusedKernels::none ? 0 : chunk * vocab_here * 4;
    // CPUs without bf16 products (nn/matmul.h) compute the chunk's logits as the float32 product of float32 copies of
    // its bf16 operands, then round it: for a moment the weight's float32 copy and the float32 logits are there too
    // (measured: Llama 3's vocabulary on the debug blocks, 2 x 512 tokens on an AVX2 EPYC, 0.70x without them).
    const double float32_product =
        kernels == FusedKernels::cpu && c == 2 && training.mixed_precision_param == "bfloat16" && nn::emulates_bf16_gemm() ? (chunk + d) * vocab_here * 4 : 0;
    const double input_gradient = tokens * d * c;
    const double fused = chunk * vocab_here * c + aten_temporary + float32_product + vocab_here * d * (4 + (c == 4 ? 0 : c));
    if (made_in_backward) {
      // Its backward runs before the first block's: what it kept is freed then, but for d loss / d x, made in its
      // forward, which flows into the blocks and dies with their activations (its weight gradient becomes the output's
      // gradient, counted above).
      e.terms.push_back({"logits (fused loss, chunked)", fused, Phase::loss});
      e.terms.push_back({"the loss's input gradient", input_gradient, Phase::activations});
    } else {
      e.terms.push_back({"logits (fused loss, chunked)", fused + input_gradient});
    }
  } else if (holds_last) {
    e.terms.push_back({"logits", tokens * vocab_here * (execution == Execution::torchtitan ? 12 : 2 * c + 12),
                       phased ? Phase::loss : Phase::step});
  }
  e.terms.push_back({"rope table", static_cast<double>(training.seq_len) * static_cast<double>(a.rope_dim() / 2) * 8});
  e.terms.push_back({"runtime", runtime_bytes});
  return e;
}

}  // namespace titan::models
