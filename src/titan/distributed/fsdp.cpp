// FSDP (ZeRO-3): every parameter (as tensor parallelism left it) is sharded on dim 0 -- Shard(0) over dp_shard,
// rows padded to a multiple of the group size, as FSDP2 -- and the optimizer updates only this rank's rows.
// Units (embedding, each block, norm + output) gather their parameters in the compute dtype just before their
// forward, with the next unit's all-gather prefetched, and free them after forward (reshard_after_forward);
// backward gathers them again (prefetching the previous unit), and once a unit's gradients are complete they are
// reduce-scattered in the reduce dtype, summed into the shards' gradients, and the full parameters freed. HSDP adds an all-reduce of the reduced shards across replica groups.
//
// The model's parameter tensors keep their full shape throughout; only their storage is released and
// re-allocated, so views that autograd saved in forward (such as a transposed weight) see the re-gathered data in
// backward.
#include "titan/distributed/fsdp.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <set>

#include "titan/common/error.h"
#include "titan/config/dtypes.h"
#include "titan/common/strings.h"
#include "titan/nn/storage.h"

namespace titan::distributed {
namespace {


}  // namespace

Fsdp::Fsdp(const std::vector<FsdpUnitSpec>& specs, std::vector<ShardedParameter>& params, std::shared_ptr<Communicator> shard_group,
           std::shared_ptr<Communicator> replicate_group, const FsdpOptions& options)
    : shard_group_(std::move(shard_group)), replicate_group_(std::move(replicate_group)), options_(options) {
  const int64_t n = shard_group_->size(), rank = shard_group_->rank();
  const std::string shard_dim = n > 1 ? shard_group_->name() : "dp_shard";  // "dp_shard", or "dp_shard_cp" under CP
  const int64_t replicas = replicate_group_->size();
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < specs.size(); ++u) {
    Unit unit;
    unit.name = specs[u].name;
    unit.reshard_after_forward = specs[u].reshard_after_forward;
    std::set<const c10::TensorImpl*> excluded;
    for (const nn::Unit* module : specs[u].excluded)
      for (const at::Tensor& p : module->parameters()) excluded.insert(p.unsafeGetTensorImpl());
    for (nn::Unit* module : specs[u].modules) {
      for (at::Tensor p : module->parameters()) {
        if (excluded.count(p.unsafeGetTensorImpl())) continue;
        ShardedParameter* entry = find_parameter(params, p);
        if (!entry) fail("FSDP unit ", unit.name, " has a parameter that is not among the model's parameters");
        if (p.dim() == 0) fail("FSDP shards dimension 0; parameter ", entry->name, " is a scalar");
        Param param;
        param.full_shape = p.sizes().vec();
        param.rows = p.size(0);
        param.row_numel = param.rows == 0 ? 0 : p.numel() / param.rows;
        param.shard_rows = (param.rows + n - 1) / n;
        if (options_.float8) {
          auto it = options_.float8->weights.find(p.unsafeGetTensorImpl());
          if (it != options_.float8->weights.end()) param.float8 = it->second;
        }
        param.offset = unit.local_numel;
        unit.local_numel += param.shard_numel();
        int64_t& gather_numel = param.float8 ? unit.gather_numel8 : unit.gather_numel;
        param.gather_offset = gather_numel;
        gather_numel += param.shard_numel();
        // This rank's rows, zero-padded, in the training dtype: the tensor the optimizer owns.
        TensorLayout layout = entry->layout.then(shard_dim, n, rank, Placement::shard(0));
        if (replicas > 1) layout = layout.then("dp_replicate", replicas, replicate_group_->rank(), Placement::replicate());
        std::vector<int64_t> shard_shape = param.full_shape;
        shard_shape[0] = param.shard_rows;
        if (layout.padded_local_shape() != shard_shape)
          fail("FSDP: parameter ", entry->name, " placed ", layout.str(), " does not shard into [", join_ints(shard_shape), "]");
        const auto device_options = at::TensorOptions().device(options_.device).requires_grad(false);
        param.shard = at::zeros(shard_shape, device_options.dtype(options_.shard_dtype));
        const Range mine = chunk(param.rows, n, rank);
        if (mine.length > 0 && nn::has_storage(p))
          param.shard.narrow(0, 0, mine.length).copy_(p.detach().narrow(0, mine.begin, mine.length));
        param.shard.requires_grad_(true);
        entry->local = param.shard;
        entry->layout = layout;
        // The model's parameter becomes a full-shape tensor in the compute dtype whose storage comes and goes.
        p.set_data(nn::without_storage(param.full_shape, device_options.dtype(options_.param_dtype)));
        param.module_param = p;
        auto accumulator = torch::autograd::impl::grad_accumulator(p);
        accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, u, alive = alive_](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
              if (*alive) on_gradient(u);
              return outputs;
            }));
        accumulators_.push_back(accumulator);
        nn::free_storage(p);
        unit.params.push_back(std::move(param));
      }
    }
    units_.push_back(std::move(unit));
  }
  for (size_t u = 0; u < specs.size(); ++u) {
    if (units_[u].params.empty()) continue;
    specs[u].modules.front()->add_wrapper(
        "fsdp_unshard", [this, u, alive = alive_](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                  const nn::Unit::Next& next) {
          if (!*alive) fail("the model's FSDP wrapping was destroyed; a model sharded by FSDP cannot run without it");
          unshard(u);
          // Inside autograd's backward this is a recomputed forward (activation checkpointing): the next unit's turn
          // has passed. (Asked of the engine, not kept as a flag: a pipeline's forwards come between its backwards.)
          for (size_t v = u + 1; v < units_.size() && torch::autograd::get_current_graph_task_id() == -1; ++v)
            if (!units_[v].params.empty()) {
              start_gather(v);  // prefetch the next unit's parameters while this one computes
              break;
            }
          return next(inputs, context);
        });
    specs[u].modules.back()->add_wrapper(
        "fsdp_reshard", [this, u, alive = alive_](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                  const nn::Unit::Next& next) {
          at::Tensor out = next(inputs, context);
          if (units_[u].reshard_after_forward) reshard(u);
          if (at::GradMode::is_enabled() && out.requires_grad())
            out.register_hook([this, u, alive](const at::Tensor& grad) {
              if (*alive) pre_backward(u);
              return grad;
            });
          return out;
        });
  }
}

