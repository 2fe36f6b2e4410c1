#include "titan/distributed/communicator.h"

#include <cstring>

#include <cstdlib>
#include <mutex>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/distributed/checking_communicator.h"
#include "titan/distributed/mpi_runtime.h"

namespace titan::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool completed() override { return true; }
};

// One rank: collectives are identities (avg of one value is the value). Its tensors live on the process's device,
// so that callers moving values "to the communicator's device" keep them where the computation is.
class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(at::Device device, std::string name) : device_(device) { name_ = std::move(name); }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "local"; }
  at::Device tensor_device() const override { return device_; }
  bool globally_ordered() const override { return true; }
  void set_timeout(std::chrono::seconds) override {}
  int64_t bytes_communicated() const override { return 0; }
  std::shared_ptr<Work> all_reduce(at::Tensor&, ReduceOp, bool) override { return completed_work(); }
  std::shared_ptr<Work> all_gather_into(at::Tensor& output, const at::Tensor& input, bool) override {
    if (output.numel() != input.numel()) fail("all_gather_into: output must hold input.numel() elements on one rank");
    output.view(-1).copy_(input.reshape(-1));
    return completed_work();
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp, bool) override {
    if (output.numel() != input.numel()) fail("reduce_scatter: input must hold output.numel() elements on one rank");
    output.view(-1).copy_(input.reshape(-1));
    return completed_work();
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input, bool) override {
    if (output.numel() != input.numel()) fail("all_to_all: output and input must hold the same number of elements");
    output.view(-1).copy_(input.reshape(-1));
    return completed_work();
  }
  std::shared_ptr<Work> all_to_all_v(at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                                     const std::vector<int64_t>& input_splits, bool) override {
    if (output_splits.size() != 1 || input_splits.size() != 1 || output_splits[0] != input_splits[0] ||
        input.numel() != input_splits[0] || output.numel() != output_splits[0])
      fail("all_to_all_v: on one rank the single split must equal both tensors' element counts");
    output.view(-1).copy_(input.reshape(-1));
    return completed_work();
  }
  std::shared_ptr<Work> broadcast(at::Tensor&, int, bool) override { return completed_work(); }
  std::shared_ptr<Work> send(const at::Tensor&, int destination, int, bool) override {
    fail("send to rank ", destination, " in a single-process job");
  }
  std::shared_ptr<Work> recv(at::Tensor&, int source, int, bool) override { fail("recv from rank ", source, " in a single-process job"); }
  std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool) override {
    if (destination != 0 || source != 0) fail("send_recv with ranks ", destination, " and ", source, " in a single-process job");
    recv.copy_(send);
    return completed_work();
  }
  void barrier() override {}
  std::shared_ptr<Communicator> split(int color, int, const std::string& name, int size = 0) override {
    if (color < 0) return nullptr;
    if (size > 1) fail("internal: split ", quote(name), " of a single-process job expects ", size, " ranks");
    return std::make_shared<LocalCommunicator>(device_, name);
  }

 private:
  at::Device device_;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) fail("environment variable ", name, "=", v, " is not a non-negative integer");
  return static_cast<int>(x);
}

std::mutex g_world_mutex;
std::shared_ptr<Communicator> g_world;

}  // namespace

std::shared_ptr<Work> completed_work() { return std::make_shared<DoneWork>(); }

std::shared_ptr<Communicator> make_local_communicator(at::Device device, const std::string& name) {
  return std::make_shared<LocalCommunicator>(device, name);
}

LaunchInfo detect_launch() {
  LaunchInfo info;
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) {
    info.launcher = "mpirun";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) {
    info.launcher = "srun";
    info.rank = env_int("SLURM_PROCID", 0);
    info.world_size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    info.local_world_size = env_int("SLURM_NTASKS_PER_NODE", 1);
  } else if (std::getenv("WORLD_SIZE")) {
    info.launcher = "torchrun";
    info.rank = env_int("RANK", 0);
    info.world_size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", 0);
    info.local_world_size = env_int("LOCAL_WORLD_SIZE", 1);
  }
  if (info.world_size < 1 || info.rank >= info.world_size)
    fail("launcher ", info.launcher, " reports rank ", info.rank, " of world size ", info.world_size);
  return info;
}

std::shared_ptr<Communicator> world(const LaunchInfo& launch) {
  std::lock_guard<std::mutex> lock(g_world_mutex);
  if (g_world) return g_world;
  if (launch.launcher == "fake_backend") {
    g_world = make_fake_world(launch.rank, launch.world_size);  // nothing to check: no other rank takes part
    return g_world;
  }
  if (launch.world_size == 1) {
    g_world = make_local_communicator();
  } else if (launch.launcher == "mpirun" || launch.launcher == "srun") {
    g_world = make_mpi_world();
    if (g_world->size() != launch.world_size || g_world->rank() != launch.rank)
      fail("MPI reports rank ", g_world->rank(), " of ", g_world->size(), " but the ", launch.launcher, " environment says ",
           launch.rank, " of ", launch.world_size, "; with srun use --mpi=pmix so that MPI sees the job");
  } else {
    fail("a ", launch.world_size, "-process job launched by ", launch.launcher,
         " needs MPI for CPU communication: start it with mpirun or srun (--mpi=pmix)");
  }
  g_world = maybe_checking(g_world);
  return g_world;
}

void shutdown() {
  {
    std::lock_guard<std::mutex> lock(g_world_mutex);
    g_world.reset();
  }
  mpi_finalize();
}

// Every rank's string, on every rank (lengths first, then the padded bytes).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.size();
  // Through tensors on the backend's device: NCCL takes GPU tensors only.
  const auto on_device = at::TensorOptions().device(comm.tensor_device());
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), on_device.dtype(at::kLong));
  at::Tensor lengths = at::empty({n}, on_device.dtype(at::kLong));
  comm.all_gather_into(lengths, length);
  lengths = lengths.cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  bytes = bytes.to(comm.tensor_device());
  at::Tensor all = at::empty({longest * n}, on_device.dtype(at::kByte));
  comm.all_gather_into(all, bytes);
  all = all.cpu();
  std::vector<std::string> out;
  const auto* base = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < n; ++r) out.emplace_back(base + r * longest, static_cast<size_t>(lengths[r].item<int64_t>()));
  return out;
}

}  // namespace titan::distributed
