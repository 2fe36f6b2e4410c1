#include "titan/trainer/step_schedule.h"

#include "titan/common/error.h"
#include "titan/distributed/context_parallel.h"
#include "titan/nn/autocast.h"

namespace titan {
namespace {

class SingleStage : public StepSchedule {
 public:
  SingleStage(nn::Model& model, const protocols::ModelSpec& spec, const distributed::DeviceMesh& mesh,
              const config::JobConfig& config, const distributed::FsdpOptions& fsdp, std::optional<at::ScalarType> autocast_dtype,
              std::shared_ptr<distributed::ContextParallel> cp)
      : model_(model), cp_(std::move(cp)), autocast_dtype_(autocast_dtype),
        block_causal_(config.model.attn_mask_type == "block_causal"), device_(fsdp.device) {
    parts_.push_back(spec.parallelize(model, mesh, config, fsdp, distributed::ModuleRange::whole(model), false, cp_));
  }

  at::Tensor train(const std::vector<data::Batch>& microbatches, double global_valid, int64_t) override {
    auto& part = parts_.front();
    at::Tensor total = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
    for (size_t m = 0; m < microbatches.size(); ++m) {
      at::Tensor loss = loss_sum(microbatches[m]) / global_valid;
      part.data_parallel->before_backward(m + 1 == microbatches.size());
      loss.backward();
      part.data_parallel->after_backward();
      total += loss.detach();
    }
    return total;
  }

  void gather_loss(at::Tensor&) override {}
  void finish_gradients() override { parts_.front().finish_gradients(); }

  double evaluate(const data::Batch& batch) override {
    at::NoGradGuard no_grad;
    at::Tensor sum = loss_sum(batch).to(at::kDouble).reshape({1});
    if (cp_) cp_->group()->all_reduce(sum, distributed::ReduceOp::Sum);  // each CP rank has its chunks' share
    return sum.item<double>();
  }

  std::vector<distributed::ModelPart>& parts() override { return parts_; }
  std::vector<std::string> describe() const override { return parts_.front().description; }

 private:
  // The summed loss of one (micro-)batch: to the device, this rank's chunks of every sequence under context
  // parallelism (RoPE at their global positions), block-causal positions from the loader, under autocast
  // (torchtitan: single-device and DDP runs compute in training.mixed_precision_param through autocast).
  at::Tensor loss_sum(const data::Batch& batch) {
    const auto& part = parts_.front();
    at::Tensor inputs = to_device(batch.inputs), labels = to_device(batch.labels), positions, documents;
    if (cp_) {
      const int64_t seq_len = batch.inputs.size(1);
      if (seq_len > model_.max_seq_len())
        fail("sequence length ", seq_len, " exceeds the model's max_seq_len ", model_.max_seq_len(), " (training.seq_len)");
      positions = cp_->positions(seq_len, device_);
      inputs = cp_->shard(inputs, 1);
      labels = cp_->shard(labels, 1);
    }
    // Block-causal: the positions within documents of the whole sequences (under context parallelism too).
    if (block_causal_) documents = to_device(batch.positions);
    nn::AutocastRegion autocast(nn::AutocastState::enabled_for(device_.type(), autocast_dtype_));
    return part.loss_sum(model_.forward(inputs, positions, documents, part.loss_in_forward ? labels : at::Tensor()), labels);
  }

  at::Tensor to_device(const at::Tensor& t) const {
    // From pinned memory without waiting: a pageable copy waits for all the work queued on the device before it.
    if (device_.is_cpu()) return t;
    return t.pin_memory().to(device_, /*non_blocking=*/true);
  }

