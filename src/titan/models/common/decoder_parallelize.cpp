#include "titan/models/common/decoder_parallelize.h"

#include "titan/models/common/moe.h"

#include "titan/common/error.h"
#include "titan/components/quantization/float8.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/nn/loss.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/ddp.h"
#include "titan/components/metrics/memory.h"
#include "titan/distributed/expert_parallel.h"
#include "titan/distributed/fsdp.h"
#include "titan/distributed/loss_parallel.h"
#include "titan/distributed/pipeline/zero_bubble.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/kernels/fused_ops.h"

namespace titan::models {

using distributed::Placement;

void check_tensor_parallel(const DecoderArgs& args, int64_t tp, const std::vector<std::pair<std::string, int64_t>>& seq_lens,
                           const std::string& degree) {
  if (tp <= 1) return;
  auto require = [&](int64_t value, const std::string& what) {
    if (value % tp != 0)
      fail(degree, " = ", tp, ": ", what, " = ", value, " does not divide by ", tp,
           "; pick a degree that divides it");
  };
  require(args.n_heads, "model n_heads (query heads)");
  require(args.kv_heads(), "model n_kv_heads (key/value heads)");
  if (!args.moe || args.n_dense_layers > 0) require(args.ffn_hidden_dim(), "the feed-forward hidden dimension");
  require(args.vocab_size, "the vocabulary size");
  // Sequence parallelism splits every sequence between the blocks.
  for (const auto& [name, length] : seq_lens) require(length, name);
}

namespace {

// Entries for filter_fqns (substrings of layer names) that keep exactly `offending` in high precision among
// `converted`: each name without its "layers.N." prefix where that matches no other converted layer, else the name.
std::vector<std::string> filters_for(const std::vector<std::string>& offending, const std::vector<std::string>& converted) {
  std::vector<std::string> out;
  auto add = [&](const std::string& f) {
    if (std::find(out.begin(), out.end(), f) == out.end()) out.push_back(f);
  };
  for (const auto& name : offending) {
    std::string suffix = name;
    if (starts_with(name, "layers.")) suffix = name.substr(name.find('.', 7) + 1);
    bool exact = true;
    for (const auto& other : converted)
      if (other.find(suffix) != std::string::npos && std::find(offending.begin(), offending.end(), other) == offending.end()) exact = false;
    add(exact ? suffix : name);
  }
  return out;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::vector<std::string> q;
  for (const auto& n : names) q.push_back(quote(n));
  return join(q, ", ");
}

}  // namespace

void check_parallelism(const DecoderArgs& args, const distributed::ParallelDims& dims, const config::JobConfig& config) {
  std::vector<std::pair<std::string, int64_t>> seq_lens = {{"training.seq_len", config.training.seq_len}};
  if (config.validation.enable) seq_lens.emplace_back("validation.seq_len", config.validation.seq_len);
  if (dims.cp > 1) {
    const auto& p = config.parallelism;
    const auto balancer = distributed::parse_cp_load_balancer(p.context_parallel_load_balancer);
    distributed::parse_cp_rotate_method(p.context_parallel_rotate_method);
    for (auto& [name, length] : seq_lens) {
      distributed::ContextParallel::check_seq_len(balancer, dims.cp, length, name);
      length /= dims.cp;  // what each CP rank holds, which sequence parallelism splits further
      name += " / context_parallel_degree";
    }
  }
  if (dims.tp > 1) check_tensor_parallel(args, dims.tp, seq_lens);
  if (!args.moe && dims.ep > 1)
    fail("parallelism.expert_parallel_degree = ", dims.ep, " needs a Mixture-of-Experts model; model.flavor ",
         quote(config.model.flavor), " has no experts");
  if (args.moe) {
    // Mixture-of-Experts models run under every parallelism (docs/moe.md).
    if (dims.tp > 1 && args.moe->hidden_dim % dims.tp != 0)
      fail("parallelism.tensor_parallel_degree = ", dims.tp, ": the experts' hidden dimension (moe_inter_dim) = ",
           args.moe->hidden_dim, " does not divide by ", dims.tp, "; pick a degree that divides it");
    if (dims.ep > 1 && args.moe->num_experts % dims.ep != 0)
      fail("parallelism.expert_parallel_degree = ", dims.ep, " does not divide the model's ", args.moe->num_experts,
           " experts (model.flavor ", quote(config.model.flavor), "); each expert-parallel rank holds an equal share");
    // float8 and MXFP8 linears convert the attention, the shared experts and the router where its dimensions allow
    // (as torchtitan's converters do); the routed experts' grouped products stay in high precision.
    const bool mx = quantization::mx_enabled(config);
    if ((quantization::float8_enabled(config) || mx) && dims.tp > 1) {
      // Under TP the router and latent attention's down-projections run whole on every rank, and their output
      // gradients are each rank's partial sum (summed only at the block's input): a float8 cast of a partial sum is
      // not the cast of the sum one process makes.
      std::vector<std::string> partial, suffixes;
      for (int64_t layer = 0; layer < args.n_layers; ++layer)
        for (const auto& p : args.layer_parameter_shapes(layer)) {
          if (p.shape.size() != 2 || !ends_with(p.name, ".weight")) continue;
          const std::string module = p.name.substr(0, p.name.size() - 7);
          const bool converted = mx ? quantization::mx_converts(module, p.shape[0], p.shape[1], config.quantize.linear.mx)
                                    : quantization::float8_converts(module, p.shape[0], p.shape[1], config.quantize.linear.float8);
          for (const char* suffix : {"router.gate", "wq_a", "wkv_a"})
            if (ends_with(module, std::string(".") + suffix) && converted) {
              partial.push_back(module);
              if (std::find(suffixes.begin(), suffixes.end(), suffix) == suffixes.end()) suffixes.push_back(suffix);
            }
        }
      if (!partial.empty())
        fail("model.converters = [", join(config.model.converters, ", "), "] with parallelism.tensor_parallel_degree = ", dims.tp,
             ": the ", mx ? "MXFP8" : "float8", " linears ", quote(partial.front()),
             partial.size() > 1 ? cat(" ... ", quote(partial.back())) : std::string(), " (", partial.size(),
             ") run whole on every tensor-parallel rank and take partial output gradients, which ", mx ? "MXFP8" : "float8",
             " cannot scale as one process does; add ", quoted_list(suffixes), " to ",
             mx ? "quantize.linear.mx.filter_fqns" : "quantize.linear.float8.filter_fqns",
             std::find(suffixes.begin(), suffixes.end(), "router.gate") != suffixes.end()
                 ? " (torchtitan's DeepSeek-V3 TOMLs filter the router)" : "");
    }
  }
}

// MXFP8 linears under TP: each rank's shard of a converted weight must hold whole blocks of 32 along both
// dimensions (each is a contraction dimension of one of the linear's matmuls), so that its blocks, and their
// scales, are one process's.
void check_mx_shards(Decoder& model, int64_t tp) {
  std::vector<std::string> converted, offending, shapes;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto* linear = dynamic_cast<const nn::Linear*>(item.value().get());
    if (!linear || !linear->has_wrapper(nn::float8::kWrapperName)) continue;
    converted.push_back(item.key());
    const at::Tensor& w = linear->weight;
    if (w.size(0) % 32 == 0 && w.size(1) % 32 == 0) continue;
    offending.push_back(item.key());
    shapes.push_back(cat(quote(item.key()), " [", w.size(0), ", ", w.size(1), "]"));
  }
  if (offending.empty()) return;
  fail("model.converters asks for MXFP8 linears with parallelism.tensor_parallel_degree = ", tp, ": ", offending.size(),
       " converted weights would be split into pieces that cut MXFP8's blocks of 32 (each rank's piece: ", join(shapes, ", "),
       "); add ", quoted_list(filters_for(offending, converted)), " to quantize.linear.mx.filter_fqns or lower the degree");
}

