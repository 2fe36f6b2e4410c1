// Communicator: titan's small collective-communication interface over real engines (OpenMPI for CPU tensors,
// NCCL for CUDA tensors, a trivial one for a single process, and a fake one for a dry run of one rank of a larger
// job). Every operation can run asynchronously and returns a
// Work handle; operations on one communicator complete in the order they were issued on every rank.
#pragma once
#include <ATen/record_function.h>
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

// A range named "titan::<collective>" in profiler traces (profiling.enable_profiling) around each communication call
// and each wait for an asynchronous one.
#define TITAN_COMM_RANGE(name)                                        \
  at::RecordFunction titan_comm_range(at::RecordScope::USER_SCOPE);   \
  if (titan_comm_range.isActive()) titan_comm_range.before("titan::" name)

namespace titan::distributed {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);

// A pending operation. wait() blocks until it is done (and, for GPU backends, orders the current stream after it)
// and rethrows its error, if any.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool completed() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  // Where this backend's tensors must live: the CPU (MPI, local) or this rank's GPU (NCCL). Host objects exchanged
  // through a communicator (strings, flags) go through tensors on this device.
  virtual at::Device tensor_device() const { return at::Device(at::kCPU); }
  const std::string& name() const { return name_; }

  // In place on `tensor` (contiguous). A sum (and max) of bool tensors is their logical or, a min their logical and;
  // an average needs a floating-point tensor.
  virtual std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op, bool async = false) = 0;
  // `output` holds size() * input.numel() elements: rank i's input lands at [i * n, (i + 1) * n).
  virtual std::shared_ptr<Work> all_gather_into(at::Tensor& output, const at::Tensor& input, bool async = false) = 0;
  // `input` holds size() * output.numel() elements; rank i receives the reduction of block i.
  virtual std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                               bool async = false) = 0;
  // `input` and `output` hold size() equal blocks: block j of the input goes to rank j, block i of the output came
  // from rank i.
  virtual std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input, bool async = false) = 0;
  // Uneven all-to-all (expert parallelism's token dispatch): `input` holds size() consecutive blocks of
  // input_splits[j] elements, block j going to rank j; `output` receives output_splits[i] elements from rank i, in rank
  // order. Rank i's input_splits[j] must equal rank j's output_splits[i] (exchange the counts first).
  virtual std::shared_ptr<Work> all_to_all_v(at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                                             const std::vector<int64_t>& input_splits, bool async = false) = 0;
  virtual std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root, bool async = false) = 0;
  // Point-to-point. MPI matches them by (peer, tag); NCCL ignores the tag and matches each pair of ranks' sends and
  // receives in issue order, so portable callers issue them in the same order on both sides. The MPI backend posts them at once from the calling thread, outside the
  // issue order of collectives, so they never wait behind another group's collectives (pipeline parallelism).
  virtual std::shared_ptr<Work> send(const at::Tensor& tensor, int destination, int tag = 0, bool async = false) = 0;
  virtual std::shared_ptr<Work> recv(at::Tensor& tensor, int source, int tag = 0, bool async = false) = 0;
  // Sends `send` to `destination` while receiving `recv` from `source`, as one operation (a ring shift: every rank
  // sends to the next and receives from the previous without deadlock). Ordered with the collectives.
  virtual std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool async = false) = 0;
  virtual void barrier() = 0;

  // Collective over this communicator: ranks with the same color form a new communicator, ordered by key. A rank
  // passing a negative color joins none and gets nullptr. `size`, when given (> 0), is the number of ranks the caller
  // expects in its new communicator: checked by the MPI backend, and what the fake backend (which has no other ranks
  // to ask) makes it.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name, int size = 0) = 0;

  // Operations not done within this many seconds abort the job with an error naming the operation (a peer died
  // or hangs). torchtitan's comm.init_timeout_seconds until the first step ends, comm.train_timeout_seconds after.
  virtual void set_timeout(std::chrono::seconds timeout) = 0;

  // True when operations on all communicators of this backend execute in one global issue order (the MPI
  // backend's single worker thread), so a later operation may read what an earlier one writes without waiting.
  virtual bool globally_ordered() const { return false; }

  // Whether wait() blocks the calling thread until the operation is done (MPI, local). On NCCL it only makes the
  // caller's stream wait and returns at once, so host time spent in wait() does not measure GPU-side stalls.
  virtual bool waits_block_host() const { return true; }

  // True on the fake backend (comm.mode = "fake_backend"): nothing arrives from other ranks, so a receiver must know
  // a message's shape without being told it (pipeline activations: PipelineRunner).
  virtual bool simulated() const { return false; }

  // Bytes this rank sends in collectives since construction, counted as ring algorithms move them: all-gather and
  // reduce-scatter (n - 1) x shard, all-reduce 2 (n - 1) / n x tensor, all-to-all (n - 1) / n x tensor, uneven all-to-all what
  // goes to other ranks, broadcast and send the tensor.
  virtual int64_t bytes_communicated() const = 0;

 protected:
  std::string name_ = "world";
};

