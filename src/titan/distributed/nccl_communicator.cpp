// The NCCL backend for CUDA tensors. Operations run on the communicator's own stream, which first waits for the
// caller's current stream; Work::wait() makes the caller's stream wait for the operation (no host blocking). The
// unique id is shared over an existing communicator (MPI) or a TCP store at MASTER_ADDR:MASTER_PORT
// (torchrun-style). Communicators are non-blocking, so start-up, splits and destruction end within their timeouts.
#include "titan/distributed/communicator.h"

#include "titan/common/error.h"

#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "titan/common/strings.h"
#endif

namespace titan::distributed {

#ifdef TITAN_WITH_CUDA
namespace {

using Clock = std::chrono::steady_clock;

std::string describe(ncclResult_t r, ncclComm_t comm) {
  std::string text = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) text += cat(" (", last, ")");
  return text;
}

void check(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r != ncclSuccess && r != ncclInProgress) throw std::runtime_error(cat(what, " failed: ", describe(r, comm)));
}

// titan's communicators are non-blocking (so that start-up and splits can time out): a call may return before its
// work is enqueued. Waits until `comm` has settled; false when `deadline` passed first, else `state` is the outcome.
bool settle(ncclComm_t comm, Clock::time_point deadline, ncclResult_t& state) {
  for (int spins = 0;; ++spins) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state != ncclInProgress) return true;
    if (Clock::now() > deadline) return false;
    if (spins < 100) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
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

ncclRedOp_t nccl_op(ReduceOp op, at::ScalarType t) {
  if (t == at::kBool) {
    // Booleans travel as bytes: a byte sum could leave 2 in a bool. Their sum is their logical or (Communicator).
    if (op == ReduceOp::Avg) fail("all_reduce(avg) needs a floating-point tensor, not bool");
    return op == ReduceOp::Min ? ncclMin : ncclMax;
  }
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// Streams created by titan for its communicators, one per live communicator: LibTorch's pool has 32 per device and
// hands them out round robin, so past 32 communicators two would share a stream and a posted receive on one would
// hold back the other. A stream is reused only after its communicator is gone, and never destroyed (the caching
// allocator may still record events on it for tensors freed later).
class CommunicationStreams {
 public:
  static CommunicationStreams& instance() {
    static auto* streams = new CommunicationStreams();  // never destroyed: outlives every communicator
    return *streams;
  }
  at::cuda::CUDAStream take(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[device];
      if (!free.empty()) {
        cudaStream_t s = free.back();
        free.pop_back();
        return c10::cuda::getStreamFromExternal(s, device);
      }
    }
    c10::cuda::CUDAGuard guard(device);
    int least = 0, greatest = 0;
    C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    return c10::cuda::getStreamFromExternal(s, device);
  }
  void give_back(const at::cuda::CUDAStream& stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[stream.device_index()].push_back(stream.stream());
  }

 private:
  std::mutex mutex_;
  std::map<c10::DeviceIndex, std::vector<cudaStream_t>> free_;
};

// ncclGroupStart .. ncclGroupEnd that always ends: a check failing in between must not leave the group open (every
// later NCCL call of the thread would join it).
class NcclGroup {
 public:
  NcclGroup() { check(ncclGroupStart(), "ncclGroupStart"); }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();
  }
  void end() {
    open_ = false;
    check(ncclGroupEnd(), "ncclGroupEnd");
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = true;
};

