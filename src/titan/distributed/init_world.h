// The device and communicators a training process starts with, chosen from its launch and what the machine has.
#pragma once
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"

namespace titan::distributed {

struct ProcessWorld {
  at::Device device{at::kCPU};
  // Collectives over `device` tensors: NCCL across GPUs, MPI across CPU processes, the local communicator (on
  // `device`) for one process.
  std::shared_ptr<Communicator> comm;
  // Small host-side reductions that should wait for no device work: MPI where the job has it, else `comm`.
  std::shared_ptr<Communicator> control;
};

// Picks this rank's device -- cuda:(local rank % visible GPUs) when LibTorch sees a GPU, else the CPU -- makes it
// current, and starts communication, failing within `init_timeout` with the ranks that did not arrive. Collective
// over the launch's ranks. Communicators are wrapped by the collective checks when those are on.
ProcessWorld init_world(const LaunchInfo& launch, std::chrono::seconds init_timeout);

// The GPU index a rank takes among the `visible` ones: its local rank modulo their number, so that one visible GPU
// per task (SLURM --gpus-per-task, CUDA_VISIBLE_DEVICES per rank) gives index 0 rather than an invalid ordinal.
int cuda_device_for(int local_rank, int visible);

// One line per rank, gathered over `control` (collective): its host and device, for GPUs with their name and PCI
// bus id. Two ranks on one physical GPU are reported in `shared` (NCCL does not support that).
struct DeviceReport {
  std::vector<std::string> ranks;
  std::vector<std::string> shared;
};
DeviceReport report_devices(Communicator& control, const at::Device& device);

}  // namespace titan::distributed
