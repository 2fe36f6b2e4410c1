// Tensor (+ sequence) parallel styles, applied to nn::Units from outside as PyTorch's parallelize_module styles
// are: each shards a module's weight over the "tp" mesh dimension (recording its placement on the module's
// ShardedParameter) and wraps the module so its inputs and outputs are redistributed with differentiable
// collectives. Activations are (batch, sequence, features); Shard(1) is sequence parallelism.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/placement.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/nn/float8.h"
#include "titan/nn/unit.h"

namespace titan::distributed {

class TensorParallel {
 public:
  // `params` are the model's parameters (describe_parameters); the styles update the ones they shard.
  TensorParallel(std::shared_ptr<Communicator> group, std::vector<ShardedParameter>& params);

  // Whether the activations of float8 linears are cast to float8 before TP's collectives (torchao's float8 TP
  // styles, for recipe tensorwise: the default). Off for the rowwise recipes, whose linears cast each operand per
  // row themselves, so the collectives move the compute dtype. Set before the styles are applied.
  void cast_float8_activations_before_collectives(bool on) { float8_collectives_ = on; }

  // y = x W^T with W sharded on its output features (Shard(0)): `input` Replicate, or Shard(1) to all-gather the
  // sequence first; `output` Shard(-1) leaves the output features local, Replicate all-gathers them.
  void colwise(nn::Unit& module, at::Tensor& weight, Placement input, Placement output);
  // y = x W^T with W sharded on its input features (Shard(1)); the input is Shard(-1) (a colwise output); the
  // partial sums become `output`: Replicate (all-reduce) or Shard(1) (reduce-scatter over the sequence).
  void rowwise(nn::Unit& module, at::Tensor& weight, Placement output);
  // An embedding table sharded on the vocabulary (Shard(0)): each rank looks up the ids it holds and the partial
  // sums become `output` (Replicate or Shard(1)); the input ids are Replicate.
  void rowwise_embedding(nn::Unit& module, at::Tensor& weight, Placement output);
  // A norm applied to sequence shards (Shard(1) in, Shard(1) out): the weight stays whole (Replicate()@tp); its
  // gradient on each rank is a partial sum over that rank's sequence shard (see reduce_replicated_gradients).
  void sequence_parallel(nn::Unit& module, at::Tensor& weight);
  // A weight kept whole (Replicate()@tp) in a module that sees this rank's share of the work (its heads: Qwen3's
  // q/k norms); its gradients are partial sums that reduce_replicated_gradients adds up.
  void replicated_partial(const at::Tensor& weight) { replicate(weight); }
  // A module entered by sequence shards and left through `rowwise_output` (a rowwise unit inside it whose output
  // is Shard(1)): its first input is all-gathered over the sequence (PrepareModuleInput: Shard(1) -> Replicate;
  // backward reduce-scatters the partial gradients). With `overlap_chunks` > 1 (async TP) the module runs on that
  // many slices of the batch instead: slice k+1's all-gather and slice k-1's reduce-scatter run in the background
  // while slice k computes, so only the first gather and the last reduce-scatter of the forward pass are exposed.
  // Exact because the module treats batch elements independently (attention, feed-forward).
  void sequence_parallel_region(nn::Unit& module, nn::Unit& rowwise_output, int64_t overlap_chunks = 1);

  // A module whose output is a sum over the ranks of their own shares (torchtitan's MoE plan: the routed experts'
  // hidden dimension and the shared experts split, the router whole): its first input is all-gathered over the
  // sequence (Shard(1) -> Replicate; backward reduce-scatters the partial gradients) and its partial output
  // reduce-scattered back into sequence shards (Partial -> Shard(1)). The weights inside are placed with `split`
  // and `replicated_partial`. With `io` Replicate (sampling, without sequence parallelism) the input is used as it
  // is and the partial output all-reduced.
  void partial_region(nn::Unit& module, Placement io = Placement::shard(1));
  // A float8 linear inside a partial region whose weight split() placed along `sharded_dim` takes each scale over the
  // whole tensor or row, as colwise() (dimension 0) and rowwise() (dimension 1) do: its amax all-reduced over the group.
  void float8_scales_over_group(nn::Unit& linear, int64_t sharded_dim);
  // The reduction those linears use for a weight split along `sharded_dim` (0 or 1), for products that are not linear
  // units (the routed experts' low-precision grouped matmuls, nn/float8.h's GroupedMatmuls).
  c10::intrusive_ptr<nn::float8::AmaxReduction> amax_reduction(int64_t sharded_dim) const;
  // `weight` split along `dim` (Shard(dim)@tp) inside a partial region, with no communication of its own.
  void split(at::Tensor& weight, int64_t dim) { shard(weight, dim); }

  const std::shared_ptr<Communicator>& group() const { return group_; }
  // The first vocabulary (or output feature) index this rank holds of a dimension of `size` entries.
  int64_t shard_begin(int64_t size) const;

 private:
  // Replaces `weight` by this rank's chunk along `dim` (without storage when it has none) and records the
  // placement. A weight already sharded this way (a tied one) is left as it is.
  void shard(at::Tensor& weight, int64_t dim);
  void replicate(const at::Tensor& weight);
  ShardedParameter& entry(const at::Tensor& weight);

  std::shared_ptr<Communicator> group_;
  std::vector<ShardedParameter>& params_;
  // Float8 linears inside colwise and rowwise units take their scales from amaxes reduced over the group: per tensor
  // always, per row where the row is split (the output features of a colwise weight, the input features of a rowwise).
  c10::intrusive_ptr<nn::float8::AmaxReduction> colwise_amax_, rowwise_amax_;
  bool float8_collectives_ = true;
  // Rowwise units whose reduction a surrounding overlapped region does itself while the flag is set.
  std::map<const nn::Unit*, std::shared_ptr<bool>> deferred_;
};

// Sums, over `group`, the gradients of the parameters placed Replicate() along `mesh_dim` (sequence-parallel norm
// weights: each rank's gradient is the part from its own sequence shard). Sums are linear, so this may run once per
// step after data parallelism has reduced the gradients (or its shards of them). Collective over `group`.
void reduce_replicated_gradients(const std::vector<ShardedParameter>& params, Communicator& group, const std::string& mesh_dim);
// Whether `param` is one whose gradients reduce_replicated_gradients sums over `mesh_dim`.
bool summed_over(const ShardedParameter& param, const std::string& mesh_dim);

}  // namespace titan::distributed
