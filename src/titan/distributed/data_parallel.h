// Data parallelism applied to a built model from outside: DDP (replicated weights, bucketed gradient all-reduce
// overlapped with backward), FSDP (ZeRO-3 sharding) and HSDP (sharded within a group, replicated across groups).
// The trainer talks to all of them through this interface; which tensors the optimizer updates and how they lie
// in the global parameters is in the ShardedParameter list the wrappers update.
#pragma once
#include <ATen/ATen.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/nn/float8.h"

namespace titan::distributed {

// Told, during the step's last backward, which local tensors (ShardedParameter::local) hold their final gradient
// for the step (optimizer.early_step_in_backward steps them there). What it is not told of is final after
// finish_gradients().
using GradientListener = std::function<void(const std::vector<at::Tensor>& locals)>;

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  virtual void set_gradient_listener(GradientListener listener) { listener_ = std::move(listener); }
  // Called before each micro-batch's backward; gradients are synchronised during the last one.
  virtual void before_backward(bool last_microbatch) = 0;
  // Called after each micro-batch's backward returns.
  virtual void after_backward() {}
  // After the last backward of a step: waits for outstanding communication and leaves final local gradients on
  // the ShardedParameters' local tensors.
  virtual void finish_gradients() = 0;
  virtual std::string describe() const = 0;
  // Bytes sent into collectives by this rank so far, summed over the groups data parallelism uses.
  virtual int64_t bytes_communicated() const = 0;
  // Seconds the training thread spent blocked on data-parallel communication (parameter gathers, gradient
  // reductions), for the step-time breakdown.
  virtual double wait_seconds() const = 0;
  // Collective: make the model's parameters hold their full values (FSDP gathers them), and release them again.
  virtual void unshard_all() {}
  virtual void reshard_all() {}
  // Called after every optimizer step (FSDP precomputes its float8 scales there).
  virtual void after_optimizer_step() {}

 protected:
  GradientListener listener_;
};

// One data-parallel rank: gradients are final after backward, each one as soon as autograd has accumulated it in
// the last micro-batch (the listener hears of it there).
class NoDataParallel final : public DataParallel {
 public:
  explicit NoDataParallel(std::vector<at::Tensor> parameters = {}) : params_(std::move(parameters)) {}
  ~NoDataParallel() override;
  void set_gradient_listener(GradientListener listener) override;
  void before_backward(bool last_microbatch) override { last_microbatch_ = last_microbatch; }
  void finish_gradients() override {}
  std::string describe() const override { return "no data parallelism (one data-parallel rank)"; }
  int64_t bytes_communicated() const override { return 0; }
  double wait_seconds() const override { return 0; }

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::shared_ptr<void>> accumulators_;  // keeps the hooked gradient accumulators alive
  // The hooks live in the parameters' autograd nodes, which may outlive this object: they check this flag.
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
  bool last_microbatch_ = false;
};

// Several data parallelisms over disjoint parameters (expert parallelism: FSDP of the experts over the efsdp ranks
// beside FSDP of everything else over dp_shard x cp), driven as one.
class DataParallelSet final : public DataParallel {
 public:
  explicit DataParallelSet(std::vector<std::unique_ptr<DataParallel>> members) : members_(std::move(members)) {}
  void set_gradient_listener(GradientListener listener) override {
    for (auto& m : members_) m->set_gradient_listener(listener);
  }
  void before_backward(bool last) override { for (auto& m : members_) m->before_backward(last); }
  void after_backward() override { for (auto& m : members_) m->after_backward(); }
  void finish_gradients() override { for (auto& m : members_) m->finish_gradients(); }
  std::string describe() const override {
    std::string out;
    for (const auto& m : members_) out += (out.empty() ? "" : "; ") + m->describe();
    return out;
  }
  int64_t bytes_communicated() const override {
    int64_t n = 0;
    for (const auto& m : members_) n += m->bytes_communicated();
    return n;
  }
  double wait_seconds() const override {
    double s = 0;
    for (const auto& m : members_) s += m->wait_seconds();
    return s;
  }
  void unshard_all() override { for (auto& m : members_) m->unshard_all(); }
  void reshard_all() override { for (auto& m : members_) m->reshard_all(); }
  void after_optimizer_step() override { for (auto& m : members_) m->after_optimizer_step(); }
  const std::vector<std::unique_ptr<DataParallel>>& members() const { return members_; }

 private:
  std::vector<std::unique_ptr<DataParallel>> members_;
};

struct FsdpOptions {
  at::Device device = at::kCPU;               // where shards live (parameters may still be on the meta device)
  at::ScalarType shard_dtype = at::kFloat;    // the shards the optimizer updates (training.dtype)
  at::ScalarType param_dtype = at::kFloat;    // all-gather and compute dtype (training.mixed_precision_param)
  at::ScalarType reduce_dtype = at::kFloat;   // gradient reduce-scatter dtype (training.mixed_precision_reduce)
  std::string reshard_after_forward = "default";  // parallelism.fsdp_reshard_after_forward
  // Pipeline parallelism: gradients accumulate unsharded over all micro-batches (whose backwards interleave, and
  // may be split into input and weight steps) and are reduce-scattered once, in finish_gradients().
  bool defer_gradient_reduction = false;
  // Float8 all-gathers (quantize.linear.float8.enable_fsdp_float8_all_gather): the float8 linears' weights, each
  // with the slot its linear reads (nn/float8.h). Each rank casts its shard to E4M3 with the scale of the whole
  // weight (the amax all-reduced over the shard group, or precomputed after the optimizer step), the gather moves
  // one byte per element, and the gathered float8 weight serves the forward and the input gradient; the model's
  // parameter itself is never gathered.
  struct Float8AllGather {
    std::map<const c10::TensorImpl*, c10::intrusive_ptr<nn::float8::PrecastWeight>> weights;
    bool precompute_scales = false;  // quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
    // Under tensor parallelism each rank holds a TP shard of a weight: its amax is reduced over this group too,
    // so the scale is the whole weight's.
    std::shared_ptr<Communicator> tp_group;
  };
  std::shared_ptr<const Float8AllGather> float8;
};

}  // namespace titan::distributed
