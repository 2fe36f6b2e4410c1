// ParallelDims and DeviceMesh as torchtitan: the degrees of pp, dp_replicate, dp_shard, cp and tp (dp_shard = -1
// takes the ranks left over), validated against the world size, and the sub-communicators of each dimension.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "titan/config/job_config.h"
#include "titan/distributed/communicator.h"

namespace titan::distributed {

struct ParallelDims {
  int64_t pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1, ep = 1, etp = 1;
  int64_t world_size = 1;

  // Resolves dp_shard = -1 and checks the product; throws UserError naming the degrees and the world size.
  // `simulated`: the world is comm.mode = "fake_backend"'s NGPU, not the processes launched.
  static ParallelDims from_config(const config::Parallelism& p, int64_t world_size, bool simulated = false);

  int64_t dp_degree() const { return dp_replicate * dp_shard; }  // ranks that read different data
  bool dp_enabled() const { return dp_degree() > 1; }
  bool fsdp_enabled() const { return dp_shard > 1 || cp > 1; }
  bool ddp_enabled() const { return dp_replicate > 1 && dp_shard == 1 && cp == 1; }
  bool hsdp_enabled() const { return dp_replicate > 1 && dp_shard > 1; }
  int64_t non_data_parallel_size() const { return cp * tp * pp; }
  // Expert parallelism borrows its ranks from dp_shard x cp (x tp when etp is 1); the rest shard the experts (FSDP).
  int64_t ep_borrowed() const { return dp_shard * cp * (etp == 1 ? tp : 1); }
  int64_t efsdp() const { return ep_borrowed() / ep; }
  std::string describe() const;
};

// The rank's coordinates in the [pp, dp_replicate, dp_shard, cp, tp] mesh (row-major, tp fastest, as torchtitan)
// and one communicator per dimension ("pp", "dp_replicate", "dp_shard", "cp", "tp") plus the flattened "dp"
// (dp_replicate x dp_shard: data loading), "loss" (dp x cp) and "dp_shard_cp" (dp_shard x cp: FSDP) groups. With
// expert parallelism, torchtitan's sparse mesh too: the ranks dp_shard x cp (x tp when etp is 1) flattened, ep
// fastest, give "ep" (the ranks that split the experts) and "efsdp" (the ranks that shard each expert, FSDP).
class DeviceMesh {
 public:
  DeviceMesh(const ParallelDims& dims, std::shared_ptr<Communicator> world);

  const ParallelDims& dims() const { return dims_; }
  std::shared_ptr<Communicator> world() const { return world_; }
  std::shared_ptr<Communicator> get(const std::string& name) const;
  int64_t coordinate(const std::string& dim) const;
  int64_t dp_rank() const { return coordinate("dp_replicate") * dims_.dp_shard + coordinate("dp_shard"); }
  // Applies to the world and every group.
  void set_timeout(std::chrono::seconds timeout);

 private:
  ParallelDims dims_;
  std::shared_ptr<Communicator> world_;
  std::map<std::string, int64_t> coords_;
  std::map<std::string, std::shared_ptr<Communicator>> groups_;
};

}  // namespace titan::distributed