// Holds only an event: the tensors' memory is protected by recordStream on the communication stream, so buffers
// are freed (for reuse after the operation) as soon as the caller drops them.
class NcclWork final : public Work {
 public:
  explicit NcclWork(std::string what) : what_(std::move(what)), started_(Clock::now()) {}
  void wait() override {
    TITAN_COMM_RANGE("wait");
    done_.block(at::cuda::getCurrentCUDAStream(device_));
  }
  bool completed() override { return done_.query(); }
  at::cuda::CUDAEvent done_;
  c10::DeviceIndex device_ = 0;
  std::string what_;
  Clock::time_point started_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, c10::DeviceIndex device, std::string name, int64_t timeout_seconds)
      : comm_(comm), rank_(rank), size_(size), device_(device), stream_(CommunicationStreams::instance().take(device)),
        timeout_seconds_(timeout_seconds) {
    name_ = std::move(name);
    watchdog_ = std::thread([this] { watch(); });
  }
  ~NcclCommunicator() override {
    // With work still pending (a peer is stuck, or this rank stops midway) or an error unwinding, ncclCommDestroy
    // would wait for the peers for ever: abort instead. Otherwise finalize (flushes this rank's operations) within
    // the timeout, then destroy. The watchdog stays up until this returns and ends the process if it hangs.
    bool abort = std::uncaught_exceptions() > 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& work : pending_) abort = abort || !work->completed();
      closing_ = abort ? "ncclCommAbort" : "ncclCommFinalize and ncclCommDestroy";
      closing_since_ = Clock::now();
    }
    if (!abort) {
      const auto deadline = Clock::now() + std::chrono::seconds(timeout_seconds_.load());
      const ncclResult_t started = ncclCommFinalize(comm_);
      ncclResult_t state = ncclSuccess;
      abort = (started != ncclSuccess && started != ncclInProgress) || !settle(comm_, deadline, state) || state != ncclSuccess;
    }
    if (abort) ncclCommAbort(comm_);
    else ncclCommDestroy(comm_);
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    CommunicationStreams::instance().give_back(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  void set_timeout(std::chrono::seconds t) override { timeout_seconds_ = t.count(); }
  int64_t bytes_communicated() const override { return bytes_; }
  at::Device tensor_device() const override { return at::Device(at::kCUDA, device_); }
  bool waits_block_host() const override { return false; }

  std::shared_ptr<Work> all_reduce(at::Tensor& t, ReduceOp op, bool async) override {
    TITAN_COMM_RANGE("all_reduce");
    const auto type = nccl_type(t.scalar_type());
    const auto reduction = nccl_op(op, t.scalar_type());
    bytes_ += 2 * (size_ - 1) * static_cast<int64_t>(t.nbytes()) / std::max(size_, 1);  // ring volume
    return launch({t}, "all_reduce", async, [&](cudaStream_t s) {
      check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), type, reduction, comm_, s), "ncclAllReduce", comm_);
    });
  }
  std::shared_ptr<Work> all_gather_into(at::Tensor& out, const at::Tensor& in, bool async) override {
    TITAN_COMM_RANGE("all_gather_into");
    if (out.numel() != in.numel() * size_) fail("all_gather_into: output must hold ", size_, " x ", in.numel(), " elements");
    const auto type = nccl_type(in.scalar_type());
    bytes_ += static_cast<int64_t>(in.nbytes()) * (size_ - 1);
    return launch({out, in}, "all_gather", async, [&](cudaStream_t s) {
      check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), type, comm_, s), "ncclAllGather", comm_);
    });
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op, bool async) override {
    TITAN_COMM_RANGE("reduce_scatter");
    if (in.numel() != out.numel() * size_) fail("reduce_scatter: input must hold ", size_, " x ", out.numel(), " elements");
    const auto type = nccl_type(in.scalar_type());
    const auto reduction = nccl_op(op, in.scalar_type());
    bytes_ += static_cast<int64_t>(out.nbytes()) * (size_ - 1);
    return launch({out, in}, "reduce_scatter", async, [&](cudaStream_t s) {
      check(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), type, reduction, comm_, s), "ncclReduceScatter", comm_);
    });
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& out, const at::Tensor& in, bool async) override {
    TITAN_COMM_RANGE("all_to_all");
    if (out.numel() != in.numel() || in.numel() % size_ != 0) fail("all_to_all: input and output must hold ", size_, " equal blocks");
    const auto type = nccl_type(in.scalar_type());
    bytes_ += static_cast<int64_t>(in.nbytes()) * (size_ - 1) / size_;
    return launch({out, in}, "all_to_all", async, [&](cudaStream_t s) {
      // NCCL has no all-to-all call: one grouped send and receive per peer.
      const size_t block = static_cast<size_t>(in.numel() / size_);
      const size_t bytes = block * in.element_size();
      NcclGroup group;
      for (int peer = 0; peer < size_; ++peer) {
        check(ncclSend(static_cast<const char*>(in.data_ptr()) + peer * bytes, block, type, peer, comm_, s), "ncclSend", comm_);
        check(ncclRecv(static_cast<char*>(out.data_ptr()) + peer * bytes, block, type, peer, comm_, s), "ncclRecv", comm_);
      }
      group.end();
    });
  }
  std::shared_ptr<Work> all_to_all_v(at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                                     const std::vector<int64_t>& in_splits, bool async) override {
    TITAN_COMM_RANGE("all_to_all_v");
    if (static_cast<int>(out_splits.size()) != size_ || static_cast<int>(in_splits.size()) != size_)
      fail("all_to_all_v: one split per rank expected (", size_, ")");
    int64_t in_total = 0, out_total = 0;
    for (int r = 0; r < size_; ++r) in_total += in_splits[static_cast<size_t>(r)], out_total += out_splits[static_cast<size_t>(r)];
    if (in_total != in.numel() || out_total != out.numel())
      fail("all_to_all_v: the splits add up to ", in_total, " and ", out_total, " elements; the tensors hold ", in.numel(), " and ", out.numel());
    const auto type = nccl_type(in.scalar_type());
    bytes_ += (in.numel() - in_splits[static_cast<size_t>(rank_)]) * static_cast<int64_t>(in.element_size());
    return launch({out, in}, "all_to_all_v", async, [&](cudaStream_t s) {
      const size_t element = in.element_size();
      size_t sent = 0, received = 0;
      NcclGroup group;
      for (int peer = 0; peer < size_; ++peer) {
        const auto n_in = static_cast<size_t>(in_splits[static_cast<size_t>(peer)]);
        const auto n_out = static_cast<size_t>(out_splits[static_cast<size_t>(peer)]);
        if (n_in) check(ncclSend(static_cast<const char*>(in.data_ptr()) + sent * element, n_in, type, peer, comm_, s), "ncclSend", comm_);
        if (n_out) check(ncclRecv(static_cast<char*>(out.data_ptr()) + received * element, n_out, type, peer, comm_, s), "ncclRecv", comm_);
        sent += n_in;
        received += n_out;
      }
      group.end();
    });
  }
  std::shared_ptr<Work> broadcast(at::Tensor& t, int root, bool async) override {
    TITAN_COMM_RANGE("broadcast");
    const auto type = nccl_type(t.scalar_type());
    if (rank_ == root) bytes_ += static_cast<int64_t>(t.nbytes());
    return launch({t}, "broadcast", async, [&](cudaStream_t s) {
      check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), type, root, comm_, s), "ncclBroadcast", comm_);
    });
  }
  std::shared_ptr<Work> send(const at::Tensor& t, int destination, int, bool async) override {
    TITAN_COMM_RANGE("send");
    const auto type = nccl_type(t.scalar_type());
    bytes_ += static_cast<int64_t>(t.nbytes());
    return launch({t}, "send", async, [&](cudaStream_t s) {
      check(ncclSend(t.data_ptr(), t.numel(), type, destination, comm_, s), "ncclSend", comm_);
    });
  }
  std::shared_ptr<Work> recv(at::Tensor& t, int source, int, bool async) override {
    TITAN_COMM_RANGE("recv");
    const auto type = nccl_type(t.scalar_type());
    return launch({t}, "recv", async, [&](cudaStream_t s) {
      check(ncclRecv(t.data_ptr(), t.numel(), type, source, comm_, s), "ncclRecv", comm_);
    });
  }
  std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool async) override {
    TITAN_COMM_RANGE("send_recv");
    const auto send_type = nccl_type(send.scalar_type()), recv_type = nccl_type(recv.scalar_type());
    bytes_ += static_cast<int64_t>(send.nbytes());
    return launch({send, recv}, "send_recv", async, [&](cudaStream_t s) {
      NcclGroup group;
      check(ncclSend(send.data_ptr(), send.numel(), send_type, destination, comm_, s), "ncclSend", comm_);
      check(ncclRecv(recv.data_ptr(), recv.numel(), recv_type, source, comm_, s), "ncclRecv", comm_);
      group.end();
    });
  }
  void barrier() override {
    TITAN_COMM_RANGE("barrier");
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor one = at::ones({1}, at::TensorOptions().device(at::kCUDA, device_));
    all_reduce(one, ReduceOp::Sum, false);
    at::cuda::getCurrentCUDAStream(device_).synchronize();
  }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name, int /*size*/ = 0) override {
    c10::cuda::CUDAGuard guard(device_);
    ncclConfig_t config = non_blocking_config();
    ncclComm_t child = nullptr;
    const auto deadline = Clock::now() + std::chrono::seconds(timeout_seconds_.load());
    const std::string what = cat("ncclCommSplit of ", name_, " (", size_, " ranks) into ", quote(name), " on rank ", rank_);
    check(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config), what.c_str(), comm_);
    ncclResult_t state = ncclSuccess;
    if (!settle(comm_, deadline, state))
      fail(what, " did not finish within ", timeout_seconds_.load(), " s (comm.init_timeout_seconds): a rank of ", name_,
           " did not reach it (it died or hangs before; its log says where)");
    if (state != ncclSuccess) throw std::runtime_error(cat(what, " failed: ", describe(state, comm_)));
    if (!child) return nullptr;
    if (!settle(child, deadline, state) || state != ncclSuccess) {
      const std::string why = state == ncclInProgress ? cat("did not finish within ", timeout_seconds_.load(), " s (comm.init_timeout_seconds)")
                                                      : cat("failed: ", describe(state, child));
      ncclCommAbort(child);
      fail(what, ": the new communicator ", why);
    }
    int r = 0, n = 1;
    check(ncclCommUserRank(child, &r), "ncclCommUserRank", child);
    check(ncclCommCount(child, &n), "ncclCommCount", child);
    return std::make_shared<NcclCommunicator>(child, r, n, device_, name, timeout_seconds_.load());
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
    // Enqueued once the communicator settles (a non-blocking call may return before): only then does the event
    // recorded next follow the operation.
    ncclResult_t state = ncclSuccess;
    if (!settle(comm_, Clock::now() + std::chrono::seconds(timeout_seconds_.load()), state))
      throw std::runtime_error(cat(work->what_, " was not enqueued within ", timeout_seconds_.load(), " s: another rank has died or hangs"));
    if (state != ncclSuccess) throw std::runtime_error(cat(work->what_, " failed: ", describe(state, comm_)));
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
    // Event queries from a thread without a current device would create a context on GPU 0 (every rank of a node).
    cudaSetDevice(device_);
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::string failure;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!closing_.empty()) {
          // The communicator is being destroyed (comm_ is not ours to query any more): only its own time is watched.
          const auto limit = std::chrono::seconds(timeout_seconds_.load()) + std::chrono::seconds(60);
          if (Clock::now() - closing_since_ > limit)
            failure = cat(closing_, " of ", name_, " did not return within ", timeout_seconds_.load() + 60, " s");
        } else {
          ncclResult_t async_error = ncclSuccess;
          ncclCommGetAsyncError(comm_, &async_error);
          if (async_error != ncclSuccess && async_error != ncclInProgress) {
            failure = cat("NCCL reported ", describe(async_error, comm_), " on ", name_);
            if (async_error == ncclRemoteError) note_peer_failure();  // a peer aborted: its own error says why
          }
          for (auto it = pending_.begin(); it != pending_.end();) {
            if ((*it)->completed()) {
              it = pending_.erase(it);
              continue;
            }
            if (failure.empty() && Clock::now() - (*it)->started_ > std::chrono::seconds(timeout_seconds_.load()))
              failure = cat((*it)->what_, " did not complete within ", timeout_seconds_.load(), " s: another rank has died or hangs");
            ++it;
          }
          if (!failure.empty()) ncclCommAbort(comm_);
        }
      }
      if (!failure.empty()) {
        // After a peer's abort, that peer reports first (common/error.h); its exit usually ends the job meanwhile.
        if (peer_failure_noted()) std::this_thread::sleep_for(kPeerFailureReportDelay);
        std::fprintf(stderr, "error: [rank %d] %s; aborting the job.\n", rank_, failure.c_str());
        std::fflush(stderr);
        std::_Exit(3);
      }
    }
  }

  ncclComm_t comm_;
  int rank_, size_;
  c10::DeviceIndex device_;
  at::cuda::CUDAStream stream_;
  std::atomic<int64_t> timeout_seconds_;
  std::atomic<int64_t> bytes_{0};
  std::mutex mutex_;
  std::list<std::shared_ptr<NcclWork>> pending_;
  std::string closing_;  // what the destructor is doing, once it started
  Clock::time_point closing_since_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

