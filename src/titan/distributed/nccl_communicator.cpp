// The NCCL backend for CUDA tensors. Operations run on a communication stream that first waits for the caller's
// current stream; Work::wait() makes the caller's stream wait for the operation (no host blocking). The unique id
// is shared over an existing communicator (MPI) or a TCP store at MASTER_ADDR:MASTER_PORT (torchrun-style).
#include "titan/distributed/communicator.h"

#include "titan/common/error.h"

#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>

#include "titan/common/strings.h"
#endif

namespace titan::distributed {

#ifdef TITAN_WITH_CUDA
namespace {

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress) throw std::runtime_error(cat(what, " failed: ", ncclGetErrorString(r)));
}

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte:
    case at::kBool: return ncclUint8;
    default: fail("the NCCL backend cannot communicate tensors of dtype ", c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// Holds only an event: the tensors' memory is protected by recordStream on the communication stream, so buffers
// are freed (for reuse after the operation) as soon as the caller drops them.
class NcclWork final : public Work {
 public:
  explicit NcclWork(std::string what) : what_(std::move(what)), started_(std::chrono::steady_clock::now()) {}
  void wait() override {
    TITAN_COMM_RANGE("wait");
    done_.block(at::cuda::getCurrentCUDAStream(device_));
  }
  bool completed() override { return done_.query(); }
  at::cuda::CUDAEvent done_;
  c10::DeviceIndex device_ = 0;
  std::string what_;
  std::chrono::steady_clock::time_point started_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, c10::DeviceIndex device, std::string name)
      : comm_(comm), rank_(rank), size_(size), device_(device),
        stream_(at::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {
    name_ = std::move(name);
    watchdog_ = std::thread([this] { watch(); });
  }
  ~NcclCommunicator() override {
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  void set_timeout(std::chrono::seconds t) override { timeout_seconds_ = t.count(); }
  int64_t bytes_communicated() const override { return bytes_; }
  at::Device tensor_device() const override { return at::Device(at::kCUDA, device_); }

  std::shared_ptr<Work> all_reduce(at::Tensor& t, ReduceOp op, bool async) override {
    TITAN_COMM_RANGE("all_reduce");
    bytes_ += 2 * (size_ - 1) * static_cast<int64_t>(t.nbytes()) / std::max(size_, 1);  // ring volume
    return launch({t}, "all_reduce", async, [&](cudaStream_t s) {
      check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), nccl_op(op), comm_, s), "ncclAllReduce");
    });
  }
  std::shared_ptr<Work> all_gather_into(at::Tensor& out, const at::Tensor& in, bool async) override {
    TITAN_COMM_RANGE("all_gather_into");
    if (out.numel() != in.numel() * size_) fail("all_gather_into: output must hold ", size_, " x ", in.numel(), " elements");
    bytes_ += static_cast<int64_t>(in.nbytes()) * (size_ - 1);
    return launch({out, in}, "all_gather", async, [&](cudaStream_t s) {
      check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()), comm_, s), "ncclAllGather");
    });
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op, bool async) override {
    TITAN_COMM_RANGE("reduce_scatter");
    if (in.numel() != out.numel() * size_) fail("reduce_scatter: input must hold ", size_, " x ", out.numel(), " elements");
    bytes_ += static_cast<int64_t>(out.nbytes()) * (size_ - 1);
    return launch({out, in}, "reduce_scatter", async, [&](cudaStream_t s) {
      check(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()), nccl_op(op), comm_, s),
            "ncclReduceScatter");
    });
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& out, const at::Tensor& in, bool async) override {
    TITAN_COMM_RANGE("all_to_all");
    if (out.numel() != in.numel() || in.numel() % size_ != 0) fail("all_to_all: input and output must hold ", size_, " equal blocks");
    bytes_ += static_cast<int64_t>(in.nbytes()) * (size_ - 1) / size_;
    return launch({out, in}, "all_to_all", async, [&](cudaStream_t s) {
      // NCCL has no all-to-all call: one grouped send and receive per peer.
      const size_t block = static_cast<size_t>(in.numel() / size_);
      const size_t bytes = block * in.element_size();
      const auto type = nccl_type(in.scalar_type());
      check(ncclGroupStart(), "ncclGroupStart");
      for (int peer = 0; peer < size_; ++peer) {
        check(ncclSend(static_cast<const char*>(in.data_ptr()) + peer * bytes, block, type, peer, comm_, s), "ncclSend");
        check(ncclRecv(static_cast<char*>(out.data_ptr()) + peer * bytes, block, type, peer, comm_, s), "ncclRecv");
      }
      check(ncclGroupEnd(), "ncclGroupEnd");
    });
  }
  std::shared_ptr<Work> broadcast(at::Tensor& t, int root, bool async) override {
    TITAN_COMM_RANGE("broadcast");
    if (rank_ == root) bytes_ += static_cast<int64_t>(t.nbytes());
    return launch({t}, "broadcast", async, [&](cudaStream_t s) {
      check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), root, comm_, s), "ncclBroadcast");
    });
  }
  std::shared_ptr<Work> send(const at::Tensor& t, int destination, int, bool async) override {
    TITAN_COMM_RANGE("send");
    bytes_ += static_cast<int64_t>(t.nbytes());
    return launch({t}, "send", async, [&](cudaStream_t s) {
      check(ncclSend(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), destination, comm_, s), "ncclSend");
    });
  }
  std::shared_ptr<Work> recv(at::Tensor& t, int source, int, bool async) override {
    TITAN_COMM_RANGE("recv");
    return launch({t}, "recv", async, [&](cudaStream_t s) {
      check(ncclRecv(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), source, comm_, s), "ncclRecv");
    });
  }
  std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool async) override {
    TITAN_COMM_RANGE("send_recv");
    bytes_ += static_cast<int64_t>(send.nbytes());
    return launch({send, recv}, "send_recv", async, [&](cudaStream_t s) {
      check(ncclGroupStart(), "ncclGroupStart");
      check(ncclSend(send.data_ptr(), send.numel(), nccl_type(send.scalar_type()), destination, comm_, s), "ncclSend");
      check(ncclRecv(recv.data_ptr(), recv.numel(), nccl_type(recv.scalar_type()), source, comm_, s), "ncclRecv");
      check(ncclGroupEnd(), "ncclGroupEnd");
    });
  }
  void barrier() override {
    TITAN_COMM_RANGE("barrier");
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor one = at::ones({1}, at::TensorOptions().device(at::kCUDA, device_));
    all_reduce(one, ReduceOp::Sum, false);
    at::cuda::getCurrentCUDAStream(device_).synchronize();
  }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override {
    c10::cuda::CUDAGuard guard(device_);
    ncclComm_t child = nullptr;
    check(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr), "ncclCommSplit");
    if (!child) return nullptr;
    int r = 0, n = 1;
    ncclCommUserRank(child, &r);
    ncclCommCount(child, &n);
    auto c = std::make_shared<NcclCommunicator>(child, r, n, device_, name);
    c->set_timeout(std::chrono::seconds(timeout_seconds_.load()));
    return c;
  }

 private:
  template <typename Fn>
  std::shared_ptr<Work> launch(std::vector<at::Tensor> tensors, const char* op, bool async, Fn&& issue) {
    for (const auto& t : tensors)
      if (!t.is_cuda() || !t.is_contiguous()) fail("the NCCL backend needs contiguous CUDA tensors (", op, ")");
    c10::cuda::CUDAGuard guard(device_);
    auto current = at::cuda::getCurrentCUDAStream(device_);
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(stream_);
    for (const auto& t : tensors) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    issue(stream_.stream());
    auto work = std::make_shared<NcclWork>(cat(op, " on ", name_, " (", size_, " ranks)"));
    work->device_ = device_;
    work->done_.record(stream_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(work);
    }
    if (!async) work->wait();
    return work;
  }

  void watch() {
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      std::string stuck;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = pending_.begin(); it != pending_.end();) {
          if ((*it)->completed()) {
            it = pending_.erase(it);
          } else {
            if (std::chrono::steady_clock::now() - (*it)->started_ > std::chrono::seconds(timeout_seconds_.load())) stuck = (*it)->what_;
            ++it;
          }
        }
      }
      if (async_error != ncclSuccess || !stuck.empty()) {
        std::fprintf(stderr, "error: [rank %d] %s; aborting the job.\n", rank_,
                     async_error != ncclSuccess ? cat("NCCL reported ", ncclGetErrorString(async_error)).c_str()
                                                : cat(stuck, " did not complete within ", timeout_seconds_.load(),
                                                      " s: another rank has died or hangs")
                                                      .c_str());
        std::fflush(stderr);
        ncclCommAbort(comm_);
        std::_Exit(3);
      }
    }
  }

  ncclComm_t comm_;
  int rank_, size_;
  c10::DeviceIndex device_;
  at::cuda::CUDAStream stream_;
  std::atomic<int64_t> timeout_seconds_{300};
  std::atomic<int64_t> bytes_{0};
  std::mutex mutex_;
  std::list<std::shared_ptr<NcclWork>> pending_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_world(const LaunchInfo& launch, const std::shared_ptr<Communicator>& bootstrap,
                                              int device_index) {
  ncclUniqueId id;
  if (launch.rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (bootstrap) {
    at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
    if (launch.rank == 0) std::memcpy(bytes.data_ptr(), &id, sizeof(id));
    bootstrap->broadcast(bytes, 0);
    std::memcpy(&id, bytes.data_ptr(), sizeof(id));
  } else {
    const char* host = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    if (!host || !port) fail("NCCL bootstrap without MPI needs MASTER_ADDR and MASTER_PORT (torchrun-style launch)");
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(std::atoi(port));
    // torchrun's agent already serves a store on MASTER_PORT; otherwise rank 0 hosts one.
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    options.isServer = launch.rank == 0 && !(agent_store && std::string(agent_store) == "True");
    options.numWorkers = launch.world_size;
    c10d::TCPStore store(host, options);
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const std::string key = cat("titan_nccl_unique_id/", restart ? restart : "0");
    if (launch.rank == 0) {
      std::vector<uint8_t> v(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id));
      store.set(key, v);
    } else {
      auto v = store.get(key);
      if (v.size() != sizeof(id)) fail("NCCL bootstrap: unexpected unique id size ", v.size());
      std::memcpy(&id, v.data(), sizeof(id));
    }
    // The store (possibly served by rank 0) must outlive every rank's read.
    store.add(key + "/read", 1);
    if (options.isServer)
      while (store.add(key + "/read", 0) < launch.world_size) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  ncclComm_t comm = nullptr;
  check(ncclCommInitRank(&comm, launch.world_size, id, launch.rank), "ncclCommInitRank");
  return std::make_shared<NcclCommunicator>(comm, launch.rank, launch.world_size, static_cast<c10::DeviceIndex>(device_index),
                                            "world");
}

#else

std::shared_ptr<Communicator> make_nccl_world(const LaunchInfo&, const std::shared_ptr<Communicator>&, int) {
  fail("this titan build has no CUDA support, so it cannot use NCCL");
}

#endif

}  // namespace titan::distributed