  nn::Model& model_;
  std::vector<distributed::ModelPart> parts_;
  std::shared_ptr<distributed::ContextParallel> cp_;  // the job's one ContextParallel (the attention's too), or null
  std::optional<at::ScalarType> autocast_dtype_;
  bool block_causal_;
  at::Device device_;
};

class Pipelined : public StepSchedule {
 public:
  Pipelined(nn::Model& model, const protocols::ModelSpec& spec, const protocols::ModelArgs& args,
            const distributed::DeviceMesh& mesh, const config::JobConfig& config, const distributed::FsdpOptions& fsdp,
            std::optional<at::ScalarType> autocast_dtype, const std::shared_ptr<distributed::ContextParallel>& cp)
      : pipeline_(model, args.layers(), spec.tied_embeddings(args),
                  [&spec, &config, cp](nn::Model& m, const distributed::DeviceMesh& mesh_, const distributed::FsdpOptions& options,
                                       const distributed::ModuleRange& part, bool split_backward) {
                    return spec.parallelize(m, mesh_, config, options, part, split_backward, cp);
                  },
                  mesh, config, fsdp, autocast_dtype, cp),
        pp_(mesh.get("pp")),
        cp_(mesh.dims().cp > 1 ? mesh.get("cp") : nullptr),
        block_causal_(config.model.attn_mask_type == "block_causal") {
    pipeline_.runner().record_timeline(config.debug.pipeline_timeline);
  }

  at::Tensor train(const std::vector<data::Batch>& microbatches, double global_valid, int64_t step) override {
    // The schedule runs each local batch's micro-batches through the stages; gradients are reduced once at the end.
    at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(pipeline_.device()));
    for (const auto& mb : microbatches)
      sum += pipeline_.train(mb.inputs, mb.labels, block_causal_ ? mb.positions : at::Tensor(), global_valid, step);
    return sum.reshape({1}).to(at::kFloat);  // the float64 sum rounded once, on the device
  }

  // The loss lives on the last stage's ranks and is summed over the pipeline. The fake backend's sum of copies would
  // be pp times this rank's: there the last stage's rank keeps its own and the others 0.
  void gather_loss(at::Tensor& loss_total) override {
    if (!pp_->simulated()) pp_->all_reduce(loss_total, distributed::ReduceOp::Sum);
  }

  void finish_gradients() override {
    for (auto& part : pipeline_.parts()) {
      // Nothing was synchronised during the interleaved backwards: DDP's last pass is now.
      part.data_parallel->before_backward(true);
      part.finish_gradients();
    }
  }

  double evaluate(const data::Batch& batch) override {
    at::NoGradGuard no_grad;
    at::Tensor sum = pipeline_.evaluate(batch.inputs, batch.labels, block_causal_ ? batch.positions : at::Tensor()).reshape({1});
    if (!pp_->simulated()) pp_->all_reduce(sum, distributed::ReduceOp::Sum);  // from the last stage's ranks (gather_loss)
    if (cp_) cp_->all_reduce(sum, distributed::ReduceOp::Sum);         // each CP rank has its chunks' share
    return sum.cpu().item<double>();
  }

  std::vector<distributed::ModelPart>& parts() override { return pipeline_.parts(); }
  distributed::pipeline::Pipeline* pipeline() override { return &pipeline_; }
  std::vector<std::string> describe() const override { return pipeline_.describe(); }

 private:
  distributed::pipeline::Pipeline pipeline_;
  std::shared_ptr<distributed::Communicator> pp_, cp_;
  bool block_causal_;
};

}  // namespace

std::unique_ptr<StepSchedule> make_step_schedule(nn::Model& model, const protocols::ModelSpec& spec,
                                                 const protocols::ModelArgs& args, const distributed::DeviceMesh& mesh,
                                                 const config::JobConfig& config, const distributed::FsdpOptions& fsdp,
                                                 std::optional<at::ScalarType> autocast_dtype) {
  // Context parallelism is built once: batches are cut and the attention runs over the same ContextParallel.
  std::shared_ptr<distributed::ContextParallel> cp;
  if (mesh.dims().cp > 1) {
    const auto& p = config.parallelism;
    cp = std::make_shared<distributed::ContextParallel>(mesh.get("cp"), distributed::parse_cp_load_balancer(p.context_parallel_load_balancer),
                                                        distributed::parse_cp_rotate_method(p.context_parallel_rotate_method));
  }
  if (mesh.dims().pp > 1) return std::make_unique<Pipelined>(model, spec, args, mesh, config, fsdp, autocast_dtype, cp);
  return std::make_unique<SingleStage>(model, spec, mesh, config, fsdp, autocast_dtype, cp);
}

}  // namespace titan
