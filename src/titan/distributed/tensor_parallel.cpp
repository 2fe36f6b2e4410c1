#include "titan/distributed/tensor_parallel.h"

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/distributed/functional_collectives.h"
#include "titan/nn/storage.h"

namespace titan::distributed {

namespace fc = functional;

TensorParallel::TensorParallel(std::shared_ptr<Communicator> group, std::vector<ShardedParameter>& params)
    : group_(std::move(group)), params_(params) {
  auto all_reduce_max = [group = group_](at::Tensor& amax) { group->all_reduce(amax, ReduceOp::Max); };
  colwise_amax_ = c10::make_intrusive<nn::float8::AmaxReduction>(all_reduce_max, /*sharded_dim=*/0);
  rowwise_amax_ = c10::make_intrusive<nn::float8::AmaxReduction>(all_reduce_max, /*sharded_dim=*/1);
}

ShardedParameter& TensorParallel::entry(const at::Tensor& weight) {
  ShardedParameter* p = find_parameter(params_, weight);
  if (!p) fail("tensor parallelism: a weight that is not one of the model's parameters");
  return *p;
}

int64_t TensorParallel::shard_begin(int64_t size) const { return chunk(size, group_->size(), group_->rank()).begin; }

void TensorParallel::shard(at::Tensor& weight, int64_t dim) {
  ShardedParameter& p = entry(weight);
  for (const auto& level : p.layout.levels())
    if (level.mesh_dim == "tp") {
      if (level.placement == Placement::shard(dim)) return;  // tied: the embedding's table is the output's weight
      fail("tensor parallelism: ", p.name, " is already placed ", p.layout.str(), ", not Shard(", dim, ")");
    }
  const int64_t n = group_->size(), size = weight.size(dim);
  if (size % n != 0)
    fail("tensor parallelism: ", p.name, " has ", size, " entries along dimension ", dim,
         ", which does not divide by tensor_parallel_degree ", n);
  p.layout = p.layout.then("tp", n, group_->rank(), Placement::shard(dim));
  at::NoGradGuard no_grad;
  const Range r = chunk(size, n, group_->rank());
  if (!nn::has_storage(weight)) {
    std::vector<int64_t> shape = weight.sizes().vec();
    shape[static_cast<size_t>(dim)] = r.length;
    weight.set_data(nn::without_storage(shape, weight.options()));
  } else {
    weight.set_data(weight.detach().narrow(dim, r.begin, r.length).clone());
  }
}

void TensorParallel::replicate(const at::Tensor& weight) {
  ShardedParameter& p = entry(weight);
  p.layout = p.layout.then("tp", group_->size(), group_->rank(), Placement::replicate());
}

void TensorParallel::colwise(nn::Unit& module, at::Tensor& weight, Placement input, Placement output) {
  if (!(input.is_replicate() || input == Placement::shard(1)) || !(output.is_replicate() || output == Placement::shard(-1)))
    fail("tensor parallelism: colwise takes Replicate or Shard(1) inputs and gives Shard(-1) or Replicate outputs");
  shard(weight, 0);
  auto group = group_;
  const bool gather_input = input.is_shard(), gather_output = output.is_replicate();
  module.add_wrapper("tp_colwise", [group, gather_input, gather_output, reduction = colwise_amax_](
                                        const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next) {
    nn::Unit::Inputs in = inputs;
    if (gather_input) in[0] = fc::all_gather(in[0], 1, group, fc::GatheredGradient::Partial);
    at::Tensor y;
    {
      nn::float8::AmaxReductionScope scope(reduction);  // a float8 linear's scales cover the whole weight and output
      y = next(in, context);
    }
    // Every rank computes the same thing from gathered outputs, so their gradient is the same on every rank.
    return gather_output ? fc::all_gather(y, -1, group, fc::GatheredGradient::Replicated) : y;
  });
}

void TensorParallel::rowwise(nn::Unit& module, at::Tensor& weight, Placement output) {
  if (!(output.is_replicate() || output == Placement::shard(1)))
    fail("tensor parallelism: rowwise gives Replicate or Shard(1) outputs");
  shard(weight, 1);
  auto group = group_;
  const bool scatter = output.is_shard();
  // A float8 linear's output gradient is all-gathered in float8 in backward (torchao's Float8RowwiseParallel).
  const bool float8 = float8_collectives_ && module.has_wrapper(nn::float8::kWrapperName);
  auto deferred = std::make_shared<bool>(false);
  deferred_[&module] = deferred;
  module.add_wrapper("tp_rowwise", [group, scatter, float8, deferred, reduction = rowwise_amax_](
                                        const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next) {
    at::Tensor partial;
    {
      nn::float8::AmaxReductionScope scope(reduction);  // a float8 linear's scales cover the whole weight and input
      partial = next(inputs, context);
    }
    if (*deferred) return partial;
    if (scatter) return float8 ? fc::reduce_scatter_float8_backward(partial, 1, group) : fc::reduce_scatter(partial, 1, group);
    return fc::all_reduce(partial, group);
  });
}

void TensorParallel::rowwise_embedding(nn::Unit& module, at::Tensor& weight, Placement output) {
  if (!(output.is_replicate() || output == Placement::shard(1)))
    fail("tensor parallelism: an embedding gives Replicate or Shard(1) outputs");
  const int64_t vocab = weight.size(0);
  shard(weight, 0);
  auto group = group_;
  const Range rows = chunk(vocab, group_->size(), group_->rank());
  const bool scatter = output.is_shard();
  module.add_wrapper("tp_embedding", [group, rows, scatter](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                            const nn::Unit::Next& next) {
    at::Tensor local = inputs[0] - rows.begin;
    at::Tensor outside = local.lt(0).logical_or(local.ge(rows.length));
    local.masked_fill_(outside, 0);
    // Ids held elsewhere contribute zeros (and no gradient) here; the owners' rows arrive through the reduction.
    at::Tensor partial = next({local}, context).masked_fill(outside.unsqueeze(-1), 0);
    return scatter ? fc::reduce_scatter(partial, 1, group) : fc::all_reduce(partial, group);
  });
}

void TensorParallel::partial_region(nn::Unit& module, Placement io) {
  if (!(io.is_replicate() || io == Placement::shard(1)))
    fail("tensor parallelism: a partial region takes and gives Replicate or Shard(1) activations");
  auto group = group_;
  if (io.is_replicate()) {
    module.add_wrapper("tp_partial_region", [group](const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next) {
      return fc::all_reduce(next(inputs, context), group);
    });
    return;
  }
  module.add_wrapper("tp_partial_region", [group](const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next) {
    nn::Unit::Inputs in = inputs;
    in[0] = fc::all_gather(in[0], 1, group, fc::GatheredGradient::Partial);
    return fc::reduce_scatter(next(in, context), 1, group);
  });
}

void TensorParallel::float8_scales_over_group(nn::Unit& linear, int64_t sharded_dim) {
  if (sharded_dim != 0 && sharded_dim != 1) fail("internal: a linear's weight is split along dimension 0 or 1, not ", sharded_dim);
  linear.add_wrapper("tp_float8_scales", [reduction = sharded_dim == 0 ? colwise_amax_ : rowwise_amax_](
                                             const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next) {
    nn::float8::AmaxReductionScope scope(reduction);
    return next(inputs, context);
  });
}

c10::intrusive_ptr<nn::float8::AmaxReduction> TensorParallel::amax_reduction(int64_t sharded_dim) const {
  if (sharded_dim != 0 && sharded_dim != 1) fail("internal: a weight is split along dimension 0 or 1, not ", sharded_dim);
  return sharded_dim == 0 ? colwise_amax_ : rowwise_amax_;
}

void TensorParallel::sequence_parallel(nn::Unit& module, at::Tensor& weight) {
  // The weight's gradient on each rank covers its own sequence shard: reduce_replicated_gradients sums them.
  replicate(weight);
}

bool summed_over(const ShardedParameter& param, const std::string& mesh_dim) {
  for (const auto& level : param.layout.levels())
    if (level.mesh_dim == mesh_dim && level.placement.is_replicate()) return true;
  return false;
}

void reduce_replicated_gradients(const std::vector<ShardedParameter>& params, Communicator& group, const std::string& mesh_dim) {
  if (group.size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (summed_over(p, mesh_dim) && p.local.grad().defined()) grads.push_back(p.local.grad());
  if (grads.empty()) return;
  // One all-reduce for all of them (norm weights are small), in a fixed order on every rank.
  std::vector<at::Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.reshape(-1).to(grads[0].scalar_type()));
  at::Tensor buffer = at::cat(flat);
  group.all_reduce(buffer, ReduceOp::Sum);
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(buffer.narrow(0, offset, g.numel()).view(g.sizes()));
    offset += g.numel();
  }
}