Fsdp::~Fsdp() { *alive_ = false; }

void Fsdp::start_gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.state != Unit::State::Sharded) return;
  at::NoGradGuard no_grad;
  const int64_t n = shard_group_->size();
  if (unit.gather_numel8 > 0) {
    // Float8 weights: each shard cast to E4M3 with its whole weight's scale, gathered as bytes.
    unit.scales8 = float8_scales(u);
    std::vector<at::Tensor> pieces;
    int64_t i = 0;
    for (auto& p : unit.params)
      if (p.float8)
        pieces.push_back(nn::float8::scaled_cast(p.shard.detach().reshape(-1), unit.scales8[i++], at::kFloat8_e4m3fn).view(at::kByte));
    at::Tensor local = at::cat(pieces);
    unit.gathered8 = at::empty({local.numel() * n}, local.options());
    unit.gather_work8 = shard_group_->all_gather_into(unit.gathered8, local, /*async=*/true);
    bytes_gathered_ += (n - 1) * local.numel();
    float8_bytes_gathered_ += (n - 1) * local.numel();
  }
  if (unit.gather_numel > 0) {
    std::vector<at::Tensor> pieces;
    for (auto& p : unit.params)
      if (!p.float8) pieces.push_back(p.shard.detach().reshape(-1));
    at::Tensor local = at::cat(pieces).to(options_.param_dtype);
    unit.gathered = at::empty({local.numel() * n}, local.options());
    unit.gather_work = shard_group_->all_gather_into(unit.gathered, local, /*async=*/true);
    bytes_gathered_ += (n - 1) * local.numel() * local.element_size();
  }
  unit.state = Unit::State::Gathering;
}

