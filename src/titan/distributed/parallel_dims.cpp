#include "titan/distributed/parallel_dims.h"

#include <vector>

#include "titan/common/error.h"

namespace titan::distributed {

ParallelDims ParallelDims::from_config(const config::Parallelism& p, int64_t world_size, bool simulated) {
  const std::string simulated_world = cat("NGPU (", world_size, ", the ranks comm.mode = \"fake_backend\" simulates)");
  ParallelDims d;
  d.world_size = world_size;
  d.pp = p.pipeline_parallel_degree;
  d.dp_replicate = p.data_parallel_replicate_degree;
  d.cp = p.context_parallel_degree;
  d.tp = p.tensor_parallel_degree;
  d.ep = p.expert_parallel_degree;
  d.etp = p.expert_tensor_parallel_degree;
  const int64_t others = d.dp_replicate * d.cp * d.tp * d.pp;
  if (p.data_parallel_shard_degree == -1) {
    if (world_size % others != 0)
      fail("parallelism: ", simulated ? simulated_world : cat("the world size ", world_size), " is not divisible by data_parallel_replicate_degree x "
           "context_parallel_degree x tensor_parallel_degree x pipeline_parallel_degree = ", others,
           ", so data_parallel_shard_degree = -1 cannot take the rest",
           world_size == 1 && !simulated ? cat("; this is one process: launch ", others, " or a multiple under mpirun -np N, srun or torchrun")
                                         : std::string());
    d.dp_shard = world_size / others;
  } else {
    d.dp_shard = p.data_parallel_shard_degree;
  }
  if (d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp != world_size)
    fail("parallelism: data_parallel_replicate_degree (", d.dp_replicate, ") x data_parallel_shard_degree (", d.dp_shard,
         ") x context_parallel_degree (", d.cp, ") x tensor_parallel_degree (", d.tp, ") x pipeline_parallel_degree (",
         d.pp, ") = ", d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp, " must equal ",
         simulated ? simulated_world : cat("the number of processes (", world_size, ")"),
         world_size == 1 && !simulated ? "; this is one process: launch them under mpirun -np N, srun or torchrun" : "");
  if (d.ep > 1 && d.etp != d.tp && d.etp != 1)
    fail("parallelism: expert_tensor_parallel_degree = ", d.etp, " must be 1 or equal to tensor_parallel_degree (", d.tp, ")");
  if (d.ep > 1 && d.ep_borrowed() % d.ep != 0)
    fail("parallelism: expert_parallel_degree = ", d.ep, " must divide the ranks it borrows: data_parallel_shard_degree (", d.dp_shard,
         ") x context_parallel_degree (", d.cp, ")", d.etp == 1 ? cat(" x tensor_parallel_degree (", d.tp, ")") : std::string(),
         " = ", d.ep_borrowed(), d.dp_replicate > 1 ? cat(" (data_parallel_replicate_degree's ", d.dp_replicate,
                                                            " replicas are not borrowed, as in torchtitan)") : std::string());
  return d;
}

std::string ParallelDims::describe() const {
  std::string mode = hsdp_enabled() ? "HSDP" : fsdp_enabled() ? "FSDP" : ddp_enabled() ? "DDP" : "no data parallelism";
  return cat(world_size, " rank(s): pp ", pp, " x dp_replicate ", dp_replicate, " x dp_shard ", dp_shard, " x cp ", cp,
             " x tp ", tp, " (", mode, ")", ep > 1 ? cat("; experts: ep ", ep, " x efsdp ", efsdp()) : std::string());
}

DeviceMesh::DeviceMesh(const ParallelDims& dims, std::shared_ptr<Communicator> world) : dims_(dims), world_(std::move(world)) {
  const std::vector<std::pair<std::string, int64_t>> shape = {
      {"pp", dims.pp}, {"dp_replicate", dims.dp_replicate}, {"dp_shard", dims.dp_shard}, {"cp", dims.cp}, {"tp", dims.tp}};
  int64_t rest = world_->rank();
  for (auto it = shape.rbegin(); it != shape.rend(); ++it) {
    coords_[it->first] = rest % it->second;
    rest /= it->second;
  }
  // A group varies some dimensions and fixes the others: its color encodes the fixed coordinates.
  auto make_group = [&](const std::string& name, const std::vector<std::string>& varying) {
    int64_t color = 0, key = 0, size = 1;
    for (const auto& [dim, degree] : shape) {
      bool varies = std::find(varying.begin(), varying.end(), dim) != varying.end();
      if (varies) {
        key = key * degree + coords_[dim];
        size *= degree;
      } else {
        color = color * degree + coords_[dim];
      }
    }
    groups_[name] = size == 1 ? make_local_communicator(world_->tensor_device(), name)
                              : world_->split(static_cast<int>(color), static_cast<int>(key), name, static_cast<int>(size));
  };
  // Every rank creates the same groups in the same order (splits are collective over the world).
  make_group("pp", {"pp"});
  make_group("dp_replicate", {"dp_replicate"});
  make_group("dp_shard", {"dp_shard"});
  make_group("cp", {"cp"});
  make_group("tp", {"tp"});
  make_group("dp", {"dp_replicate", "dp_shard"});
  make_group("loss", {"dp_replicate", "dp_shard", "cp"});
  // FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp): context-parallel ranks hold the same parameters.
  if (dims_.cp == 1) groups_["dp_shard_cp"] = groups_["dp_shard"];
  else make_group("dp_shard_cp", {"dp_shard", "cp"});
  if (dims_.ep > 1) {
    // The sparse mesh: the borrowed ranks' flat index b (dp_shard slowest) splits into efsdp = b / ep and ep = b % ep.
    int64_t borrowed = 0, fixed = 0;
    for (const auto& [dim, degree] : shape) {
      const bool lent = dim == "dp_shard" || dim == "cp" || (dim == "tp" && dims_.etp == 1);
      (lent ? borrowed : fixed) = (lent ? borrowed : fixed) * degree + coords_[dim];
    }
    const int64_t ep = dims_.ep, efsdp = dims_.efsdp();
    coords_["ep"] = borrowed % ep;
    coords_["efsdp"] = borrowed / ep;
    auto split = [&](const std::string& name, int64_t color, int64_t key, int64_t size) {
      groups_[name] = size == 1 ? make_local_communicator(world_->tensor_device(), name)
                                : world_->split(static_cast<int>(color), static_cast<int>(key), name, static_cast<int>(size));
    };
    split("ep", fixed * efsdp + coords_["efsdp"], coords_["ep"], ep);
    split("efsdp", fixed * ep + coords_["ep"], coords_["efsdp"], efsdp);
    // The experts' own replica groups (HSDP): the same ranks as dp_replicate, a communicator of their own so that
    // each FSDP instance counts its own bytes.
    make_group("dp_replicate_experts", {"dp_replicate"});
  }
}

std::shared_ptr<Communicator> DeviceMesh::get(const std::string& name) const {
  auto it = groups_.find(name);
  if (it == groups_.end()) fail("no mesh dimension named ", name);
  return it->second;
}

void DeviceMesh::set_timeout(std::chrono::seconds timeout) {
  world_->set_timeout(timeout);
  for (auto& [name, group] : groups_) group->set_timeout(timeout);
}

int64_t DeviceMesh::coordinate(const std::string& dim) const {
  auto it = coords_.find(dim);
  if (it == coords_.end()) fail("no mesh dimension named ", dim);
  return it->second;
}

}  // namespace titan::distributed
