// The OpenMPI backend for CPU tensors. One worker thread issues every MPI call in submission order (so async
// operations overlap with computation and keep a global order), and a watchdog aborts the job when an operation
// outlives its timeout, which is how a dead or hung peer shows up.
// The C API only: skip the (removed from the standard) C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/mpi_runtime.h"

namespace titan::distributed {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// 16-bit floats: MPI has no bfloat16/float16, so they travel as 2-byte opaque elements reduced by our own ops.

template <typename Half, ReduceOp Op>
void reduce_halves(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<Half*>(in);
  auto* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    float r = Op == ReduceOp::Max ? std::max(x, y) : Op == ReduceOp::Min ? std::min(x, y) : x + y;
    b[i] = static_cast<Half>(r);
  }
}

struct MpiTypes {
  MPI_Datatype half_type = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum, bf16_max, bf16_min, f16_sum, f16_max, f16_min;
  void create() {
    MPI_Type_contiguous(2, MPI_BYTE, &half_type);
    MPI_Type_commit(&half_type);
    MPI_Op_create(&reduce_halves<c10::BFloat16, ReduceOp::Sum>, 1, &bf16_sum);
    MPI_Op_create(&reduce_halves<c10::BFloat16, ReduceOp::Max>, 1, &bf16_max);
    MPI_Op_create(&reduce_halves<c10::BFloat16, ReduceOp::Min>, 1, &bf16_min);
    MPI_Op_create(&reduce_halves<c10::Half, ReduceOp::Sum>, 1, &f16_sum);
    MPI_Op_create(&reduce_halves<c10::Half, ReduceOp::Max>, 1, &f16_max);
    MPI_Op_create(&reduce_halves<c10::Half, ReduceOp::Min>, 1, &f16_min);
  }
};
MpiTypes& types() {
  static MpiTypes t;
  return t;
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte:
    case at::kBool: return MPI_UINT8_T;
    case at::kBFloat16:
    case at::kHalf: return types().half_type;
    default: fail("the MPI backend cannot communicate tensors of dtype ", c10::toString(t));
  }
}

MPI_Op mpi_op(ReduceOp op, at::ScalarType t) {
  // Booleans travel as bytes: a byte sum could leave 2 in a bool. Their sum is their logical or (Communicator).
  if (t == at::kBool) return op == ReduceOp::Min ? MPI_MIN : MPI_MAX;
  if (t == at::kBFloat16)
    return op == ReduceOp::Max ? types().bf16_max : op == ReduceOp::Min ? types().bf16_min : types().bf16_sum;
  if (t == at::kHalf) return op == ReduceOp::Max ? types().f16_max : op == ReduceOp::Min ? types().f16_min : types().f16_sum;
  return op == ReduceOp::Max ? MPI_MAX : op == ReduceOp::Min ? MPI_MIN : MPI_SUM;
}

void check(int code, const std::string& what) {
  if (code == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, message, &length);
  throw std::runtime_error(cat(what, " failed: ", std::string(message, static_cast<size_t>(length))));
}

void require_cpu_contiguous(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu()) fail("the MPI backend communicates CPU tensors; ", what, " got a tensor on ", t.device().str());
  if (!t.is_contiguous()) fail("the MPI backend needs contiguous tensors (", what, ")");
}

// ---------------------------------------------------------------------------------------------------------------

class MpiWork final : public Work {
 public:
  explicit MpiWork(std::string what) : what_(std::move(what)) {}
  void wait() override {
    TITAN_COMM_RANGE("wait");
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = error;
    }
    cv_.notify_all();
  }
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A non-blocking point-to-point operation posted from the calling thread; the tensor is kept alive until done.
class MpiRequestWork final : public Work {
 public:
  MpiRequestWork(std::string what, at::Tensor tensor, std::chrono::seconds timeout)
      : what_(std::move(what)), tensor_(std::move(tensor)), timeout_(timeout) {}
  MPI_Request* request() { return &request_; }
  bool completed() override {
    if (!done_) {
      int flag = 0;
      check(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), what_);
      done_ = flag != 0;
    }
    return done_;
  }
  void wait() override {
    TITAN_COMM_RANGE("wait");
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto pause = std::chrono::microseconds(10);
    // Polling with a growing pause: ranks oversubscribing few cores must not spin each other out.
    while (!completed()) {
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error(cat(what_, " did not complete within ", timeout_.count(),
                                     " s (comm.init_timeout_seconds / comm.train_timeout_seconds): the peer rank has died or hangs"));
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    tensor_ = at::Tensor();
  }

 private:
  std::string what_;
  at::Tensor tensor_;
  std::chrono::seconds timeout_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool done_ = false;
};