std::vector<int64_t> block_indices(const ModuleRange& range, int64_t n_layers) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n_layers; ++i)
    if (range.contains(i + 1)) out.push_back(i);
  return out;
}

distributed::ActivationCheckpointSummary apply_activation_checkpointing(Decoder& model, const ModuleRange& part,
                                                                         const config::ActivationCheckpoint& ac) {
  using distributed::checkpoint_unit;
  distributed::ActivationCheckpointSummary summary;
  if (ac.mode == "none") {
    summary.description = "activation checkpointing off";
    return summary;
  }
  if (ac.mode == "memory_budget")
    fail("activation_checkpoint.mode = \"memory_budget\" needs a graph compiler (torch.compile), which titan.cpp does not "
         "have; use \"full\" or \"selective\"");
  if (ac.mode == "full") {
    for (int64_t i : block_indices(part, static_cast<int64_t>(model.layers.size()))) checkpoint_unit(*model.layers[static_cast<size_t>(i)]), ++summary.wrapped_units;
    summary.description = cat("full activation checkpointing of all ", summary.wrapped_units, " blocks");
    return summary;
  }
  if (ac.selective_ac_option == "op") {
    // torchtitan's policy: each block checkpointed whole, keeping attention's output and every other product's.
    const auto& forced = ac.per_op_sac_force_recompute_mm_shapes_by_fqns;
    for (int64_t i : block_indices(part, static_cast<int64_t>(model.layers.size()))) {
      auto& block = *model.layers[static_cast<size_t>(i)];
      for (const auto& item : block.named_modules()) {
        const std::string fqn = cat("layers.", i, item.key().empty() ? "" : ".", item.key());
        if (!std::any_of(forced.begin(), forced.end(), [&](const std::string& f) { return fqn.find(f) != std::string::npos; }))
          continue;
        auto* linear = dynamic_cast<nn::Linear*>(item.value().get());
        if (!linear)
          fail("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns matches ", quote(fqn),
               ", which is not a linear layer");
        linear->recompute_under_op_checkpointing = true;
      }
      checkpoint_unit(block, distributed::Recompute::all_but_kept_ops);
      ++summary.wrapped_units;
    }
    summary.description = cat("op-level selective activation checkpointing of ", summary.wrapped_units,
                              " blocks (attention and every other linear kept, the rest recomputed)");
    return summary;
  }
  const int64_t every = std::stoll(ac.selective_ac_option);
  const auto layers = block_indices(part, static_cast<int64_t>(model.layers.size()));
  for (int64_t i : layers) {
    // Counted over the whole model, so a block is checkpointed or not whatever stage holds it.
    if (every == 0 || (i + 1) % every == 0) {
      checkpoint_unit(*model.layers[static_cast<size_t>(i)]);
      ++summary.wrapped_units;
    }
  }
  summary.description = cat("selective activation checkpointing of every ", every == 0 ? 1 : every, "-th block (",
                            summary.wrapped_units, " of ", layers.size(), ")");
  return summary;
}

