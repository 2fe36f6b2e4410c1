#include "titan/distributed/pipeline/stages.h"

#include <map>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/nn/autocast.h"

namespace titan::distributed::pipeline {


std::vector<std::vector<std::string>> split_module_names(int64_t stages, int64_t n_layers, int64_t input_weight, int64_t output_weight) {
  std::vector<std::vector<std::string>> out;
  if (stages < 1) fail("a pipeline needs at least one stage, got ", stages);
  if (stages == 1) {
    out.push_back({"tok_embeddings"});
    for (int64_t i = 0; i < n_layers; ++i) out.back().push_back("layers." + std::to_string(i));
    out.back().push_back("norm");
    out.back().push_back("output");
    return out;
  }
  const int64_t effective = n_layers + input_weight + output_weight;
  const std::string numbers = cat(stages, " pipeline stages over ", n_layers, " layers with the embedding counted as ", input_weight,
                                  " (parallelism.pipeline_parallel_first_stage_less_layers) and norm + output as ", output_weight,
                                  " (parallelism.pipeline_parallel_last_stage_less_layers)");
  if (stages > effective) fail(numbers, ": more stages than the ", effective, " effective layers; use fewer stages");
  const int64_t per_stage = effective / stages, extra = effective % stages;
  if (input_weight > per_stage || output_weight > per_stage)
    fail(numbers, ": a stage gets ", per_stage, " effective layers, fewer than the embedding's or the output's weight; "
         "lower the weights or use fewer stages");
  int64_t layer = 0;
  for (int64_t s = 0; s < stages; ++s) {
    std::vector<std::string> names;
    int64_t budget = per_stage + (s < extra ? 1 : 0);
    if (s == 0) names.push_back("tok_embeddings"), budget -= input_weight;
    if (s == stages - 1) budget -= output_weight;
    for (int64_t k = 0; k < budget && layer < n_layers; ++k) names.push_back("layers." + std::to_string(layer++));
    if (s == stages - 1) names.push_back("norm"), names.push_back("output");
    out.push_back(std::move(names));
  }
  return out;
}

StagePlan plan_stages(int64_t n_layers, bool tied_embeddings, const config::JobConfig& config, int64_t pp) {
  const auto& p = config.parallelism;
  const auto traits = schedule_traits(p.pipeline_parallel_schedule);
  StagePlan plan;
  plan.schedule = traits.name;
  plan.v_shape = traits.v_shape;
  const int64_t n = n_layers, input_weight = p.pipeline_parallel_first_stage_less_layers,
                output_weight = p.pipeline_parallel_last_stage_less_layers;
  int64_t stages = 0;
  const std::string per_rank_rule = traits.single_stage ? "exactly 1 stage per rank"
                                    : traits.v_shape    ? "exactly 2 stages per rank (a V)"
                                                        : "at least 2 stages per rank";
  if (p.module_fqns_per_model_part) {
    stages = static_cast<int64_t>(p.module_fqns_per_model_part->size());
    for (const auto& names : *p.module_fqns_per_model_part) plan.names.push_back(names);
  } else if (p.pipeline_parallel_layers_per_stage) {
    const int64_t per_stage = *p.pipeline_parallel_layers_per_stage;
    stages = (n + input_weight + output_weight + per_stage - 1) / per_stage;
  } else {
    stages = pp * (traits.single_stage ? 1 : 2);
  }
  const std::string origin = p.module_fqns_per_model_part
                                 ? std::string("parallelism.module_fqns_per_model_part")
                                 : cat("parallelism.pipeline_parallel_layers_per_stage = ", p.pipeline_parallel_layers_per_stage.value_or(0));
  if (stages % pp != 0)
    fail(origin, " gives ", stages, " pipeline stages",
         p.module_fqns_per_model_part ? std::string()
                                      : cat(" (", n, " layers + ", input_weight, " + ", output_weight, " for embedding and output)"),
         ", which do not divide over pipeline_parallel_degree = ", pp);
  plan.stages_per_rank = stages / pp;
  if (traits.single_stage ? plan.stages_per_rank != 1 : traits.v_shape ? plan.stages_per_rank != 2 : plan.stages_per_rank < 2)
    fail("parallelism.pipeline_parallel_schedule = ", quote(traits.name), " runs ", per_rank_rule, "; ", origin, " gives ", stages,
         " stages over ", pp, " ranks (", plan.stages_per_rank, " per rank)");
  if (plan.names.empty()) plan.names = split_module_names(stages, n, input_weight, output_weight);

  // Every module once, in forward order, each stage a non-empty run of it.
  const std::vector<std::string> order = [&] {
    std::vector<std::string> o = {"tok_embeddings"};
    for (int64_t i = 0; i < n; ++i) o.push_back("layers." + std::to_string(i));
    o.push_back("norm");
    o.push_back("output");
    return o;
  }();
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < order.size(); ++i) index[order[i]] = static_cast<int64_t>(i);
  std::map<std::string, int64_t> stage_of;
  int64_t next = 0;
  for (int64_t s = 0; s < stages; ++s) {
    const auto& names = plan.names[static_cast<size_t>(s)];
    if (names.empty()) fail("parallelism.module_fqns_per_model_part: stage ", s, " has no modules");
    for (const auto& name : names) {
      auto it = index.find(name);
      if (it == index.end())
        fail("parallelism.module_fqns_per_model_part: stage ", s, " names ", quote(name), ", which is not a module of this ", n,
             "-layer model (did you mean ", quote(closest_match(name, order)), "?); modules are tok_embeddings, layers.0 .. layers.",
             n - 1, ", norm, output");
      if (auto [other, fresh] = stage_of.emplace(name, s); !fresh)
        fail("parallelism.module_fqns_per_model_part: ", quote(name), " is in stage ", other->second, " and again in stage ", s);
      if (it->second != next)
        fail("parallelism.module_fqns_per_model_part: stage ", s, " lists ", quote(name), " where ", quote(order[static_cast<size_t>(next)]),
             " comes next in the forward order; stages must hold consecutive modules, in order");
      ++next;
    }
    plan.ranges.push_back(ModuleRange{next - static_cast<int64_t>(names.size()), next});
  }
  if (next != static_cast<int64_t>(order.size()))
    fail("parallelism.module_fqns_per_model_part leaves out ", quote(order[static_cast<size_t>(next)]), " and what follows it; every module must be in a stage");
  if (tied_embeddings && stage_of.at("tok_embeddings") != stage_of.at("output"))
    fail("the model ties the output to the embedding (model.flavor ", quote(config.model.flavor),
         config.model.tie_word_embeddings ? " with model.tie_word_embeddings" : "", "), which then must share a pipeline stage; "
         "they are in stages ", stage_of.at("tok_embeddings"), " and ", stage_of.at("output"),
         ". titan's pipeline stages do not share parameters: train an untied model under pipeline parallelism");

