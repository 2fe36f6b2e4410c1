// The fake backend: one process standing in for rank r of a larger job (communicator.h, make_fake_world).
#include <ATen/CPUGeneratorImpl.h>
#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/distributed/communicator.h"

namespace titan::distributed {
namespace {

// The operations' results under "every rank is a copy of this one". Bytes are counted as the real collective would
// send them, so the step's communication figures are the job's.
class FakeCommunicator final : public Communicator {
 public:
  FakeCommunicator(int rank, int size, at::Device device, std::string name) : rank_(rank), size_(size), device_(device) {
    name_ = std::move(name);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "fake (no communication)"; }
  at::Device tensor_device() const override { return device_; }
  bool globally_ordered() const override { return true; }
  void set_timeout(std::chrono::seconds) override {}
  int64_t bytes_communicated() const override { return bytes_.load(); }

  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op, bool) override {
    // size() equal values: their sum is size() times one; a bool sum (logical or), an average, a maximum or a
    // minimum is the value itself.
    if (op == ReduceOp::Sum && tensor.scalar_type() != at::kBool) tensor.mul_(size_);
    bytes_ += 2 * (size_ - 1) * static_cast<int64_t>(tensor.nbytes()) / size_;
    return completed_work();
  }
  std::shared_ptr<Work> all_gather_into(at::Tensor& output, const at::Tensor& input, bool) override {
    const int64_t n = input.numel();
    if (output.numel() != n * size_) fail("all_gather_into: output must hold size() * input.numel() elements");
    output.view({size_, n}).copy_(input.reshape({1, n}).expand({size_, n}));
    bytes_ += (size_ - 1) * static_cast<int64_t>(input.nbytes());
    return completed_work();
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op, bool) override {
    const int64_t n = output.numel();
    if (input.numel() != n * size_) fail("reduce_scatter: input must hold size() * output.numel() elements");
    output.view(-1).copy_(input.reshape(-1).narrow(0, rank_ * n, n));
    if (op == ReduceOp::Sum && output.scalar_type() != at::kBool) output.mul_(size_);
    bytes_ += (size_ - 1) * static_cast<int64_t>(output.nbytes());
    return completed_work();
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input, bool) override {
    if (output.numel() != input.numel() || input.numel() % size_ != 0)
      fail("all_to_all: output and input must hold the same number of elements, size() equal blocks");
    const int64_t n = input.numel() / size_;
    output.view({size_, n}).copy_(input.reshape(-1).narrow(0, rank_ * n, n).reshape({1, n}).expand({size_, n}));
    bytes_ += (size_ - 1) * n * static_cast<int64_t>(input.element_size());
    return completed_work();
  }
  std::shared_ptr<Work> all_to_all_v(at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                                     const std::vector<int64_t>& input_splits, bool) override {
    if (static_cast<int>(output_splits.size()) != size_ || static_cast<int>(input_splits.size()) != size_)
      fail("all_to_all_v: ", size_, " splits each way expected");
    int64_t in_offset = 0, out_total = 0, in_total = 0;
    for (int j = 0; j < size_; ++j) {
      if (j < rank_) in_offset += input_splits[static_cast<size_t>(j)];
      in_total += input_splits[static_cast<size_t>(j)];
      out_total += output_splits[static_cast<size_t>(j)];
    }
    if (input.numel() != in_total || output.numel() != out_total) fail("all_to_all_v: the splits do not add up to the tensors");
    // Every copy sends this rank what this rank sends itself. Where a block's length differs (the return trip of
    // expert parallelism: the rows this rank sent to rank j come back, computed by j's experts, which this process
    // does not run), the block is filled from the same rows repeated or cut to its length, zeros when there are none.
    const at::Tensor own = input.reshape(-1).narrow(0, in_offset, input_splits[static_cast<size_t>(rank_)]);
    at::Tensor out = output.view(-1);
    for (int64_t i = 0, offset = 0; i < size_; offset += output_splits[static_cast<size_t>(i)], ++i) {
      const int64_t length = output_splits[static_cast<size_t>(i)];
      at::Tensor block = out.narrow(0, offset, length);
      if (own.numel() == 0) {
        block.zero_();
      } else {
        for (int64_t at = 0; at < length; at += own.numel()) {
          const int64_t n = std::min(own.numel(), length - at);
          block.narrow(0, at, n).copy_(own.narrow(0, 0, n));
        }
      }
    }
    for (int j = 0; j < size_; ++j)  // what goes to other ranks
      if (j != rank_) bytes_ += input_splits[static_cast<size_t>(j)] * static_cast<int64_t>(input.element_size());
    return completed_work();
  }
  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root, bool) override {
    check_peer(root, "broadcast root");
    if (root == rank_) bytes_ += static_cast<int64_t>(tensor.nbytes());
    return completed_work();
  }
  std::shared_ptr<Work> send(const at::Tensor& tensor, int destination, int, bool) override {
    check_peer(destination, "send destination");
    bytes_ += static_cast<int64_t>(tensor.nbytes());
    return completed_work();
  }
  bool simulated() const override { return true; }
  std::shared_ptr<Work> recv(at::Tensor& tensor, int source, int, bool) override {
    // What a pipeline neighbour sends is computed from what it received, not a copy of anything this rank sends:
    // stand-in values of the shape the caller expects, the same on every run, drawn in place (no buffer beside the
    // message, whose memory the dry run measures) from this communicator's own generator on the tensor's device,
    // leaving the process's random streams alone.
    check_peer(source, "receive source");
    if (!at::isFloatingType(tensor.scalar_type())) {
      tensor.zero_();
      return completed_work();
    }
    std::lock_guard<std::mutex> lock(generator_mutex_);
    const auto dtype = tensor.scalar_type();
    at::Generator* generator = in_place_generator(tensor.device());
    if (generator && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble)) {
      tensor.normal_(0.0, 1.0, *generator);
    } else {
      // Another device (a ROCm build's) or dtype (float8, which has no normal_): drawn on the CPU and copied over.
      tensor.copy_(at::empty(tensor.sizes(), at::kFloat).normal_(0.0, 1.0, cpu_generator_));
    }
    return completed_work();
  }
  std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool) override {
    check_peer(destination, "send_recv destination");
    check_peer(source, "send_recv source");
    if (recv.numel() != send.numel()) fail("send_recv on the fake backend: ", send.numel(), " elements sent, ", recv.numel(), " received");
    recv.view(-1).copy_(send.reshape(-1));  // the previous rank, a copy of this one, sends what this one sends
    bytes_ += static_cast<int64_t>(send.nbytes());
    return completed_work();
  }
  void barrier() override {}
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name, int size = 0) override {
    if (color < 0) return nullptr;
    if (size < 1)
      fail("internal: split ", quote(name), " on the fake backend needs the size of the group it makes (there are no other "
           "ranks to ask)");
    if (key < 0 || key >= size) fail("internal: split ", quote(name), ": key ", key, " is not a rank among ", size);
    return std::make_shared<FakeCommunicator>(key, size, device_, name);
  }

 private:
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_) fail(what, " ", peer, " is not a rank of ", quote(name_), " (", size_, " ranks)");
  }

  int rank_, size_;
  at::Device device_;
  std::atomic<int64_t> bytes_{0};  // operations may come from more than one thread
  static constexpr uint64_t kStandInSeed = 20261201;
  // A generator of this communicator's own that draws in place on `device`, or null: the CPU's, or (built with
  // CUDA) one per communicator for its CUDA device.
  at::Generator* in_place_generator(const at::Device& device) {
    if (device.is_cpu()) return &cpu_generator_;
#ifdef TITAN_WITH_CUDA
    if (device.is_cuda()) {
      if (!device_generator_.defined()) {
        device_generator_ = at::cuda::detail::createCUDAGenerator(device.has_index() ? device.index() : 0);
        device_generator_.set_current_seed(kStandInSeed);
      }
      return &device_generator_;
    }
#endif
    return nullptr;
  }
  std::mutex generator_mutex_;
  at::Generator cpu_generator_ = at::make_generator<at::CPUGeneratorImpl>(kStandInSeed);
  at::Generator device_generator_;  // created on the first receive into CUDA memory
};