namespace {

// torchtitan's TP plan: embedding row-wise over the vocabulary into sequence shards; per block, sequence-parallel
// norms, attention and feed-forward inputs gathered over the sequence, wq/wk/wv/w1/w3 column-wise (heads split;
// latent attention: its per-head up-projections),
// wo/w2 row-wise back into sequence shards; the final norm sequence-parallel; the output column-wise, its logits
// left vocabulary-sharded for loss parallelism or gathered. Without `sequence_parallel` (sampling: one new token
// per row cannot be split over the ranks) every activation between the styles is whole on every rank: the
// row-wise outputs and the MoE layer's partial sums are all-reduced instead of reduce-scattered.
// `split_experts`: the routed experts' hidden dimension over TP (no EP, or EP with ETP = TP); false when EP borrows
// the TP ranks (ETP 1: each rank's experts whole, the routed rows split over TP instead).
void apply_tensor_parallel(Decoder& model, const ModuleRange& part, distributed::TensorParallel& tp, bool loss_parallel,
                           int64_t overlap_chunks, bool split_experts, bool sequence_parallel = true) {
  const Placement replicate = Placement::replicate(), features = Placement::shard(-1);
  const Placement sequence = sequence_parallel ? Placement::shard(1) : replicate;
  auto region = [&](nn::Unit& module, nn::Unit& rowwise_output) {
    if (sequence_parallel) tp.sequence_parallel_region(module, rowwise_output, overlap_chunks);
  };
  if (part.contains(0)) tp.rowwise_embedding(*model.tok_embeddings, model.tok_embeddings->weight, sequence);
  for (int64_t i : block_indices(part, static_cast<int64_t>(model.layers.size()))) {
    auto& block = model.layers[static_cast<size_t>(i)];
    tp.sequence_parallel(*block->attention_norm, block->attention_norm->weight);
    if (block->latent_attention) {
      // torchtitan's DeepSeek-V3 plan: the per-head up-projections (wq or wq_b, wkv_b) column-wise, wo row-wise;
      // the low-rank down-projections and their norms whole on every rank over the gathered sequence, their
      // gradients partial sums (each rank's heads' share of the latent's and the shared rotary key's gradient).
      auto& attention = *block->latent_attention;
      for (auto* linear : {attention.wq.get(), attention.wq_b.get(), attention.wkv_b.get()})
        if (linear) tp.colwise(*linear, linear->weight, replicate, features);
      for (auto* linear : {attention.wq_a.get(), attention.wkv_a.get()})
        if (linear) tp.replicated_partial(linear->weight);
      for (auto* norm : {attention.q_norm.get(), attention.kv_norm.get()})
        if (norm) tp.replicated_partial(norm->weight);
      tp.rowwise(*attention.wo, attention.wo->weight, sequence);
      region(attention, *attention.wo);
    } else {
      auto& attention = *block->attention;
      for (auto* linear : {attention.wq.get(), attention.wk.get(), attention.wv.get()})
        tp.colwise(*linear, linear->weight, replicate, features);
      tp.rowwise(*attention.wo, attention.wo->weight, sequence);
      // Qwen3's q/k norms act on each rank's own heads: whole weights whose gradients are partial sums.
      if (attention.q_norm) {
        tp.replicated_partial(attention.q_norm->weight);
        tp.replicated_partial(attention.k_norm->weight);
      }
      region(attention, *attention.wo);
    }
    tp.sequence_parallel(*block->ffn_norm, block->ffn_norm->weight);
    if (block->moe) {
      // torchtitan's MoE plan: every rank routes all tokens alike (the router whole, its gradient a partial sum) and
      // computes its share of every expert's hidden units (w1/w3 on their hidden dimension, w2 on its input), the
      // shared experts column- and row-wise; the layer's output is the sum over the ranks.
      auto& moe = *block->moe;
      tp.replicated_partial(moe.router->gate->weight);
      if (split_experts) {
        tp.split(moe.experts->w1, 1);
        tp.split(moe.experts->w3, 1);
        tp.split(moe.experts->w2, 2);
        // Low-precision grouped products take float8's per-row scales over the whole hidden dimension.
        moe.experts->gate_up_amax = tp.amax_reduction(0);
        moe.experts->down_amax = tp.amax_reduction(1);
      }
      if (moe.shared_experts) {
        tp.split(moe.shared_experts->w1->weight, 0);
        tp.split(moe.shared_experts->w3->weight, 0);
        tp.split(moe.shared_experts->w2->weight, 1);
        // w1/w3's output gradients and w2's input are split: their float8 scales are taken over the ranks.
        tp.float8_scales_over_group(*moe.shared_experts->w1, 0);
        tp.float8_scales_over_group(*moe.shared_experts->w3, 0);
        tp.float8_scales_over_group(*moe.shared_experts->w2, 1);
      }
      tp.partial_region(moe, sequence);
      continue;
    }
    auto& ffn = *block->feed_forward;
    tp.colwise(*ffn.w1, ffn.w1->weight, replicate, features);
    tp.colwise(*ffn.w3, ffn.w3->weight, replicate, features);
    tp.rowwise(*ffn.w2, ffn.w2->weight, sequence);
    region(ffn, *ffn.w2);
  }
  const int64_t n = static_cast<int64_t>(model.layers.size());
  if (part.contains(n + 1)) tp.sequence_parallel(*model.norm, model.norm->weight);
  if (part.contains(n + 2)) tp.colwise(*model.output, model.output->weight(), sequence, loss_parallel ? features : replicate);
}

}  // namespace