  const int64_t mb = p.pipeline_parallel_microbatch_size, batch = config.training.local_batch_size;
  if (batch % mb != 0)
    fail("training.local_batch_size = ", batch, " does not divide into micro-batches of parallelism.pipeline_parallel_microbatch_size = ", mb);
  plan.microbatches = batch / mb;
  if (config.validation.enable && config.validation.local_batch_size % mb != 0)
    fail("validation.local_batch_size = ", config.validation.local_batch_size,
         " does not divide into micro-batches of parallelism.pipeline_parallel_microbatch_size = ", mb);
  // Building the schedule checks its micro-batch rule and that it runs (no deadlock).
  plan.actions = p.pipeline_parallel_schedule_csv && !p.pipeline_parallel_schedule_csv->empty()
                     ? Schedule::from_csv(*p.pipeline_parallel_schedule_csv, static_cast<int>(pp), static_cast<int>(stages),
                                          static_cast<int>(plan.microbatches), traits.v_shape)
                     : Schedule::make(traits.name, static_cast<int>(pp), static_cast<int>(stages), static_cast<int>(plan.microbatches));
  plan.split_backward = plan.actions->splits_backward();
  return plan;
}

Pipeline::Pipeline(nn::Model& model, int64_t n_layers, bool tied_embeddings, const ParallelizeFunction& parallelize,
                   const DeviceMesh& mesh, const config::JobConfig& config, const FsdpOptions& fsdp,
                   std::optional<at::ScalarType> autocast_dtype, std::shared_ptr<ContextParallel> cp)
    : model_(model), autocast_dtype_(autocast_dtype), cp_(std::move(cp)), device_(fsdp.device) {
  const auto& p = config.parallelism;
  const int pp = static_cast<int>(mesh.dims().pp);
  plan_ = plan_stages(n_layers, tied_embeddings, config, pp);
  const Schedule& schedule = *plan_.actions;
  microbatch_size_ = p.pipeline_parallel_microbatch_size;
  if (mesh.dims().cp > 1 && !cp_) fail("internal: a pipeline under context parallelism needs its ContextParallel");
  FsdpOptions options = fsdp;
  options.defer_gradient_reduction = true;
  std::vector<Stage> runner_stages;
  for (int stage : schedule.stages_of(static_cast<int>(mesh.coordinate("pp")))) {
    parts_.push_back(parallelize(model, mesh, options, plan_.ranges[static_cast<size_t>(stage)], plan_.split_backward));
    stage_of_part_.push_back(stage);
    const ModuleRange range = plan_.ranges[static_cast<size_t>(stage)];
    // The last stage's forward returns the loss itself under the fused output projection and loss.
    const bool loss_in_forward = parts_.back().loss_in_forward && range.end == model.module_count();
    runner_stages.push_back({stage, [this, range, loss_in_forward](const at::Tensor& input, int m) {
                               nn::AutocastRegion autocast(nn::AutocastState::enabled_for(device_.type(), autocast_dtype_));
                               const auto idx = static_cast<size_t>(m);
                               return model_.forward_modules(range.begin == 0 ? tokens_[idx] : input, range.begin, range.end, seq_len_,
                                                             rope_positions_, positions_.empty() ? at::Tensor() : positions_[idx],
                                                             loss_in_forward ? labels_[idx] : at::Tensor());
                             }});
    if (const size_t k = parts_.size() - 1; parts_[k].input_shape)
      runner_stages.back().input_shape = [this, k] { return parts_[k].input_shape(microbatch_size_, seq_len_); };
  }
  runner_ = std::make_unique<PipelineRunner>(schedule, std::move(runner_stages), mesh.get("pp"), device_);
}