int positive_env(const char* name, const char* what) {
  const char* v = std::getenv(name);
  if (!v || !*v) fail("comm.mode = \"fake_backend\" needs ", name, " (", what, "), as torchtitan's dry run does: for example ",
                      name, "=8");
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > (1 << 24))
    fail("comm.mode = \"fake_backend\": ", name, "=", v, " is not a whole number from 0 to ", 1 << 24, " (", what, ")");
  return static_cast<int>(x);
}

}  // namespace

LaunchInfo fake_launch() {
  // A launcher that started several processes (inside a SLURM allocation's shell, SLURM_NTASKS is set without srun:
  // only a job step's own count counts).
  for (const auto& [variable, launcher] : {std::pair{"OMPI_COMM_WORLD_SIZE", "mpirun"}, std::pair{"SLURM_STEP_NUM_TASKS", "srun"},
                                           std::pair{"WORLD_SIZE", "torchrun"}}) {
    const char* v = std::getenv(variable);
    if (v && std::atoi(v) > 1)
      fail("comm.mode = \"fake_backend\" runs one process standing in for one rank of NGPU; ", launcher, " started ", v,
           " (", variable, "): run titan alone (NGPU=", v, " RANK=r titan train ...)");
  }
  LaunchInfo info;
  info.launcher = "fake_backend";
  info.world_size = positive_env("NGPU", "the number of ranks to simulate");
  if (info.world_size < 1) fail("comm.mode = \"fake_backend\": NGPU=0: at least one rank is needed");
  info.rank = std::getenv("RANK") && *std::getenv("RANK") ? positive_env("RANK", "the rank to play") : 0;
  if (info.rank >= info.world_size)
    fail("comm.mode = \"fake_backend\": RANK=", info.rank, " is not a rank of NGPU=", info.world_size, " (0 to ",
         info.world_size - 1, ")");
  return info;
}

std::shared_ptr<Communicator> make_fake_world(int rank, int size, at::Device device) {
  if (size < 1 || rank < 0 || rank >= size) fail("internal: fake rank ", rank, " of ", size);
  return std::make_shared<FakeCommunicator>(rank, size, device, "world");
}

}  // namespace titan::distributed