std::vector<distributed::ShardedParameter> parallelize_for_sampling(Decoder& model, std::shared_ptr<distributed::Communicator> group) {
  std::vector<distributed::ShardedParameter> params = distributed::describe_parameters(model);
  const int64_t n = group->size();
  if (n <= 1) return params;
  check_tensor_parallel(model.args(), n, {}, "tensor parallelism over the launch's ranks");
  distributed::TensorParallel tp(std::move(group), params);
  apply_tensor_parallel(model, ModuleRange::whole(model), tp, /*loss_parallel=*/false, /*overlap_chunks=*/1,
                        /*split_experts=*/true, /*sequence_parallel=*/false);
  return params;
}

ModelPart parallelize(Decoder& model, const distributed::DeviceMesh& mesh, const config::JobConfig& config,
                      const distributed::FsdpOptions& fsdp, const ModuleRange& part, bool split_backward,
                      std::shared_ptr<distributed::ContextParallel> cp) {
  const auto& dims = mesh.dims();
  const auto& p = config.parallelism;
  const int64_t n = static_cast<int64_t>(model.layers.size());
  ModelPart out;
  for (auto& param : distributed::describe_parameters(model))
    if (part.contains(model.module_of(param.name))) out.parameters.push_back(param);
  out.loss = [](const at::Tensor& logits, const at::Tensor& labels) { return cross_entropy_sum(logits, labels); };
  out.loss_in_forward = kernels::fused_kernels_enabled() && (dims.tp == 1 || !p.disable_loss_parallel);

  check_parallelism(model.args(), dims, config);
  if (dims.cp > 1 && config.model.attn_mask_type == "block_causal" && !fsdp.device.is_cpu())
    fail("model.attn_mask_type = \"block_causal\" with parallelism.context_parallel_degree = ", dims.cp, " on ",
         fsdp.device.str(), ": block-causal context parallelism runs on CPUs only so far (LibTorch's CUDA flash-attention "
         "kernel, which it uses per chunk pair, takes no mask); use attn_mask_type = \"causal\" on GPUs");
  if (dims.cp > 1) {
    // The attention core of every block runs over the whole sequence from this rank's part of it.
    if (!cp)
      cp = std::make_shared<distributed::ContextParallel>(mesh.get("cp"), distributed::parse_cp_load_balancer(p.context_parallel_load_balancer),
                                                          distributed::parse_cp_rotate_method(p.context_parallel_rotate_method));
    model.chunked_attention = true;
    for (int64_t i : block_indices(part, static_cast<int64_t>(model.layers.size())))
      model.layers[static_cast<size_t>(i)]->inner_attention().add_innermost_wrapper(
          "context_parallel", [cp](const nn::Unit::Inputs& in, const nn::Context& context, const nn::Unit::Next&) {
            if (context.attn_mask.defined()) fail("internal: a whole-sequence attention mask under context parallelism");
            return cp->attention(in[0], in[1], in[2], context.documents);
          });
    out.description.push_back("Context parallelism: " + cp->describe());
  }
  if (dims.tp > 1) {
    out.tp_group = mesh.get("tp");
    distributed::TensorParallel tp(out.tp_group, out.parameters);
    // torchao's float8 TP styles (activations cast before the collectives) are tensorwise; the rowwise recipes and
    // MXFP8 run under the plain styles, their linears taking each per-row scale over the ranks that split the row
    // (MX blocks of 32 stay within a rank's shard, checked below).
    const bool mx = quantization::mx_enabled(config);
    tp.cast_float8_activations_before_collectives(!mx && (!quantization::float8_enabled(config) ||
                                                          quantization::float8_recipe_name(config) == "tensorwise"));
    const bool loss_parallel = !p.disable_loss_parallel;
    // Async TP: attention and feed-forward run on batch slices with their sequence collectives in the background.
    const int64_t overlap_chunks = p.enable_async_tensor_parallel ? kAsyncTensorParallelSlices : 1;
    apply_tensor_parallel(model, part, tp, loss_parallel, overlap_chunks, !(dims.ep > 1 && dims.etp == 1));
    if (mx) check_mx_shards(model, dims.tp);
    if (loss_parallel) {
      const int64_t vocab_begin = tp.shard_begin(model.args().vocab_size);
      auto group = mesh.get("tp");
      out.loss = [vocab_begin, group](const at::Tensor& logits, const at::Tensor& labels) {
        return distributed::vocab_parallel_cross_entropy_sum(logits, labels, vocab_begin, group, kIgnoreIndex);
      };
      // The fused projection and loss over this rank's vocabulary rows, combined across the group.
      if (part.contains(n + 2))
        model.output->add_innermost_wrapper("loss_parallel", [output = model.output.get(), vocab_begin, group](
                                                                 const nn::Unit::Inputs& in, const nn::Context& context,
                                                                 const nn::Unit::Next& next) {
          if (!context.labels.defined()) return next(in, context);
          return distributed::linear_cross_entropy_sum(in[0], output->weight(), context.labels, vocab_begin, group, kIgnoreIndex);
        });
    }
    out.description.push_back(cat("Tensor parallelism over ", dims.tp, " ranks with sequence parallelism; ",
                                  loss_parallel ? "loss parallel (vocabulary-sharded logits)" : "logits gathered for the loss",
                                  p.enable_async_tensor_parallel
                                      ? cat("; async TP: up to ", kAsyncTensorParallelSlices,
                                            " batch slices per attention/feed-forward, their forward all-gathers and "
                                            "reduce-scatters overlapped with computation")
                                      : std::string()));
    // The slices are of what one forward takes: the local batch, or under a pipeline one micro-batch.
    const bool pipelined = dims.pp > 1;
    if (p.enable_async_tensor_parallel && (pipelined ? p.pipeline_parallel_microbatch_size : config.training.local_batch_size) < 2)
      log::warn("parallelism.enable_async_tensor_parallel: with ",
                pipelined ? "parallelism.pipeline_parallel_microbatch_size" : "training.local_batch_size",
                " 1 each forward takes one sequence, one batch slice, so nothing overlaps; use ",
                pipelined ? "micro-batches" : "a local batch", " of 2 or more");
  } else if (p.enable_async_tensor_parallel) {
    log::warn("parallelism.enable_async_tensor_parallel has no effect without tensor parallelism (tensor_parallel_degree = 1)");
  }
  if (split_backward) {
    // Zero-bubble schedules: the blocks' matmul weight gradients wait for the schedule's weight steps.
    for (int64_t i : block_indices(part, static_cast<int64_t>(model.layers.size()))) {
      auto& block = *model.layers[static_cast<size_t>(i)];
      // The dense SwiGLU's (a MoE block's shared experts'); the routed experts' grouped products run at once.
      FeedForward* ffn = block.feed_forward ? block.feed_forward.get() : block.moe->shared_experts.get();
      std::vector<nn::Linear*> linears = block.attention_linears();
      if (ffn) linears.insert(linears.end(), {ffn->w1.get(), ffn->w2.get(), ffn->w3.get()});
      // A float8 or MXFP8 linear's converter computes its product itself (its wrapper, outside this one, never calls
      // on): its backward defers its own weight gradient, by its recipe (nn/weight_gradients.h).
      for (auto* linear : linears) distributed::pipeline::defer_weight_gradient(*linear);
    }
  }

  const std::vector<int64_t> blocks = block_indices(part, n);
  if (dims.ep > 1) {
    // On a CPU a collapsed router could push one rank past its memory, where the kernel kills the process: the
    // dispatch checks the machine's spare memory first. (On a GPU an allocation that fails is an error already, and
    // free device memory leaves out what LibTorch's allocator holds in its cache.)
    std::function<double()> headroom;
    if (fsdp.device.is_cpu())
      headroom = [local = distributed::detect_launch().local_world_size] {
        return metrics::available_memory(at::Device(at::kCPU), local).bytes - static_cast<double>(metrics::current_rss_bytes());
      };
    distributed::ExpertParallel ep(mesh.get("ep"), model.args().moe->num_experts, headroom);
    for (int64_t i : blocks) {
      if (!model.layers[static_cast<size_t>(i)]->moe) continue;  // a dense block before the MoE ones
      auto& experts = *model.layers[static_cast<size_t>(i)]->moe->experts;
      ep.apply(cat("layers.", i, ".moe.experts"), experts, {experts.w1, experts.w2, experts.w3}, out.parameters);
      if (dims.tp > 1 && dims.etp == 1) distributed::split_routed_rows(experts, mesh.get("tp"));
    }
    out.description.push_back(ep.describe());
  }

  // MoE routing: each block's balancing bias is whole on every rank of its stage; the token counts are summed over the
  // ranks that route different tokens (data and context parallel: the "loss" group) before the optimizer step.
  std::vector<MoE*> moe_layers;
  std::vector<int64_t> moe_blocks;
  for (int64_t i : blocks) {
    auto& block = *model.layers[static_cast<size_t>(i)];
    if (!block.moe) continue;
    moe_layers.push_back(block.moe.get());
    moe_blocks.push_back(i);
    if (!block.moe->expert_bias.defined()) continue;
    distributed::TensorLayout layout(block.moe->expert_bias.sizes().vec());
    for (const char* dim : {"dp_replicate", "dp_shard", "cp", "tp"})
      if (const int64_t size = mesh.get(dim)->size(); size > 1)
        layout = layout.then(dim, size, mesh.coordinate(dim), Placement::replicate());
    const at::Tensor& bias = block.moe->expert_bias;
    out.buffers.push_back({cat("layers.", i, ".moe.expert_bias"), bias, bias, layout});
  }
  // Every part of a MoE model reports (the figures of all stages combine into the model's), even one with no MoE block.
  if (model.args().moe)
    out.before_optimizer_step = ModelPart::StepHook{
        [moe_layers, moe_blocks, n, group = mesh.get("loss")] { return update_expert_biases(moe_layers, moe_blocks, n, group.get()); },
        routing_health_scalars, routing_health_summary};

  auto ac = apply_activation_checkpointing(model, part, config.activation_checkpoint);
  out.description.push_back("Activation checkpointing: " + ac.description);

  if (dims.fsdp_enabled()) {
    const std::string& policy = fsdp.reshard_after_forward;
    // As torchtitan: "default" reshards after forward except under pipeline parallelism, where every micro-batch
    // would gather again (and the stage's gradients are reduced once per step anyway).
    const bool reshard = policy == "always" || (policy == "default" && dims.pp == 1);
    std::vector<distributed::FsdpUnitSpec> units;
    // Tied embeddings (Llama 3.2): the embedding's weight is the output projection's too, so embedding, norm and
    // output form one unit, gathered from the embedding's forward until the embedding's backward (the tied weight's
    // gradient sums both uses before it is reduced). A pipeline keeps them on one stage (plan_stages).
    const bool tied = model.args().tie_word_embeddings && part.contains(0);
    if (tied) {
      if (!part.contains(n + 2)) fail("tied embeddings need the embedding and the output projection in one model part");
      units.push_back({"tok_embeddings+norm+output", {model.tok_embeddings.get(), model.norm.get(), model.output.get()},
                       policy == "always"});
    } else if (part.contains(0)) {
      units.push_back({"tok_embeddings", {model.tok_embeddings.get()}, reshard});
    }
    std::vector<distributed::FsdpUnitSpec> expert_units;
    for (int64_t i : blocks) {
      auto& block = *model.layers[static_cast<size_t>(i)];
      units.push_back({"layers." + std::to_string(i), {&block}, reshard});
      if (dims.ep > 1 && block.moe) {
        // As torchtitan: each block's experts are a unit of their own, sharded over the efsdp ranks.
        expert_units.push_back({"layers." + std::to_string(i) + ".moe.experts", {block.moe->experts.get()}, reshard});
        units.back().excluded.push_back(block.moe->experts.get());
      }
    }
    // As torchtitan: norm + output are needed again right at the start of backward, so by default they stay gathered.
    std::vector<nn::Unit*> tail;
    if (part.contains(n + 1) && !tied) tail.push_back(model.norm.get());
    if (part.contains(n + 2) && !tied) tail.push_back(model.output.get());
    if (!tail.empty()) units.push_back({tail.size() == 2 ? "norm+output" : part.contains(n + 1) ? "norm" : "output", tail, policy == "always"});
    if (expert_units.empty()) {
      out.data_parallel = std::make_unique<distributed::Fsdp>(units, out.parameters, mesh.get("dp_shard_cp"), mesh.get("dp_replicate"), fsdp);
    } else {
      std::vector<std::unique_ptr<distributed::DataParallel>> members;
      members.push_back(std::make_unique<distributed::Fsdp>(units, out.parameters, mesh.get("dp_shard_cp"), mesh.get("dp_replicate"), fsdp));
      members.push_back(std::make_unique<distributed::Fsdp>(expert_units, out.parameters, mesh.get("efsdp"),
                                                            mesh.get("dp_replicate_experts"), fsdp));
      out.data_parallel = std::make_unique<distributed::DataParallelSet>(std::move(members));
    }
  } else {
    distributed::materialize(out.parameters);
    if (dims.ddp_enabled()) {
      auto group = mesh.get("dp_replicate");
      for (auto& param : out.parameters)
        param.layout = param.layout.then("dp_replicate", group->size(), group->rank(), Placement::replicate());
      out.data_parallel = std::make_unique<distributed::Ddp>(distributed::local_tensors(out.parameters), group);
    } else {
      out.data_parallel = std::make_unique<distributed::NoDataParallel>(distributed::local_tensors(out.parameters));
    }
  }
  out.description.push_back("Data parallelism: " + out.data_parallel->describe());
  // Between pipeline stages: the residual stream, each rank's part of every sequence (context parallelism's chunks,
  // and sequence parallelism's shard of those under TP), in the dtype the embedding computes in (FSDP's gathered
  // parameters; otherwise the parameters' own, autocast leaving the residual additions in it).
  const int64_t sequence_shards = dims.cp * dims.tp;
  const at::ScalarType residual = dims.fsdp_enabled() ? fsdp.param_dtype : fsdp.shard_dtype;
  out.input_shape = [sequence_shards, residual, dim = model.args().dim](int64_t rows, int64_t seq_len) {
    return std::pair{residual, std::vector<int64_t>{rows, seq_len / sequence_shards, dim}};
  };
  return out;
}

}  // namespace titan::models
