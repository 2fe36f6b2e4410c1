// Values stay on the device the computation runs on. A one-GPU job talks through the local communicator, whose
// device used to be the CPU: the gradient norm came back on the CPU (and could not be stacked with the GPU loss),
// and the collective checks refused the GPU seed broadcast. Shown here with the meta device standing in for a GPU:
// it is a device other than the CPU on which LibTorch runs the ops involved without data.
#include <gtest/gtest.h>

#include "titan/common/error.h"
#include "titan/distributed/checking_communicator.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/grad_norm.h"
#include "titan/distributed/init_world.h"
#include "titan/distributed/parallel_dims.h"

using namespace titan::distributed;

namespace {

const at::Device kMeta(at::kMeta);

std::vector<ShardedParameter> parameters_with_gradients(at::Device device) {
  std::vector<ShardedParameter> params;
  for (int64_t rows : {4, 6}) {
    ShardedParameter p;
    p.name = "w" + std::to_string(rows);
    p.local = at::ones({rows, 3}, at::TensorOptions().device(device)).requires_grad_();
    p.local.mutable_grad() = at::full({rows, 3}, 2.0, at::TensorOptions().device(device));
    p.module_param = p.local;
    p.layout = TensorLayout({rows, 3});
    params.push_back(std::move(p));
  }
  return params;
}

}  // namespace

TEST(Devices, LocalCommunicatorAndItsGroupsLiveOnTheProcessDevice) {
  auto local = make_local_communicator(kMeta);
  EXPECT_EQ(local->tensor_device(), kMeta);
  EXPECT_EQ(local->split(0, 0, "child")->tensor_device(), kMeta);
  EXPECT_EQ(make_local_communicator()->tensor_device(), at::Device(at::kCPU));  // CPU processes, as before
  // Every mesh dimension of a one-process job is a group of one: on the world's device, named after its dimension.
  DeviceMesh mesh(ParallelDims::from_config(titan::config::Parallelism{}, 1), local);
  for (const char* dim : {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "loss", "dp_shard_cp"}) {
    EXPECT_EQ(mesh.get(dim)->tensor_device(), kMeta) << dim;
  }
  EXPECT_EQ(mesh.get("tp")->name(), "tp");
}

TEST(Devices, CollectiveChecksAcceptTheProcessDeviceAndNameAnyOther) {
  // The seed broadcast of a one-GPU job: a tensor on the GPU over the local communicator.
  auto checked = make_checking_communicator(make_local_communicator(kMeta));
  at::Tensor on_host = at::zeros({1}, at::kLong);
  try {
    checked->broadcast(on_host, 0);
    FAIL() << "a host tensor was accepted by a communicator whose tensors live on " << kMeta;
  } catch (const titan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("this backend's tensors live on meta"), std::string::npos) << e.what();
  }
}

TEST(Devices, GradientNormStaysOnTheGradientsDevice) {
  // One process: the communicator's device does not matter and nothing moves.
  auto meta_params = parameters_with_gradients(kMeta);
  at::Tensor norm = clip_grad_norm(meta_params, 1.0, *make_local_communicator(at::kCPU));
  EXPECT_EQ(norm.device(), kMeta);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.scalar_type(), at::kFloat);
  EXPECT_EQ(meta_params[0].local.grad().device(), kMeta);
  // And the values on the CPU: sqrt(30 elements x 4) = 10.954..., clipped to norm 1.
  auto params = parameters_with_gradients(at::kCPU);
  norm = clip_grad_norm(params, 1.0, *make_local_communicator(kMeta));
  EXPECT_EQ(norm.device(), at::Device(at::kCPU));
  EXPECT_NEAR(norm.item<double>(), std::sqrt(120.0), 1e-5);
  const double after = std::sqrt(params[0].local.grad().pow(2).sum().item<double>() + params[1].local.grad().pow(2).sum().item<double>());
  EXPECT_NEAR(after, 1.0, 1e-5);
}

TEST(Devices, EachRankTakesAVisibleGpu) {
  EXPECT_EQ(cuda_device_for(0, 8), 0);
  EXPECT_EQ(cuda_device_for(5, 8), 5);
  EXPECT_EQ(cuda_device_for(5, 1), 0);   // one visible GPU per task (SLURM --gpus-per-task)
  EXPECT_EQ(cuda_device_for(9, 8), 1);   // more ranks than GPUs: they share (reported at start-up)
  EXPECT_THROW(cuda_device_for(0, 0), titan::UserError);
}

TEST(Devices, DeviceReportNamesEveryRank) {
  auto report = report_devices(*make_local_communicator(), at::Device(at::kCPU));
  ASSERT_EQ(report.ranks.size(), 1u);
  EXPECT_NE(report.ranks[0].find("rank 0 on "), std::string::npos) << report.ranks[0];
  EXPECT_NE(report.ranks[0].find(": cpu"), std::string::npos) << report.ranks[0];
  EXPECT_TRUE(report.shared.empty());
}