at::Tensor Fsdp::float8_scales(size_t u) {
  std::vector<at::Tensor> scales;
  if (options_.float8->precompute_scales) {
    // The first gather after a start or a checkpoint load computes every weight's scale; after that the optimizer
    // step does (after_optimizer_step).
    if (!float8_scales_fresh_) precompute_float8_scales();
    for (auto& p : units_[u].params)
      if (p.float8) scales.push_back(p.float8_scale);
    return at::stack(scales);
  }
  // torchao's dynamic scale: the amax of the whole weight, from each rank's shard (padding is zeros), one
  // all-reduce for the unit's float8 weights.
  std::vector<at::Tensor> amax;
  for (auto& p : units_[u].params)
    if (p.float8) amax.push_back(p.shard.detach().abs().max().to(at::kFloat));
  at::Tensor all = at::stack(amax);
  shard_group_->all_reduce(all, ReduceOp::Max);
  if (options_.float8->tp_group && options_.float8->tp_group->size() > 1) options_.float8->tp_group->all_reduce(all, ReduceOp::Max);
  return nn::float8::amax_to_scale(all, at::kFloat8_e4m3fn, /*power_of_two=*/false);
}

void Fsdp::precompute_float8_scales() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> amax;
  for (auto& unit : units_)
    for (auto& p : unit.params)
      if (p.float8) amax.push_back(p.shard.detach().abs().max().to(at::kFloat));
  if (amax.empty()) return;
  at::Tensor all = at::stack(amax);
  shard_group_->all_reduce(all, ReduceOp::Max);
  if (options_.float8->tp_group && options_.float8->tp_group->size() > 1) options_.float8->tp_group->all_reduce(all, ReduceOp::Max);
  const at::Tensor scales = nn::float8::amax_to_scale(all, at::kFloat8_e4m3fn, /*power_of_two=*/false);
  int64_t i = 0;
  for (auto& unit : units_)
    for (auto& p : unit.params)
      if (p.float8) p.float8_scale = scales[i++];
  float8_scales_fresh_ = true;
}

void Fsdp::after_optimizer_step() {
  // torchtitan's optimizer post-step hook: the scales the next step's float8 gathers use, in one all-reduce.
  if (options_.float8 && options_.float8->precompute_scales) precompute_float8_scales();
}

void Fsdp::unshard(size_t u) {
  Unit& unit = units_[u];
  if (unit.state == Unit::State::Unsharded) return;
  start_gather(u);
  auto start = std::chrono::steady_clock::now();
  if (unit.gather_work) unit.gather_work->wait();
  if (unit.gather_work8) unit.gather_work8->wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  at::NoGradGuard no_grad;
  const int64_t n = shard_group_->size();
  // Rank i's rows of a parameter sit at [offset, offset + shard numel) of block i of its buffer.
  auto unpack = [n](const at::Tensor& all, const Param& p, const at::Tensor& target) {
    at::Tensor source = all.narrow(1, p.gather_offset, p.shard_numel()).view({n, p.shard_rows, p.row_numel});
    for (int64_t i = 0; i < n; ++i) {
      const int64_t begin = i * p.shard_rows, count = std::min(p.shard_rows, p.rows - begin);
      if (count <= 0) break;
      target.narrow(0, begin, count).copy_(source[i].narrow(0, 0, count));
    }
  };
  int64_t float8_index = 0;
  for (auto& p : unit.params) {
    if (p.float8) {
      // The float8 weight goes to its linear's slot; the parameter itself stays without storage.
      at::Tensor full = at::empty({p.rows, p.row_numel}, unit.gathered8.options());
      unpack(unit.gathered8.view({n, unit.gather_numel8}), p, full);
      p.float8->weight = {full.view(at::kFloat8_e4m3fn).view(p.full_shape), unit.scales8[float8_index++]};
      continue;
    }
    nn::allocate_storage(p.module_param);
    // variable_data(): write the values without bumping the parameter's version (autograd saved it in forward).
    unpack(unit.gathered.view({n, unit.gather_numel}), p, p.module_param.variable_data().view({p.rows, p.row_numel}));
  }
  unit.gathered = unit.gathered8 = at::Tensor();
  unit.gather_work.reset();
  unit.gather_work8.reset();
  unit.state = Unit::State::Unsharded;
}