// Runs MPI calls on one thread, in order; watches the one in progress.
class MpiEngine {
 public:
  static MpiEngine& instance() {
    static MpiEngine* engine = new MpiEngine();  // lives until exit; shutdown() stops its threads
    return *engine;
  }

  std::shared_ptr<MpiWork> submit(std::string what, std::chrono::seconds timeout, std::function<void()> fn) {
    auto work = std::make_shared<MpiWork>(std::move(what));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) fail("communication was used after shutdown");
      queue_.push_back(Item{work, std::move(fn), timeout});
    }
    cv_.notify_one();
    return work;
  }

  void start() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (worker_.joinable()) return;
    worker_ = std::thread([this] { worker_loop(); });
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  double busy_seconds() const { return busy_seconds_.load(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    watchdog_stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
  }

 private:
  struct Item {
    std::shared_ptr<MpiWork> work;
    std::function<void()> fn;
    std::chrono::seconds timeout;
  };

  void worker_loop() {
    while (true) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        current_what_ = item.work->what();
        current_deadline_ = std::chrono::steady_clock::now() + item.timeout;
        current_timeout_ = item.timeout;
        busy_ = true;
      }
      std::exception_ptr error;
      auto started = std::chrono::steady_clock::now();
      try {
        item.fn();
      } catch (...) {
        error = std::current_exception();
      }
      busy_seconds_.fetch_add(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      item.fn = nullptr;  // the tensors it holds are released before a waiter learns it is done
      {
        std::lock_guard<std::mutex> lock(mutex_);
        busy_ = false;
      }
      item.work->finish(error);
    }
  }

  void watchdog_loop() {
    while (!watchdog_stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::string what;
      std::chrono::seconds timeout{0};
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!busy_ || std::chrono::steady_clock::now() < current_deadline_) continue;
        what = current_what_;
        timeout = current_timeout_;
      }
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);  // thread-safe under MPI_THREAD_MULTIPLE
      std::fprintf(stderr,
                   "error: [rank %d] %s did not complete within %lld s (comm.init_timeout_seconds / "
                   "comm.train_timeout_seconds): another rank has died or hangs. Aborting the job.\n",
                   rank, what.c_str(), static_cast<long long>(timeout.count()));
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 3);
      std::_Exit(3);
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::atomic<bool> watchdog_stop_{false};
  bool busy_ = false;
  std::string current_what_;
  std::chrono::steady_clock::time_point current_deadline_;
  std::chrono::seconds current_timeout_{0};
  std::atomic<double> busy_seconds_{0};
  std::thread worker_, watchdog_;
};