namespace {

// The batch slice [begin, begin + count) of what a unit reads besides its input: per-example masks and positions.
nn::Context slice_context(const nn::Context& context, int64_t batch, int64_t begin, int64_t count) {
  nn::Context out = context;
  if (out.attn_mask.defined() && out.attn_mask.size(0) == batch) out.attn_mask = out.attn_mask.narrow(0, begin, count);
  if (out.documents.defined() && out.documents.size(0) == batch) out.documents = out.documents.narrow(0, begin, count);
  if (out.positions.defined() && out.positions.size(0) == batch) out.positions = out.positions.narrow(0, begin, count);
  return out;
}

// Runs `next` on batch slices with the sequence all-gathers and reduce-scatters in the background (see
// TensorParallel::sequence_parallel_region).
at::Tensor overlapped_region(const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next,
                             const std::shared_ptr<Communicator>& group, int64_t chunks, bool& deferred) {
  const at::Tensor& x = inputs[0];  // (batch, seq / tp, dim)
  const int64_t batch = x.size(0), n = group->size();
  std::vector<at::Tensor> slices = x.split(chunk_capacity(batch, std::min(chunks, batch)), 0);
  struct Slice {
    at::Tensor moved, gathered, partial, scattered;
    std::shared_ptr<Work> gather, scatter;
  };
  std::vector<Slice> work(slices.size());
  // Every all-gather is queued at once: they run in order while the slices before them compute.
  for (size_t k = 0; k < slices.size(); ++k) {
    work[k].moved = slices[k].detach().movedim(1, 0).contiguous();  // (seq / tp, slice, dim)
    std::vector<int64_t> shape = work[k].moved.sizes().vec();
    shape[0] *= n;
    work[k].gathered = at::empty(shape, work[k].moved.options());
    work[k].gather = group->all_gather_into(work[k].gathered, work[k].moved, /*async=*/true);
  }
  auto wait = [](const std::shared_ptr<Work>& w) {
    const double start = now_seconds();
    w->wait();
    functional::add_collective_seconds(now_seconds() - start);
  };
  std::vector<at::Tensor> partials(slices.size());
  int64_t begin = 0;
  deferred = true;
  try {
    for (size_t k = 0; k < slices.size(); ++k) {
      wait(work[k].gather);
      at::Tensor full = fc::attach_all_gather(slices[k], work[k].gathered.movedim(0, 1).contiguous(), 1, group);
      nn::Unit::Inputs in = inputs;
      in[0] = full;
      partials[k] = next(in, slice_context(context, batch, begin, slices[k].size(0)));  // (slice, seq, dim), partial sums
      begin += slices[k].size(0);
      at::Tensor moved = partials[k].detach().movedim(1, 0).contiguous();
      std::vector<int64_t> shape = moved.sizes().vec();
      shape[0] /= n;
      work[k].partial = moved;
      work[k].scattered = at::empty(shape, moved.options());
      work[k].scatter = group->reduce_scatter(work[k].scattered, moved, ReduceOp::Sum, /*async=*/true);
    }
  } catch (...) {
    deferred = false;
    throw;
  }
  deferred = false;
  std::vector<at::Tensor> outputs;
  for (size_t k = 0; k < slices.size(); ++k) {
    wait(work[k].scatter);
    outputs.push_back(fc::attach_reduce_scatter(partials[k], work[k].scattered.movedim(0, 1).contiguous(), 1, group));
  }
  return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
}

}  // namespace

