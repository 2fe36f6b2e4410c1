#include "titan/distributed/init_world.h"

#include <unistd.h>

#include <map>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/distributed/checking_communicator.h"

#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace titan::distributed {
namespace {

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown host";
  return name;
}

// "NVIDIA H100 80GB HBM3, bus 0000:19:00.0" (the bus id tells physical GPUs apart across CUDA_VISIBLE_DEVICES).
std::string gpu_identity(const at::Device& device) {
#ifdef TITAN_WITH_CUDA
  if (device.is_cuda()) {
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device.index()) != cudaSuccess) bus[0] = '\0';
    return cat(at::cuda::getDeviceProperties(device.index())->name, ", bus ", bus[0] ? bus : "unknown");
  }
#endif
  return "";
}

}  // namespace

int cuda_device_for(int local_rank, int visible) {
  if (visible < 1) fail("no GPU is visible to this process (CUDA_VISIBLE_DEVICES, or the launcher's GPU binding)");
  if (local_rank < 0) fail("local rank ", local_rank, " is negative");
  return local_rank % visible;
}

ProcessWorld init_world(const LaunchInfo& launch, std::chrono::seconds init_timeout) {
  ProcessWorld out;
  if (!at::hasCUDA()) {
    out.comm = world(launch);
    out.comm->set_timeout(init_timeout);
    out.control = out.comm;
    return out;
  }
#ifdef TITAN_WITH_CUDA
  const int index = cuda_device_for(launch.local_rank, static_cast<int>(c10::cuda::device_count()));
  out.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  // Every allocation that names no index (parameters built without storage, then allocated) lands on this GPU.
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  if (launch.launcher == "fake_backend") {
    out.comm = make_fake_world(launch.rank, launch.world_size, out.device);
    out.control = make_fake_world(launch.rank, launch.world_size);
    return out;
  }
  std::shared_ptr<Communicator> bootstrap;
  if (launch.world_size > 1 && launch.launcher != "torchrun") {
    bootstrap = world(launch);
    bootstrap->set_timeout(init_timeout);
  }
  out.comm = maybe_checking(launch.world_size > 1 ? make_nccl_world(launch, bootstrap, index, init_timeout)
                                                  : make_local_communicator(out.device));
  out.comm->set_timeout(init_timeout);
  // MPI on host memory: the per-step control reduction waits for no GPU work.
  out.control = bootstrap ? bootstrap : out.comm;
  return out;
#else
  fail("LibTorch reports CUDA but titan was built without it (TITAN_WITH_CUDA); rebuild against this LibTorch");
#endif
}

DeviceReport report_devices(Communicator& control, const at::Device& device) {
  const std::string gpu = gpu_identity(device);
  const std::string host = host_name();
  const std::string mine = cat(host, "\t", device.str(), "\t", gpu);
  const auto all = control.size() > 1 ? all_gather_strings(control, mine) : std::vector<std::string>{mine};
  DeviceReport report;
  std::map<std::string, std::vector<int64_t>> by_gpu;  // host and bus id -> ranks
  for (size_t r = 0; r < all.size(); ++r) {
    const auto fields = split(all[r], '\t');
    const std::string& rank_host = fields.at(0);
    const std::string& rank_device = fields.at(1);
    const std::string rank_gpu = fields.size() > 2 ? fields[2] : "";
    report.ranks.push_back(cat("rank ", r, " on ", rank_host, ": ", rank_device, rank_gpu.empty() ? "" : cat(" (", rank_gpu, ")")));
    if (rank_gpu.empty() || rank_gpu.find("bus unknown") != std::string::npos) continue;
    by_gpu[rank_host + " " + rank_gpu.substr(rank_gpu.rfind("bus "))].push_back(static_cast<int64_t>(r));
  }
  for (const auto& [where, ranks] : by_gpu)
    if (ranks.size() > 1) report.shared.push_back(cat("ranks ", join_ints(ranks), " share one GPU (", where, ")"));
  return report;
}

}  // namespace titan::distributed
