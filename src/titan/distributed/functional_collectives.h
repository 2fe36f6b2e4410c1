// Differentiable collectives over one mesh dimension (one Communicator): autograd-aware all-gather,
// reduce-scatter, all-reduce and all-to-all along a tensor dimension, each with the matching backward. Tensor and
// sequence parallelism are built from these; they work on every backend the Communicator has (MPI, NCCL, local).
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <utility>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/nn/float8.h"

namespace titan::distributed::functional {

// What the gradient arriving at an all-gather's output is: a partial sum (each rank used the gathered tensor in
// its own computation, e.g. with its own weight shard: the input gradient is the reduce-scatter of them), or
// the same on every rank (every rank computed the same thing from it: the input gradient is the local chunk).
enum class GatheredGradient { Partial, Replicated };

// Concatenation of every rank's `x` along `dim`, in rank order (Shard(dim) -> Replicate).
at::Tensor all_gather(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group,
                      GatheredGradient gradient = GatheredGradient::Partial);
// Sum over ranks of `x`, of which rank r keeps chunk r along `dim` (Partial -> Shard(dim)); backward all-gathers.
// x.size(dim) must divide by the group size.
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group);
// Sum over ranks (Partial -> Replicate); backward passes the gradient through (it is the same on every rank).
at::Tensor all_reduce(const at::Tensor& x, const std::shared_ptr<Communicator>& group);
// Splits `x` into group-size chunks along `split_dim`, sends chunk j to rank j and concatenates what arrives along
// `concat_dim` in rank order (Shard(concat_dim) -> Shard(split_dim)); backward is the reverse all-to-all.
at::Tensor all_to_all(const at::Tensor& x, int64_t split_dim, int64_t concat_dim, const std::shared_ptr<Communicator>& group);
// Uneven all-to-all of rows (dimension 0): the first input_rows[0] rows of `x` go to rank 0, the next input_rows[1]
// to rank 1, ...; the result holds output_rows[i] rows from rank i in rank order. Backward sends the gradient back.
at::Tensor all_to_all_rows(const at::Tensor& x, const std::vector<int64_t>& output_rows, const std::vector<int64_t>& input_rows,
                           const std::shared_ptr<Communicator>& group);

// Float8 tensor parallelism (torchao's float8 styles; tensorwise scaling): the collectives move one byte per element.
// all_gather_float8 is all_gather with partial gradients whose forward casts each rank's chunk to E4M3 with the
// scale of the whole tensor (the amax all-reduced over the group) and gathers the float8 bytes; it returns the
// gathered values dequantized in x's dtype and the float8 tensor they came from (for nn::float8::register_precast).
// reduce_scatter_float8_backward is reduce_scatter whose backward gathers the gradient that way in E5M2 and
// registers the cast for the float8 linear that receives it.
std::pair<at::Tensor, nn::float8::Operand> all_gather_float8(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group);
at::Tensor reduce_scatter_float8_backward(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group);

// For collectives run asynchronously outside autograd (to overlap them with computation): attaches their result
// to the graph. `gathered` must be the all-gather of `x` along `dim` (backward: the reduce-scatter of partial
// gradients); `scattered` the reduce-scatter of `partial` along `dim` (backward: the all-gather).
at::Tensor attach_all_gather(const at::Tensor& x, const at::Tensor& gathered, int64_t dim, const std::shared_ptr<Communicator>& group);
at::Tensor attach_reduce_scatter(const at::Tensor& partial, const at::Tensor& scattered, int64_t dim,
                                 const std::shared_ptr<Communicator>& group);

// Seconds this process has spent inside these collectives (forward and backward; they are synchronous, so all of
// it is exposed communication time), for the step-time breakdown.
double collective_seconds();

// Adds time spent waiting for asynchronous collectives to collective_seconds().
void add_collective_seconds(double seconds);

// The same operations without autograd (plain tensors in, new tensors out).
namespace raw {
at::Tensor all_gather(const at::Tensor& x, int64_t dim, Communicator& group);
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, Communicator& group);
at::Tensor all_to_all(const at::Tensor& x, int64_t split_dim, int64_t concat_dim, Communicator& group);
at::Tensor all_to_all_rows(const at::Tensor& x, const std::vector<int64_t>& output_rows, const std::vector<int64_t>& input_rows,
                           Communicator& group);
}  // namespace raw

}  // namespace titan::distributed::functional