void Fsdp::reshard(size_t u) {
  Unit& unit = units_[u];
  if (unit.state == Unit::State::Gathering) {
    if (unit.gather_work) unit.gather_work->wait();
    if (unit.gather_work8) unit.gather_work8->wait();
  }
  for (auto& p : unit.params) {
    if (p.float8) p.float8->weight = {};
    else nn::free_storage(p.module_param);
  }
  unit.gathered = unit.gathered8 = unit.scales8 = at::Tensor();
  unit.gather_work.reset();
  unit.gather_work8.reset();
  unit.state = Unit::State::Sharded;
}

void Fsdp::pre_backward(size_t u) {
  unshard(u);
  for (size_t v = u; v-- > 0;)
    if (!units_[v].params.empty()) {
      start_gather(v);  // prefetch the unit backward reaches next
      break;
    }
}

void Fsdp::on_gradient(size_t u) {
  if (options_.defer_gradient_reduction) return;
  Unit& unit = units_[u];
  if (++unit.grads_ready == static_cast<int64_t>(unit.params.size())) reduce(u);
}

void Fsdp::reduce(size_t u) {
  Unit& unit = units_[u];
  at::NoGradGuard no_grad;
  // At most one reduction of this micro-batch in flight, as PyTorch's FSDP2: the previous one finishes (it overlapped
  // this unit's backward) before this one's buffer exists. Without the wait, when backward outruns the communication
  // every unit's full-size buffer waited in the queue: debugmodel_moe's 128 experts on FSDP 4 (302 MB per block)
  // peaked 0.5 GiB higher with 2 blocks. With NCCL the wait orders the streams without blocking the host.
  if (pending_.size() > earlier_pending_) {
    auto start = std::chrono::steady_clock::now();
    pending_.back().work->wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // An optimizer step in backward: the finished reduction's gradients (and earlier micro-batches') go into the
    // shards now, and the listener steps them while backward goes on.
    if (pending_.back().final) {
      accumulate(pending_.size());
      earlier_pending_ = 0;
    }
  }
  const int64_t n = shard_group_->size();
  auto options = unit.params.front().shard.options().dtype(options_.reduce_dtype).requires_grad(false);
  at::Tensor input = at::zeros({n, unit.local_numel}, options);
  for (auto& p : unit.params) {
    at::Tensor grad = p.module_param.grad();
    if (grad.defined()) {
      // Converted to the reduce dtype as it is copied: no full-size converted copy of the gradient (for a unit of 128
      // experts, a 100 MB float32 temporary beside the unit's gradients and this buffer).
      at::Tensor g = grad.reshape({p.rows, p.row_numel});
      at::Tensor blocks = input.narrow(1, p.offset, p.shard_numel()).view({n, p.shard_rows, p.row_numel});
      for (int64_t i = 0; i < n; ++i) {
        const int64_t begin = i * p.shard_rows, count = std::min(p.shard_rows, p.rows - begin);
        if (count <= 0) break;
        blocks[i].narrow(0, 0, count).copy_(g.narrow(0, begin, count));
      }
    }
    p.module_param.mutable_grad() = at::Tensor();
  }
  reshard(u);
  at::Tensor reduced = at::empty({unit.local_numel}, options);
  auto work = shard_group_->reduce_scatter(reduced, input.view(-1), ReduceOp::Sum, /*async=*/true);
  if (replicate_group_->size() > 1) {
    // The all-reduce reads what the reduce-scatter writes. With MPI both run in issue order on one thread; with NCCL
    // wait() orders the streams without blocking the host.
    if (!(shard_group_->globally_ordered() && replicate_group_->globally_ordered())) work->wait();
    work = replicate_group_->all_reduce(reduced, ReduceOp::Sum, /*async=*/true);
  }
  pending_.push_back(Pending{u, reduced, work, listener_ && (last_microbatch_ || options_.defer_gradient_reduction)});
  unit.grads_ready = 0;
  unit.reduced_this_backward = true;
}