class MpiCommunicator final : public Communicator, public std::enable_shared_from_this<MpiCommunicator> {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name) : comm_(comm) {
    name_ = std::move(name);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  bool globally_ordered() const override { return true; }
  void set_timeout(std::chrono::seconds timeout) override { timeout_ = timeout; }
  int64_t bytes_communicated() const override { return bytes_; }

  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op, bool async) override {
    TITAN_COMM_RANGE("all_reduce");
    require_cpu_contiguous(tensor, "all_reduce");
    if (op == ReduceOp::Avg && !at::isFloatingType(tensor.scalar_type())) fail("all_reduce(avg) needs a floating-point tensor");
    at::Tensor t = tensor;
    const int n = count(t);
    bytes_ += static_cast<int64_t>(2 * (size_ - 1) * static_cast<int64_t>(t.nbytes()) / std::max(size_, 1));  // ring volume
    return run(cat("all_reduce(", reduce_op_name(op), ", ", n, " x ", c10::toString(t.scalar_type()), ")"),
               [t, op, n, comm = comm_, size = size_]() mutable {
                 check(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), n, mpi_type(t.scalar_type()), mpi_op(op, t.scalar_type()), comm),
                       "MPI_Allreduce");
                 if (op == ReduceOp::Avg) t.div_(size);
               },
               async);
  }

  std::shared_ptr<Work> all_gather_into(at::Tensor& output, const at::Tensor& input, bool async) override {
    TITAN_COMM_RANGE("all_gather_into");
    require_cpu_contiguous(output, "all_gather_into output");
    require_cpu_contiguous(input, "all_gather_into input");
    if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type())
      fail("all_gather_into: output must hold ", size_, " x ", input.numel(), " elements of the input's dtype");
    at::Tensor out = output, in = input;
    bytes_ += static_cast<int64_t>(in.nbytes()) * (size_ - 1);
    return run(cat("all_gather(", in.numel(), " x ", c10::toString(in.scalar_type()), ")"),
               [out, in, comm = comm_]() mutable {
                 MPI_Datatype type = mpi_type(in.scalar_type());
                 check(MPI_Allgather(in.data_ptr(), count(in), type, out.data_ptr(), count(in), type, comm), "MPI_Allgather");
               },
               async);
  }

  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op, bool async) override {
    TITAN_COMM_RANGE("reduce_scatter");
    require_cpu_contiguous(output, "reduce_scatter output");
    require_cpu_contiguous(input, "reduce_scatter input");
    if (input.numel() != output.numel() * size_ || output.scalar_type() != input.scalar_type())
      fail("reduce_scatter: input must hold ", size_, " x ", output.numel(), " elements of the output's dtype");
    at::Tensor out = output, in = input;
    bytes_ += static_cast<int64_t>(out.nbytes()) * (size_ - 1);
    return run(cat("reduce_scatter(", reduce_op_name(op), ", ", in.numel(), " x ", c10::toString(in.scalar_type()), ")"),
               [out, in, op, comm = comm_, rank = rank_, size = size_]() mutable {
                 ring_reduce_scatter(in, out, mpi_op(op, in.scalar_type()), comm, rank, size);
                 if (op == ReduceOp::Avg) out.div_(size);
               },
               async);
  }

  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input, bool async) override {
    TITAN_COMM_RANGE("all_to_all");
    require_cpu_contiguous(output, "all_to_all output");
    require_cpu_contiguous(input, "all_to_all input");
    if (output.numel() != input.numel() || input.numel() % size_ != 0 || output.scalar_type() != input.scalar_type())
      fail("all_to_all: input and output must hold ", size_, " equal blocks of the same dtype");
    at::Tensor out = output, in = input;
    bytes_ += static_cast<int64_t>(in.nbytes()) * (size_ - 1) / size_;
    return run(cat("all_to_all(", in.numel(), " x ", c10::toString(in.scalar_type()), ")"),
               [out, in, comm = comm_, size = size_]() mutable {
                 MPI_Datatype type = mpi_type(in.scalar_type());
                 const int block = count(in) / size;
                 check(MPI_Alltoall(in.data_ptr(), block, type, out.data_ptr(), block, type, comm), "MPI_Alltoall");
               },
               async);
  }

  std::shared_ptr<Work> all_to_all_v(at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                                     const std::vector<int64_t>& input_splits, bool async) override {
    TITAN_COMM_RANGE("all_to_all_v");
    require_cpu_contiguous(output, "all_to_all_v output");
    require_cpu_contiguous(input, "all_to_all_v input");
    if (output.scalar_type() != input.scalar_type()) fail("all_to_all_v: input and output must have the same dtype");
    auto counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t, const char* what) {
      if (static_cast<int>(splits.size()) != size_) fail("all_to_all_v: ", splits.size(), " ", what, " splits for ", size_, " ranks");
      std::vector<int> c, d;
      int64_t total = 0;
      for (int64_t n : splits) {
        if (n < 0) fail("all_to_all_v: a negative ", what, " split (", n, ")");
        d.push_back(static_cast<int>(total));
        c.push_back(static_cast<int>(n));
        total += n;
        if (total > std::numeric_limits<int>::max()) fail("all_to_all_v: ", total, " ", what, " elements, too many for one MPI call");
      }
      if (total != t.numel()) fail("all_to_all_v: the ", what, " splits add up to ", total, " elements; the tensor holds ", t.numel());
      return std::pair{c, d};
    };
    auto [send_counts, send_displs] = counts(input_splits, input, "input");
    auto [recv_counts, recv_displs] = counts(output_splits, output, "output");
    at::Tensor out = output, in = input;
    bytes_ += (in.numel() - input_splits[static_cast<size_t>(rank_)]) * static_cast<int64_t>(in.element_size());
    return run(cat("all_to_all_v(", in.numel(), " -> ", out.numel(), " x ", c10::toString(in.scalar_type()), ")"),
               [out, in, send_counts, send_displs, recv_counts, recv_displs, comm = comm_]() mutable {
                 MPI_Datatype type = mpi_type(in.scalar_type());
                 check(MPI_Alltoallv(in.data_ptr(), send_counts.data(), send_displs.data(), type, out.data_ptr(), recv_counts.data(),
                                     recv_displs.data(), type, comm),
                       "MPI_Alltoallv");
               },
               async);
  }

  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root, bool async) override {
    TITAN_COMM_RANGE("broadcast");
    require_cpu_contiguous(tensor, "broadcast");
    at::Tensor t = tensor;
    if (rank_ == root) bytes_ += static_cast<int64_t>(t.nbytes());
    return run(cat("broadcast(root ", root, ", ", t.numel(), " x ", c10::toString(t.scalar_type()), ")"),
               [t, root, comm = comm_]() mutable {
                 check(MPI_Bcast(t.data_ptr(), count(t), mpi_type(t.scalar_type()), root, comm), "MPI_Bcast");
               },
               async);
  }

  // Point-to-point operations bypass the worker thread: they are posted at once from the calling thread
  // (MPI_THREAD_MULTIPLE) so that a pipeline's sends and receives never queue behind, or block, the collectives of
  // other groups. wait() polls them and throws when they outlive the timeout.
  std::shared_ptr<Work> send(const at::Tensor& tensor, int destination, int tag, bool async) override {
    TITAN_COMM_RANGE("send");
    require_cpu_contiguous(tensor, "send");
    bytes_ += static_cast<int64_t>(tensor.nbytes());
    auto work = std::make_shared<MpiRequestWork>(cat("send(to ", destination, ", tag ", tag, ") on ", name_), tensor, timeout_);
    check(MPI_Isend(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), destination, tag, comm_, work->request()),
          "MPI_Isend");
    if (!async) work->wait();
    return work;
  }

  std::shared_ptr<Work> recv(at::Tensor& tensor, int source, int tag, bool async) override {
    TITAN_COMM_RANGE("recv");
    require_cpu_contiguous(tensor, "recv");
    auto work = std::make_shared<MpiRequestWork>(cat("recv(from ", source, ", tag ", tag, ") on ", name_), tensor, timeout_);
    check(MPI_Irecv(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), source, tag, comm_, work->request()),
          "MPI_Irecv");
    if (!async) work->wait();
    return work;
  }

  std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool async) override {
    TITAN_COMM_RANGE("send_recv");
    require_cpu_contiguous(send, "send_recv send");
    require_cpu_contiguous(recv, "send_recv recv");
    at::Tensor out = send, in = recv;
    bytes_ += static_cast<int64_t>(out.nbytes());
    return run(cat("send_recv(to ", destination, ", from ", source, ", ", out.numel(), " x ", c10::toString(out.scalar_type()), ")"),
               [out, in, destination, source, comm = comm_]() mutable {
                 check(MPI_Sendrecv(out.data_ptr(), count(out), mpi_type(out.scalar_type()), destination, 0, in.data_ptr(), count(in),
                                    mpi_type(in.scalar_type()), source, 0, comm, MPI_STATUS_IGNORE),
                       "MPI_Sendrecv");
               },
               async);
  }

  void barrier() override {
    TITAN_COMM_RANGE("barrier");
    run("barrier", [comm = comm_] { check(MPI_Barrier(comm), "MPI_Barrier"); }, false);
  }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& name, int size = 0) override {
    MPI_Comm out = MPI_COMM_NULL;
    const int mpi_color = color < 0 ? MPI_UNDEFINED : color;
    run(cat("split(", name, ")"), [&] { check(MPI_Comm_split(comm_, mpi_color, key, &out), "MPI_Comm_split"); }, false);
    if (out == MPI_COMM_NULL) return nullptr;
    auto child = std::make_shared<MpiCommunicator>(out, name);
    if (size > 0 && child->size() != size)
      fail("internal: split ", quote(name), " made a communicator of ", child->size(), " ranks where ", size, " were expected");
    child->set_timeout(timeout_);
    return child;
  }

 private:
  static int count(const at::Tensor& t) {
    if (t.numel() > std::numeric_limits<int>::max()) fail("tensor too large for one MPI call (", t.numel(), " elements)");
    return static_cast<int>(t.numel());
  }

  // Reduce-scatter as a ring of point-to-point messages, with one chunk (the output's size) of temporary memory.
  // MPI_Reduce_scatter_block would do, but Open MPI's algorithms allocate temporaries of the whole input, some
  // twice, with malloc, outside LibTorch's allocator: FSDP's reduction of a unit of 128 experts (302 MB in float32)
  // took 592 MiB more at its peak than the unit itself (docs/moe.md). Step s (0 .. size - 2): send the partial
  // sum of chunk (rank - s - 1) to the next rank, receive the previous rank's partial sum of chunk (rank - s - 2)
  // and add this rank's own share of it; the last step's chunk is this rank's, received into `out`. The sums run
  // in the same order on every call (the result does not depend on message sizes or timing).
  static void ring_reduce_scatter(const at::Tensor& in, at::Tensor& out, MPI_Op op, MPI_Comm comm, int rank, int size) {
    const int n = count(out);
    const auto bytes = static_cast<size_t>(out.nbytes());
    const char* chunks = static_cast<const char*>(in.data_ptr());
    if (size == 1) {
      if (bytes > 0) std::memcpy(out.data_ptr(), chunks, bytes);
      return;
    }
    const MPI_Datatype type = mpi_type(in.scalar_type());
    const auto chunk = [&](int index) { return chunks + static_cast<size_t>(((index % size) + size) % size) * bytes; };
    at::Tensor spare = at::empty_like(out);
    const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
    const void* send = chunk(rank - 1);
    for (int s = 0; s + 1 < size; ++s) {
      // The buffers alternate so that the last step (s = size - 2) receives into `out`.
      void* receive = ((size - 2 - s) % 2 == 0 ? out : spare).data_ptr();
      check(MPI_Sendrecv(send, n, type, next, kRingTag, receive, n, type, previous, kRingTag, comm, MPI_STATUS_IGNORE),
            "MPI_Sendrecv (reduce_scatter)");
      check(MPI_Reduce_local(chunk(rank - s - 2), receive, n, type, op), "MPI_Reduce_local (reduce_scatter)");
      send = receive;
    }
  }
  // Point-to-point messages of the ring above: no other message on a communicator that reduce-scatters uses it
  // (the pipeline's use tag 0 on their own two-rank communicators).
  static constexpr int kRingTag = 0x5253;

  std::shared_ptr<Work> run(const std::string& what, std::function<void()> fn, bool async) {
    auto work = MpiEngine::instance().submit(cat(what, " on ", name_, " (", size_, " ranks)"), timeout_, std::move(fn));
    if (!async) work->wait();
    return work;
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::chrono::seconds timeout_{300};
  std::atomic<int64_t> bytes_{0};
};

bool g_initialized_here = false;

}  // namespace

void mpi_initialize() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    // The watchdog may abort while the worker is inside a collective, and communicators are created on the
    // training thread: several threads call MPI.
    if (provided < MPI_THREAD_MULTIPLE)
      fail("the MPI library provides thread level ", provided, "; titan needs MPI_THREAD_MULTIPLE (OpenMPI built with "
           "thread support, as Debian's is)");
    g_initialized_here = true;
  }
  types().create();
  MpiEngine::instance().start();
}

double mpi_busy_seconds() { return MpiEngine::instance().busy_seconds(); }

void mpi_finalize() {
  if (!g_initialized_here) return;
  MpiEngine::instance().stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  g_initialized_here = false;
}

std::shared_ptr<Communicator> make_mpi_world() {
  mpi_initialize();
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  return std::make_shared<MpiCommunicator>(dup, "world");
}

}  // namespace titan::distributed
