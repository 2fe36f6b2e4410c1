#include "titan/distributed/functional_collectives.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/distributed/autograd_group.h"

namespace titan::distributed::functional {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::shared_ptr<Communicator> group_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())->group;
}

std::atomic<double> g_seconds{0};

// Adds the lifetime of the scope to g_seconds.
struct Timed {
  double start = now_seconds();
  ~Timed() { g_seconds.fetch_add(now_seconds() - start); }
};

int64_t normalize(int64_t dim, int64_t rank) {
  const int64_t d = dim < 0 ? dim + rank : dim;
  if (d < 0 || d >= rank) fail("collective along dimension ", dim, " of a tensor with ", rank, " dimensions");
  return d;
}

struct AllGather : torch::autograd::Function<AllGather> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, c10::intrusive_ptr<GroupHolder> group,
                            bool partial_gradient) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["partial"] = partial_gradient;
    return raw::all_gather(x, dim, *group->group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto group = group_of(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    at::Tensor grad;
    if (ctx->saved_data["partial"].toBool()) {
      grad = raw::reduce_scatter(grads[0], dim, *group);
    } else {
      grad = grads[0].chunk(group->size(), dim)[group->rank()].contiguous();
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatter : torch::autograd::Function<ReduceScatter> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, c10::intrusive_ptr<GroupHolder> group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["dim"] = dim;
    return raw::reduce_scatter(x, dim, *group->group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {raw::all_gather(grads[0], ctx->saved_data["dim"].toInt(), *group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct AllReduce : torch::autograd::Function<AllReduce> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, c10::intrusive_ptr<GroupHolder> group) {
    Timed timed;
    at::Tensor out = x.contiguous().clone();
    group->group->all_reduce(out, ReduceOp::Sum);
    return out;
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t split_dim, int64_t concat_dim,
                            c10::intrusive_ptr<GroupHolder> group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["split"] = split_dim;
    ctx->saved_data["concat"] = concat_dim;
    return raw::all_to_all(x, split_dim, concat_dim, *group->group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = raw::all_to_all(grads[0], ctx->saved_data["concat"].toInt(), ctx->saved_data["split"].toInt(), *group_of(ctx));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> output_rows, std::vector<int64_t> input_rows,
                            c10::intrusive_ptr<GroupHolder> group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["output_rows"] = output_rows;
    ctx->saved_data["input_rows"] = input_rows;
    return raw::all_to_all_rows(x, output_rows, input_rows, *group->group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = raw::all_to_all_rows(grads[0], ctx->saved_data["input_rows"].toIntVector(),
                                           ctx->saved_data["output_rows"].toIntVector(), *group_of(ctx));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct TensorHolder : torch::CustomClassHolder {
  explicit TensorHolder(at::Tensor t) : tensor(std::move(t)) {}
  at::Tensor tensor;
};

// Forward: a result computed outside autograd; backward: `backward_gather` ? all-gather : reduce-scatter.
struct Attached : torch::autograd::Function<Attached> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<TensorHolder> result, int64_t dim,
                            c10::intrusive_ptr<GroupHolder> group, bool backward_gather) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["gather"] = backward_gather;
    return result->tensor;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto group = group_of(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    at::Tensor grad = ctx->saved_data["gather"].toBool() ? raw::all_gather(grads[0], dim, *group)
                                                          : raw::reduce_scatter(grads[0], dim, *group);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Casts `x` (this rank's chunk) to `dtype` with the scale of the whole tensor over `group` and gathers the float8
// bytes along `dim`.
nn::float8::Operand gather_cast(const at::Tensor& x, int64_t dim, at::ScalarType dtype, Communicator& group) {
  at::NoGradGuard no_grad;
  at::Tensor amax = x.detach().abs().max().to(at::kFloat).reshape({1}).contiguous();
  group.all_reduce(amax, ReduceOp::Max);
  const at::Tensor scale = nn::float8::amax_to_scale(amax.reshape({}), dtype, /*power_of_two=*/false);
  const at::Tensor x8 = nn::float8::scaled_cast(x.detach(), scale, dtype);
  return {raw::all_gather(x8.view(at::kByte), dim, group).view(dtype), scale};
}

at::Tensor dequantized(const nn::float8::Operand& cast, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  return (cast.data.to(at::kFloat) / cast.scale).to(dtype);
}

struct CastHolder : torch::CustomClassHolder {
  nn::float8::Operand cast;
};

struct AllGatherFloat8 : torch::autograd::Function<AllGatherFloat8> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, c10::intrusive_ptr<GroupHolder> group,
                            c10::intrusive_ptr<CastHolder> out) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["dim"] = dim;
    out->cast = gather_cast(x, dim, at::kFloat8_e4m3fn, *group->group);
    return dequantized(out->cast, x.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {raw::reduce_scatter(grads[0], ctx->saved_data["dim"].toInt(), *group_of(ctx)), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterFloat8Backward : torch::autograd::Function<ReduceScatterFloat8Backward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, c10::intrusive_ptr<GroupHolder> group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["dim"] = dim;
    return raw::reduce_scatter(x, dim, *group->group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    nn::float8::Operand cast = gather_cast(grads[0], ctx->saved_data["dim"].toInt(), at::kFloat8_e5m2, *group_of(ctx));
    at::Tensor grad = dequantized(cast, grads[0].scalar_type());
    nn::float8::register_precast(grad, std::move(cast));  // for the float8 linear this gradient reaches next
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, nn::float8::Operand> all_gather_float8(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group) {
  auto holder = c10::make_intrusive<CastHolder>();
  at::Tensor out = AllGatherFloat8::apply(x, dim, hold(group), holder);
  return {out, holder->cast};
}

at::Tensor reduce_scatter_float8_backward(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group) {
  return ReduceScatterFloat8Backward::apply(x, dim, hold(group));
}

double collective_seconds() { return g_seconds.load(); }

void add_collective_seconds(double seconds) { g_seconds.fetch_add(seconds); }

at::Tensor attach_all_gather(const at::Tensor& x, const at::Tensor& gathered, int64_t dim, const std::shared_ptr<Communicator>& group) {
  return Attached::apply(x, c10::make_intrusive<TensorHolder>(gathered), dim, hold(group), /*backward_gather=*/false);
}

at::Tensor attach_reduce_scatter(const at::Tensor& partial, const at::Tensor& scattered, int64_t dim,
                                 const std::shared_ptr<Communicator>& group) {
  return Attached::apply(partial, c10::make_intrusive<TensorHolder>(scattered), dim, hold(group), /*backward_gather=*/true);
}

namespace raw {

at::Tensor all_gather(const at::Tensor& x, int64_t dim, Communicator& group) {
  Timed timed;
  dim = normalize(dim, x.dim());
  const int64_t n = group.size();
  at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] *= n;
  at::Tensor out = at::empty(shape, moved.options());
  group.all_gather_into(out, moved);
  return out.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, Communicator& group) {
  Timed timed;
  dim = normalize(dim, x.dim());
  const int64_t n = group.size();
  if (x.size(dim) % n != 0)
    fail("reduce_scatter along dimension ", dim, ": size ", x.size(dim), " does not divide by the group size ", n);
  at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] /= n;
  at::Tensor out = at::empty(shape, moved.options());
  group.reduce_scatter(out, moved, ReduceOp::Sum);
  return out.movedim(0, dim).contiguous();
}

at::Tensor all_to_all(const at::Tensor& x, int64_t split_dim, int64_t concat_dim, Communicator& group) {
  Timed timed;
  split_dim = normalize(split_dim, x.dim());
  concat_dim = normalize(concat_dim, x.dim());
  const int64_t n = group.size();
  if (x.size(split_dim) % n != 0)
    fail("all_to_all along dimension ", split_dim, ": size ", x.size(split_dim), " does not divide by the group size ", n);
  at::Tensor blocks = at::stack(x.chunk(n, split_dim), 0).contiguous();
  at::Tensor received = at::empty_like(blocks);
  group.all_to_all(received, blocks);
  return at::cat(received.unbind(0), concat_dim);
}

at::Tensor all_to_all_rows(const at::Tensor& x, const std::vector<int64_t>& output_rows, const std::vector<int64_t>& input_rows,
                           Communicator& group) {
  Timed timed;
  if (x.dim() == 0) fail("all_to_all_rows of a scalar");
  const at::Tensor in = x.contiguous();
  int64_t row = 1;
  for (int64_t d = 1; d < x.dim(); ++d) row *= x.size(d);
  int64_t rows = 0;
  for (int64_t n : output_rows) rows += n;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::empty(shape, in.options());
  std::vector<int64_t> out_elements, in_elements;
  for (int64_t n : output_rows) out_elements.push_back(n * row);
  for (int64_t n : input_rows) in_elements.push_back(n * row);
  group.all_to_all_v(out, in, out_elements, in_elements);
  return out;
}

}  // namespace raw

at::Tensor all_gather(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group, GatheredGradient gradient) {
  if (group->size() == 1) return x;
  return AllGather::apply(x, dim, hold(group), gradient == GatheredGradient::Partial);
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const std::shared_ptr<Communicator>& group) {
  if (group->size() == 1) return x;
  return ReduceScatter::apply(x, dim, hold(group));
}

at::Tensor all_reduce(const at::Tensor& x, const std::shared_ptr<Communicator>& group) {
  if (group->size() == 1) return x;
  return AllReduce::apply(x, hold(group));
}

at::Tensor all_to_all(const at::Tensor& x, int64_t split_dim, int64_t concat_dim, const std::shared_ptr<Communicator>& group) {
  if (group->size() == 1) return x;
  return AllToAll::apply(x, split_dim, concat_dim, hold(group));
}

at::Tensor all_to_all_rows(const at::Tensor& x, const std::vector<int64_t>& output_rows, const std::vector<int64_t>& input_rows,
                           const std::shared_ptr<Communicator>& group) {
  if (group->size() == 1) return x;
  return AllToAllRows::apply(x, output_rows, input_rows, hold(group));
}

}  // namespace titan::distributed::functional
