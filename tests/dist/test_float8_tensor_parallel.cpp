// Rowwise float8 linears under tensor parallelism on real MPI ranks (2 and 4): TensorParallel's column- and
// row-parallel styles on float8 linear units take each per-row scale from the whole row, as torchao's casts of
// DTensors do, where a row is split over the ranks: the row-parallel linear's input (its rows run along the split
// input features) in forward, and the column-parallel linear's output gradient in backward.
//
// The weights are identity matrices, so each output element is one dequantised input element times 1 (and the sums
// over ranks add zeros): the results are the float8 values themselves, compared bitwise with one process. The
// second half of every row is 2^-17 times smaller than the first, so with the whole row's power-of-two scale those
// elements fall into E4M3's subnormals or flush to zero, while the ranks holding only them would keep them if each
// took its own amax.
//
// The same for the MoE experts' float8 grouped products (quantize.grouped_mm.float8) with their hidden dimension
// split as torchtitan's MoE plan splits it: the down product's input rows (forward) and the gate/up products' output
// gradient rows (backward) take their scales over every rank's piece.
#include <gtest/gtest.h>

#include "titan/distributed/communicator.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/nn/float8.h"
#include "titan/nn/unit.h"

using namespace titan;

namespace {

struct TwoLinears : torch::nn::Module {
  explicit TwoLinears(int64_t k) {
    column = register_module("column", std::make_shared<nn::Linear>(k, k));
    row = register_module("row", std::make_shared<nn::Linear>(k, k));
    at::NoGradGuard no_grad;
    column->weight.copy_(at::eye(k));
    row->weight.copy_(at::eye(k));
  }
  std::shared_ptr<nn::Linear> column, row;
};

void convert(nn::Linear& linear, const nn::float8::Recipe& recipe) {
  nn::Linear* self = &linear;
  linear.add_innermost_wrapper(nn::float8::kWrapperName, [self, recipe](const nn::Unit::Inputs& in, const nn::Context&,
                                                                        const nn::Unit::Next&) {
    return nn::float8::linear(in[0], self->weight, recipe, /*emulate=*/true);
  });
}

// Rows of 8 tokens over `k` features: normal values, the second half of every row scaled by 2^-17.
at::Tensor rows(int64_t k, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({8, k}, gen, at::kDouble).to(at::kFloat);
  x.narrow(1, k / 2, k / 2).mul_(std::ldexp(1.0, -17));
  return x;
}

void check(const std::string& recipe_name) {
  auto world = distributed::world(distributed::detect_launch());
  const int n = world->size(), r = world->rank();
  const int64_t k = 16 * n, local = k / n;
  const nn::float8::Recipe recipe = nn::float8::recipe(recipe_name);

  TwoLinears model(k);
  convert(*model.column, recipe);
  convert(*model.row, recipe);
  auto params = distributed::describe_parameters(model);
  distributed::TensorParallel tp(world, params);
  tp.cast_float8_activations_before_collectives(false);
  tp.colwise(*model.column, model.column->weight, distributed::Placement::replicate(), distributed::Placement::shard(-1));
  tp.rowwise(*model.row, model.row->weight, distributed::Placement::replicate());

  const at::Tensor eye = at::eye(k);
  // Row-parallel forward: the input's rows are split along the contraction (input features).
  const at::Tensor x = rows(k, 1);
  const at::Tensor out = model.row->call({x.narrow(1, r * local, local).contiguous()}, nn::Context{});
  const at::Tensor one_out = nn::float8::linear(x, eye, recipe, true).detach();
  EXPECT_TRUE(at::equal(out.detach(), one_out)) << recipe_name << ": row-parallel output differs from one process's by "
                                                << (out.detach() - one_out).abs().max().item<double>();
  // The whole row's scale flushes or rounds most of the small half: a rank scaling its own part would not.
  const at::Tensor small = x.narrow(1, k / 2, k / 2), small_out = one_out.narrow(1, k / 2, k / 2);
  EXPECT_GT(small_out.ne(small).sum().item<int64_t>(), small.numel() / 2) << recipe_name;

  // Column-parallel backward: the output gradient's rows are split along the input gradient's contraction (the
  // output features).
  const at::Tensor xc = at::randn({8, k}).requires_grad_();
  const at::Tensor g = rows(k, 2);
  model.column->call({xc}, nn::Context{}).backward(g.narrow(1, r * local, local).contiguous());
  at::Tensor dx = xc.grad().clone();
  world->all_reduce(dx, distributed::ReduceOp::Sum);  // each rank's part of the input gradient
  const at::Tensor xo = xc.detach().clone().requires_grad_();
  nn::float8::linear(xo, eye, recipe, true).backward(g);
  EXPECT_TRUE(at::equal(dx, xo.grad())) << recipe_name << ": column-parallel input gradient differs from one process's by "
                                        << (dx - xo.grad()).abs().max().item<double>();
  EXPECT_GT(xo.grad().narrow(1, k / 2, k / 2).ne(g.narrow(1, k / 2, k / 2)).sum().item<int64_t>(), small.numel() / 2) << recipe_name;
}

}  // namespace

