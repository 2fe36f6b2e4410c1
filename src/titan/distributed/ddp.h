// DDP: replicated parameters with bucketed, backward-overlapped gradient all-reduce (see ddp.cpp).
#pragma once
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <memory>

#include "titan/distributed/communicator.h"
#include "titan/distributed/data_parallel.h"
#include "titan/nn/torch_compat.h"

namespace titan::distributed {

class Ddp final : public DataParallel {
 public:
  // Bucket sizes as PyTorch's DDP: a small first bucket so communication starts early, then 25 MiB. Replicas must
  // start equal: titan's initialisation is the same on every rank (nn/init.h), as is a loaded checkpoint, so no
  // parameter broadcast is needed.
  Ddp(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group, int64_t first_bucket_bytes = 1 << 20,
      int64_t bucket_bytes = 25 << 20);

  void before_backward(bool last_microbatch) override;
  void finish_gradients() override;
  std::string describe() const override;
  int64_t bytes_communicated() const override;
  double wait_seconds() const override { return wait_seconds_; }
  ~Ddp() override;

 private:
  struct Bucket {
    std::vector<int64_t> params;   // indices into params_
    std::vector<int64_t> offsets;  // element offsets in the flat buffer
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
    int64_t ready = 0;
    bool launched = false;
    at::Tensor buffer;
    std::shared_ptr<Work> work;
  };
  void on_gradient_ready(int64_t index);
  void launch_ready();
  void launch(Bucket& bucket);
  void wait(Bucket& bucket);  // its all-reduce, whose result then becomes its parameters' gradients

  std::vector<at::Tensor> params_;
  std::shared_ptr<Communicator> group_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;
  std::vector<nn::GradAccumulatorHandle> accumulators_;  // keeps the hooked accumulators alive
  // The hooks live in the parameters' autograd nodes, which may outlive this object: they check this flag, which
  // the destructor clears, instead of calling into a destroyed Ddp.
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
  size_t next_bucket_ = 0;
  bool sync_ = false;
  double wait_seconds_ = 0;
};

}  // namespace titan::distributed