void TensorParallel::sequence_parallel_region(nn::Unit& module, nn::Unit& rowwise_output, int64_t overlap_chunks) {
  auto group = group_;
  if (overlap_chunks <= 1) {
    // When every linear that reads the gathered input is a float8 one, the input is cast before the all-gather,
    // which then moves E4M3 (torchao's PrepareFloat8ModuleInput), and those linears use that cast.
    bool float8 = false;
    for (const auto& child : module.modules(/*include_self=*/false)) {
      if (!float8_collectives_) break;
      auto* linear = dynamic_cast<nn::Linear*>(child.get());
      if (!linear || linear == &rowwise_output) continue;
      if (!linear->has_wrapper(nn::float8::kWrapperName)) {
        float8 = false;
        break;
      }
      float8 = true;
    }
    module.add_wrapper("tp_gather_sequence", [group, float8](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                             const nn::Unit::Next& next) {
      nn::Unit::Inputs in = inputs;
      if (!float8) {
        in[0] = fc::all_gather(in[0], 1, group, fc::GatheredGradient::Partial);
        return next(in, context);
      }
      auto [gathered, cast] = fc::all_gather_float8(in[0], 1, group);
      in[0] = gathered;
      nn::float8::register_precast(gathered, std::move(cast));
      struct Unregister {
        at::Tensor t;
        ~Unregister() { nn::float8::unregister_precast(t); }
      } unregister{gathered};
      return next(in, context);
    });
    return;
  }
  auto it = deferred_.find(&rowwise_output);
  if (it == deferred_.end()) fail("tensor parallelism: the output unit of an overlapped region must be rowwise with Shard(1) output");
  auto deferred = it->second;
  module.add_wrapper("tp_overlapped_region", [group, overlap_chunks, deferred](const nn::Unit::Inputs& inputs,
                                                                               const nn::Context& context,
                                                                               const nn::Unit::Next& next) {
    return overlapped_region(inputs, context, next, group, overlap_chunks, *deferred);
  });
}

}  // namespace titan::distributed