// The process's place in the job, from the launcher's environment: mpirun (OMPI_COMM_WORLD_*), srun (SLURM_*),
// or torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string launcher = "single process";  // "mpirun", "srun", "torchrun", "single process", "fake_backend"
};
LaunchInfo detect_launch();
// comm.mode = "fake_backend" (torchtitan's dry run): one process playing rank RANK (default 0) of NGPU, as torchtitan
// reads them; launcher "fake_backend". A UserError names a variable that is missing, not a number or out of range,
// and a launcher that started more than one process.
LaunchInfo fake_launch();

// The world communicator for this process: MPI when launched by mpirun/srun with more than one rank, the fake one
// for fake_launch()'s, a single-process communicator otherwise. Created once; later calls return the same object.
std::shared_ptr<Communicator> world(const LaunchInfo& launch);

// Local and multi-process implementations, exposed for tests and backends. The single-process communicator's
// tensor_device() is `device` (the trainer's: a one-GPU job keeps its values on the GPU).
std::shared_ptr<Communicator> make_local_communicator(at::Device device = at::Device(at::kCPU), const std::string& name = "world");
std::shared_ptr<Communicator> make_mpi_world();
// The fake backend (comm.mode = "fake_backend"): one process plays rank `rank` of `size` and communicates with no one.
// Every operation returns what it would if every rank were a copy of this one, with the same data and the same
// routing: an all-gather repeats this rank's input, a sum is size() times it, an average, maximum or minimum it, a
// reduce-scatter this rank's block so reduced, an all-to-all this rank's block to itself from every rank (an uneven
// one where a block's length differs, as on expert parallelism's way back, those rows repeated or cut to fit), a ring
// shift what it sends. So shapes, memory and every code path but the transport are this rank's own in
// the full job; values are not the job's. A point-to-point receive (a pipeline neighbour's activation or gradient,
// which is not a copy of anything this rank sends) fills the caller's buffer, whose shape the caller knows, with
// stand-in values: standard normal from a fixed seed for floating-point tensors, zeros otherwise. Splits make fake
// communicators of the size the caller gives (its rank in them is the key).
std::shared_ptr<Communicator> make_fake_world(int rank, int size, at::Device device = at::Device(at::kCPU));
// NCCL over CUDA tensors, bootstrapped through `bootstrap` (any communicator spanning the same ranks) or, when
// null, through a TCP store at MASTER_ADDR:MASTER_PORT. Start-up ends within `init_timeout` with an error naming
// the ranks that did not arrive, or saying that NCCL's own set-up hangs. Throws UserError when titan was built
// without CUDA.
std::shared_ptr<Communicator> make_nccl_world(const LaunchInfo& launch, const std::shared_ptr<Communicator>& bootstrap,
                                              int device_index, std::chrono::seconds init_timeout);

// Collective: every rank's string, on every rank, in rank order (CPU tensors: the MPI or local backend).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

// Convenience: a completed Work.
std::shared_ptr<Work> completed_work();

}  // namespace titan::distributed