void Fsdp::after_backward() {
  if (options_.defer_gradient_reduction) return;
  // Units some of whose parameters received no gradient (unused in this pass) are reduced now, in reverse unit
  // order on every rank, with zeros for the missing gradients.
  for (size_t u = units_.size(); u-- > 0;) {
    Unit& unit = units_[u];
    if (!unit.params.empty() && !unit.reduced_this_backward) reduce(u);
    unit.reduced_this_backward = false;
  }
  // Earlier micro-batches' reductions are long done: fold them into the shard gradients so that at most two
  // micro-batches' reduced gradients are held at once; this one's overlaps the next forward.
  accumulate(earlier_pending_);
  earlier_pending_ = pending_.size();
}

void Fsdp::finish_gradients() {
  if (options_.defer_gradient_reduction) {
    for (size_t u = units_.size(); u-- > 0;)
      if (!units_[u].params.empty()) reduce(u);
    for (auto& unit : units_) unit.reduced_this_backward = false;
  }
  accumulate(pending_.size());
  earlier_pending_ = 0;
  // A unit gathered during backward but not used by it (a prefetch from a recomputed forward: activation
  // checkpointing around a block whose submodule is a unit, as expert parallelism's experts) holds values the
  // optimizer is about to change: drop them.
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].state != Unit::State::Sharded) reshard(u);
}

void Fsdp::accumulate(size_t count) {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < count; ++k) {
    auto& pending = pending_[k];
    auto start = std::chrono::steady_clock::now();
    pending.work->wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (auto& p : units_[pending.unit].params) {
      at::Tensor view = pending.reduced.narrow(0, p.offset, p.shard_numel()).view(p.shard.sizes());
      at::Tensor slice = view.to(p.shard.scalar_type());
      if (p.shard.grad().defined()) p.shard.mutable_grad().add_(slice);
      else p.shard.mutable_grad() = slice.is_same(view) ? slice.clone() : slice;  // a converted slice is already a copy
    }
    // The unit's reduced buffer is done with: freed now, not when every unit's is, so that the gradients are not held
    // twice at the end of backward (the shards' and the buffers').
    pending.reduced = at::Tensor();
    if (pending.final) {
      std::vector<at::Tensor> shards;
      for (auto& p : units_[pending.unit].params) shards.push_back(p.shard);
      listener_(shards);
    }
  }
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(count));
}

std::string Fsdp::describe() const {
  int64_t local = 0;
  for (const auto& unit : units_) local += unit.local_numel;
  std::string mode = replicate_group_->size() > 1 ? cat("HSDP: ", replicate_group_->size(), " replica groups x ",
                                                        shard_group_->size(), " shards")
                                                  : cat("FSDP over ", shard_group_->size(), " ranks");
  return cat(mode, "; ", units_.size(), " units, ", with_thousands(local), " parameter elements on this rank; gather in ",
             titan::config::dtype_name(options_.param_dtype), ", reduce in ", titan::config::dtype_name(options_.reduce_dtype),
             ", reshard_after_forward ", options_.reshard_after_forward,
             options_.defer_gradient_reduction ? "; gradients reduced once per step (pipeline)" : "", float8_summary());
}

std::string Fsdp::float8_summary() const {
  int64_t weights = 0, elements = 0;
  for (const auto& unit : units_) {
    elements += unit.gather_numel8;
    for (const auto& p : unit.params) weights += p.float8 ? 1 : 0;
  }
  if (weights == 0) return "";
  return cat("; ", weights, " float8 linear weights (", with_thousands(elements), " elements on this rank) gathered in float8",
             options_.float8->precompute_scales ? " with scales precomputed after each optimizer step" : "");
}

int64_t Fsdp::bytes_communicated() const {
  return shard_group_->bytes_communicated() + (replicate_group_->size() > 1 ? replicate_group_->bytes_communicated() : 0);
}

void Fsdp::unshard_all() {
  for (size_t u = 0; u < units_.size(); ++u) unshard(u);
}

void Fsdp::reshard_all() {
  for (size_t u = 0; u < units_.size(); ++u) reshard(u);
}

}  // namespace titan::distributed
