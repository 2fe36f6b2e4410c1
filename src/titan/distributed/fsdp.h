// FSDP (ZeRO-3) in the spirit of PyTorch's FSDP2, and HSDP on top of it (see fsdp.cpp).
#pragma once
#include <atomic>
#include <memory>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/data_parallel.h"
#include "titan/nn/torch_compat.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/nn/unit.h"

namespace titan::distributed {

// A group of modules whose parameters are gathered and resharded together (embedding, a block, norm + output).
struct FsdpUnitSpec {
  std::string name;
  std::vector<nn::Unit*> modules;  // in forward order
  bool reshard_after_forward = true;
  // Submodules whose parameters another FSDP instance shards (expert parallelism's experts, over other ranks).
  std::vector<const nn::Unit*> excluded = {};
};

class Fsdp final : public DataParallel {
 public:
  // `shard_group` shards parameters (dp_shard); `replicate_group` (dp_replicate, HSDP) all-reduces the reduced
  // shards; pass a single-rank communicator for plain FSDP. Each unit parameter's entry in `params` gets its
  // shard as `local` and Shard(0)@dp_shard (+ Replicate()@dp_replicate) appended to its layout. Parameters may be
  // on the meta device: shards are allocated on options.device and filled from the parameter only when it has
  // values.
  Fsdp(const std::vector<FsdpUnitSpec>& units, std::vector<ShardedParameter>& params, std::shared_ptr<Communicator> shard_group,
       std::shared_ptr<Communicator> replicate_group, const FsdpOptions& options);
  ~Fsdp() override;

  void before_backward(bool last_microbatch) override { last_microbatch_ = last_microbatch; }
  void after_backward() override;
  void finish_gradients() override;
  std::string describe() const override;
  int64_t bytes_communicated() const override;
  double wait_seconds() const override { return wait_seconds_; }

  void unshard_all() override;
  void reshard_all() override;
  void after_optimizer_step() override;
  // Bytes this rank has sent in parameter all-gathers, and of them in float8 all-gathers (one byte per element).
  int64_t bytes_gathered() const { return bytes_gathered_; }
  int64_t float8_bytes_gathered() const { return float8_bytes_gathered_; }

 private:
  struct Param {
    at::Tensor module_param;  // the model's parameter: full shape, param dtype, storage freed while sharded
    at::Tensor shard;         // this rank's rows, training dtype, padded: what the optimizer updates
    std::vector<int64_t> full_shape;
    // `offset`: in its unit's flat gradient buffer; `gather_offset`: in its unit's gather buffer, the float8 one
    // when `float8` is set (a float8 linear's weight, gathered in E4M3 into that slot), else the compute-dtype one.
    int64_t rows = 0, shard_rows = 0, row_numel = 1, offset = 0, gather_offset = 0;
    c10::intrusive_ptr<nn::float8::PrecastWeight> float8;
    at::Tensor float8_scale;  // precomputed after the last optimizer step (precompute_float8_dynamic_scale_for_fsdp)
    int64_t shard_numel() const { return shard_rows * row_numel; }
  };
  struct Pending {
    size_t unit;
    at::Tensor reduced;  // local flat gradient shard (reduce dtype)
    std::shared_ptr<Work> work;
    bool final = false;  // the step's last reduction of the unit: the listener hears of its shards once accumulated
  };
  struct Unit {
    std::string name;
    std::vector<Param> params;
    int64_t local_numel = 0;                     // per rank, all parameters
    int64_t gather_numel = 0, gather_numel8 = 0;  // per rank, in the compute-dtype and the float8 gather buffers
    bool reshard_after_forward = true;
    enum class State { Sharded, Gathering, Unsharded } state = State::Sharded;
    at::Tensor gathered, gathered8, scales8;
    std::shared_ptr<Work> gather_work, gather_work8;
    int64_t grads_ready = 0;
    bool reduced_this_backward = false;
  };

  void start_gather(size_t u);
  void unshard(size_t u);
  void reshard(size_t u);
  void pre_backward(size_t u);
  void on_gradient(size_t u);
  void reduce(size_t u);
  void accumulate(size_t count);  // waits for the first `count` pending reductions and adds them to shard gradients
  at::Tensor float8_scales(size_t u);  // the scales of unit u's float8 weights, in order
  void precompute_float8_scales();     // every float8 weight's scale, one all-reduce for all
  std::string float8_summary() const;

  std::vector<Unit> units_;
  std::shared_ptr<Communicator> shard_group_, replicate_group_;
  FsdpOptions options_;
  std::vector<nn::GradAccumulatorHandle> accumulators_;
  // Hooks and module wrappers live in the model, which may outlive this object: they check this flag, which the
  // destructor clears (gradient hooks then do nothing; a forward through the model is an error).
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
  std::vector<Pending> pending_;
  size_t earlier_pending_ = 0;  // pending_ entries from micro-batches before the current one
  double wait_seconds_ = 0;
  int64_t bytes_gathered_ = 0, float8_bytes_gathered_ = 0;
  bool float8_scales_fresh_ = false;  // the precomputed scales match the shards
  bool last_microbatch_ = true;
};

}  // namespace titan::distributed