TEST(Float8TensorParallel, RowwiseScalesSpanRowsSplitOverRanks) {
  check("rowwise");
  check("rowwise_with_gw_hp");
}

namespace {

// Expert weights [2, k, k], each expert's matrix the identity.
at::Tensor identity_experts(int64_t k) { return at::eye(k).unsqueeze(0).repeat({2, 1, 1}).contiguous(); }

}  // namespace

TEST(Float8TensorParallel, GroupedProductScalesSpanHiddenUnitsSplitOverRanks) {
  auto world = distributed::world(distributed::detect_launch());
  const int n = world->size(), r = world->rank();
  const int64_t k = 16 * n, local = k / n;
  const auto cast = nn::float8::GroupedCast::float8_rowwise;
  const at::Tensor counts = at::tensor(std::vector<int64_t>{3, 5}, at::kLong);  // 8 tokens: 3 to expert 0, 5 to 1
  const at::Tensor w = identity_experts(k);
  std::vector<distributed::ShardedParameter> params;
  distributed::TensorParallel tp(world, params);

  // The down product (w2, split along its input: the hidden units): each rank's partial output, summed.
  const at::Tensor x = rows(k, 3);
  at::Tensor out = nn::float8::grouped_linear(x.narrow(1, r * local, local).contiguous(),
                                              w.narrow(2, r * local, local).contiguous(), counts, cast, tp.amax_reduction(1));
  out = out.detach().clone();
  world->all_reduce(out, distributed::ReduceOp::Sum);
  const at::Tensor one_out = nn::float8::grouped_linear(x, w, counts, cast).detach();
  EXPECT_TRUE(at::equal(out, one_out)) << "the down product's output differs from one process's by "
                                       << (out - one_out).abs().max().item<double>();
  EXPECT_GT(one_out.narrow(1, k / 2, k / 2).ne(x.narrow(1, k / 2, k / 2)).sum().item<int64_t>(), 8 * k / 4);

  // The gate/up products (w1, w3, split along their output: the hidden units): the input gradient from each rank's
  // part of the output gradient, summed.
  const at::Tensor xs = at::randn({8, k}).requires_grad_();
  const at::Tensor g = rows(k, 4);
  nn::float8::grouped_linear(xs, w.narrow(1, r * local, local).contiguous(), counts, cast, tp.amax_reduction(0))
      .backward(g.narrow(1, r * local, local).contiguous());
  at::Tensor dx = xs.grad().clone();
  world->all_reduce(dx, distributed::ReduceOp::Sum);
  const at::Tensor xo = xs.detach().clone().requires_grad_();
  nn::float8::grouped_linear(xo, w, counts, cast).backward(g);
  EXPECT_TRUE(at::equal(dx, xo.grad())) << "the gate/up products' input gradient differs from one process's by "
                                        << (dx - xo.grad()).abs().max().item<double>();
  EXPECT_GT(xo.grad().narrow(1, k / 2, k / 2).ne(g.narrow(1, k / 2, k / 2)).sum().item<int64_t>(), 8 * k / 4);
}