void Pipeline::set_batch(const at::Tensor& tokens, const at::Tensor& labels, const at::Tensor& document_positions, int64_t size) {
  seq_len_ = tokens.size(1);
  if (cp_) {
    // Context parallelism: this rank's chunks of every sequence, RoPE at their global positions.
    tokens_ = cp_->shard(tokens.to(device_), 1).split(size, 0);
    labels_ = cp_->shard(labels.to(device_), 1).split(size, 0);
    rope_positions_ = cp_->positions(seq_len_, device_);
    // Block-causal: the documents of the whole sequences, which context parallelism's attention masks by.
    positions_.clear();
    if (document_positions.defined()) positions_ = document_positions.to(device_).split(size, 0);
    return;
  }
  tokens_ = tokens.to(device_).split(size, 0);
  labels_ = labels.to(device_).split(size, 0);
  positions_.clear();
  if (document_positions.defined()) positions_ = document_positions.to(device_).split(size, 0);
}

at::Tensor Pipeline::train(const at::Tensor& tokens, const at::Tensor& labels, const at::Tensor& document_positions,
                           double global_valid, int64_t step) {
  set_batch(tokens, labels, document_positions, microbatch_size_);
  // Every pipeline rank sees the same batch shapes, so all of them decide this alike.
  if (seq_len_ != trained_seq_len_) runner_->activation_shapes_may_change();
  trained_seq_len_ = seq_len_;
  const ModelPart& last = parts_.back();  // only used on the rank holding the last stage, whose part is its last
  return runner_->train(
      [&](const at::Tensor& output, int m) {
        nn::AutocastRegion autocast(nn::AutocastState::enabled_for(device_.type(), autocast_dtype_));
        return last.loss_sum(output, labels_[static_cast<size_t>(m)]) / global_valid;
      },
      step);
}

at::Tensor Pipeline::evaluate(const at::Tensor& tokens, const at::Tensor& labels, const at::Tensor& document_positions) {
  set_batch(tokens, labels, document_positions, microbatch_size_);
  const ModelPart& last = parts_.back();
  return runner_->evaluate(
      [&](const at::Tensor& output, int m) {
        nn::AutocastRegion autocast(nn::AutocastState::enabled_for(device_.type(), autocast_dtype_));
        return last.loss_sum(output, labels_[static_cast<size_t>(m)]);
      },
      static_cast<int>(tokens_.size()));
}

std::vector<std::string> Pipeline::describe() const {
  const auto& s = runner_->schedule();
  std::vector<std::string> out;
  out.push_back(cat("Pipeline parallelism over ", s.pp(), " ranks: schedule ", s.name(), ", ", s.stages(), " stages (",
                    plan_.stages_per_rank, " per rank), ", s.microbatches(), " micro-batches of ", microbatch_size_,
                    " per local batch; simulated bubble ", strprintf("%.1f%%", 100.0 * s.simulate().bubble),
                    plan_.split_backward ? "; backward split into input and weight steps" : "",
                    s.name() == "DualPipeV"
                        ? "; each forward/backward pair runs one after the other (no expert-parallel overlap), so the "
                          "bubble is ZBVZeroBubble's with one micro-batch more in flight"
                        : ""));
  for (size_t k = 0; k < stage_of_part_.size(); ++k) {
    const auto& names = plan_.names[static_cast<size_t>(stage_of_part_[k])];
    out.push_back(cat("  stage ", stage_of_part_[k], " on this rank: ", names.front(), names.size() > 1 ? " .. " + names.back() : "",
                      " (", names.size(), " modules)"));
    for (const auto& line : parts_[k].description) out.push_back("    " + line);
  }
  return out;
}

}  // namespace titan::distributed::pipeline