// Every rank reports to rank 0 before the NCCL communicator is created, so that a rank that never arrives is named
// (NCCL's own start-up would only hang). Over the bootstrap communicator (MPI): one message per rank.
void check_in_over(Communicator& bootstrap, std::chrono::seconds timeout) {
  const int n = bootstrap.size(), me = bootstrap.rank();
  constexpr int kTag = 0x7171;
  if (me != 0) {
    at::Tensor mine = at::full({1}, me, at::kLong);
    bootstrap.send(mine, 0, kTag, /*async=*/false);
    return;
  }
  std::vector<at::Tensor> from(static_cast<size_t>(n));
  std::vector<std::shared_ptr<Work>> works(static_cast<size_t>(n));
  for (int r = 1; r < n; ++r) {
    from[static_cast<size_t>(r)] = at::empty({1}, at::kLong);
    works[static_cast<size_t>(r)] = bootstrap.recv(from[static_cast<size_t>(r)], r, kTag, /*async=*/true);
  }
  const auto deadline = Clock::now() + timeout;
  std::vector<int64_t> missing;
  for (;;) {
    missing.clear();
    for (int r = 1; r < n; ++r)
      if (!works[static_cast<size_t>(r)]->completed()) missing.push_back(r);
    if (missing.empty() || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!missing.empty())
    fail("NCCL start-up: rank(s) ", join_ints(missing), " of ", n, " did not arrive within ", timeout.count(),
         " s (comm.init_timeout_seconds); they died or hang before it (their logs say where)");
  for (int r = 1; r < n; ++r) works[static_cast<size_t>(r)]->wait();
}

// torchrun-style start-up: the unique id through a TCP store at MASTER_ADDR:MASTER_PORT, each rank's arrival
// recorded there, so that rank 0 names the ranks that never came.
ncclUniqueId exchange_through_store(const LaunchInfo& launch, ncclUniqueId id, std::chrono::seconds timeout) {
  const char* host = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (!host || !port) fail("NCCL bootstrap without MPI needs MASTER_ADDR and MASTER_PORT (torchrun-style launch)");
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(std::atoi(port));
  // torchrun's agent already serves a store on MASTER_PORT; otherwise rank 0 hosts one.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  options.isServer = launch.rank == 0 && !(agent_store && std::string(agent_store) == "True");
  options.numWorkers = launch.world_size;
  options.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  c10d::TCPStore store(host, options);
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string key = cat("titan_nccl_unique_id/", restart ? restart : "0");
  store.set(cat(key, "/arrived/", launch.rank), std::vector<uint8_t>{1});
  const auto deadline = Clock::now() + timeout;
  if (launch.rank == 0) {
    std::vector<int64_t> missing;
    for (;;) {
      missing.clear();
      for (int r = 1; r < launch.world_size; ++r)
        if (!store.check({cat(key, "/arrived/", r)})) missing.push_back(r);
      if (missing.empty() || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!missing.empty())
      fail("NCCL start-up through the store at ", host, ":", port, ": rank(s) ", join_ints(missing), " of ", launch.world_size,
           " did not arrive within ", timeout.count(), " s (comm.init_timeout_seconds); they died, hang, or were started with "
           "another MASTER_ADDR/MASTER_PORT");
    std::vector<uint8_t> v(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id));
    store.set(key, v);
  } else {
    std::vector<uint8_t> v;
    try {
      v = store.get(key);  // waits up to the store's timeout
    } catch (const std::exception& e) {
      fail("NCCL start-up through the store at ", host, ":", port, ": rank 0 did not publish the NCCL unique id within ",
           timeout.count(), " s (comm.init_timeout_seconds): ", e.what());
    }
    if (v.size() != sizeof(id)) fail("NCCL bootstrap: unexpected unique id size ", v.size());
    std::memcpy(&id, v.data(), sizeof(id));
  }
  // The store (possibly served by rank 0) must outlive every rank's read.
  store.add(key + "/read", 1);
  if (options.isServer)
    while (store.add(key + "/read", 0) < launch.world_size) {
      if (Clock::now() > deadline) fail("NCCL start-up: not every rank read the NCCL unique id from the store within ", timeout.count(), " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  return id;
}

}  // namespace

std::shared_ptr<Communicator> make_nccl_world(const LaunchInfo& launch, const std::shared_ptr<Communicator>& bootstrap,
                                              int device_index, std::chrono::seconds init_timeout) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (launch.rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (bootstrap) {
    bootstrap->set_timeout(init_timeout);
    check_in_over(*bootstrap, init_timeout);
    at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
    if (launch.rank == 0) std::memcpy(bytes.data_ptr(), &id, sizeof(id));
    bootstrap->broadcast(bytes, 0);
    std::memcpy(&id, bytes.data_ptr(), sizeof(id));
  } else if (launch.world_size > 1) {
    id = exchange_through_store(launch, id, init_timeout);
  }
  const auto device = static_cast<c10::DeviceIndex>(device_index);
  c10::cuda::CUDAGuard guard(device);
  ncclComm_t comm = nullptr;
  ncclConfig_t config = non_blocking_config();
  const std::string what = cat("ncclCommInitRank (rank ", launch.rank, " of ", launch.world_size, ", cuda:", device_index, ")");
  check(ncclCommInitRankConfig(&comm, launch.world_size, id, launch.rank, &config), what.c_str(), comm);
  ncclResult_t state = ncclSuccess;
  if (!settle(comm, Clock::now() + init_timeout, state) || state != ncclSuccess) {
    const std::string why = state == ncclInProgress
                                ? cat("did not finish within ", init_timeout.count(), " s (comm.init_timeout_seconds), although every "
                                      "rank reached it: NCCL's connection set-up hangs (NCCL_DEBUG=INFO shows where; check "
                                      "NCCL_SOCKET_IFNAME and the network between the nodes)")
                                : cat("failed: ", describe(state, comm));
    ncclCommAbort(comm);
    fail(what, " ", why);
  }
  return std::make_shared<NcclCommunicator>(comm, launch.rank, launch.world_size, device, "world", init_timeout.count());
}

#else

std::shared_ptr<Communicator> make_nccl_world(const LaunchInfo&, const std::shared_ptr<Communicator>&, int, std::chrono::seconds) {
  fail("this titan build has no CUDA support, so it cannot use NCCL");
}

#endif

}  // namespace titan::distributed
