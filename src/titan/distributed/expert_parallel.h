// Expert parallelism (torchtitan's ExpertParallel): a grouped-experts module's 3-D weights [experts, ...] split on
// their first dimension over the "ep" ranks, and its tokens dispatched to the rank that holds their expert and
// combined back by uneven all-to-alls. The module's contract is the MoE layer's: inputs {x [N, dim] sorted by expert,
// counts int64 [experts]}, output [N, dim] in the same order.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/nn/unit.h"

namespace titan::distributed {

class ExpertParallel {
 public:
  // `num_experts` must divide by the group's size. `headroom` (may be empty: no check) gives the bytes this rank
  // can still allocate; it is asked at most once a second.
  ExpertParallel(std::shared_ptr<Communicator> group, int64_t num_experts, std::function<double()> headroom = {});

  // Shards `weights` (entries of `params`; they may have no storage yet; w1 [experts, hidden, dim] first) over the
  // group, rank r keeping experts [r E / ep, (r + 1) E / ep) (Shard(0)@ep), and wraps `experts` (named `name` in
  // messages) so that it runs its local experts on the tokens every rank routed to them. Before any token moves,
  // every rank learns every rank's counts and headroom; when the tokens routed to one rank's experts would not fit
  // in its memory (a collapsed router), every rank fails with an error naming the layer, the rank and the counts.
  void apply(const std::string& name, nn::Unit& experts, const std::vector<at::Tensor>& weights, std::vector<ShardedParameter>& params);

  std::string describe() const;

 private:
  std::shared_ptr<Communicator> group_;
  int64_t num_experts_;
  std::function<double()> headroom_;
};

// Expert parallelism that borrows the tensor-parallel ranks (torchtitan's ETP 1): inside a tensor-parallel partial
// region every TP rank routes the same tokens, so each takes its share of them -- chunk t of every expert's rows on TP
// rank t -- before the dispatch, and returns zeros for the rows the other TP ranks handle: the region's output is the
// sum over the TP ranks. Wrap `experts` with this after ExpertParallel::apply.
void split_routed_rows(nn::Unit& experts, std::shared_ptr<Communicator> tp_group);

}  // namespace titan::distributed
