// The dispatch: each rank sorts its tokens by expert (the MoE layer does), sends every rank the count of its rows
// for each of that rank's experts (an all-to-all of [experts] counts), then the rows themselves (an uneven
// all-to-all); the rows that arrive, grouped by source rank and within it by expert, are reordered expert by expert
// (within an expert by source rank: the order one process would see them in), run through the local experts, put
// back in arrival order and returned by the reverse all-to-all. Autograd runs the same exchanges backwards.
#include "titan/distributed/expert_parallel.h"

#include <ATen/autocast_mode.h>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/common/test_faults.h"
#include "titan/distributed/functional_collectives.h"
#include "titan/nn/storage.h"

namespace titan::distributed {

namespace fc = functional;

ExpertParallel::ExpertParallel(std::shared_ptr<Communicator> group, int64_t num_experts, std::function<double()> headroom)
    : group_(std::move(group)), num_experts_(num_experts), headroom_(std::move(headroom)) {
  if (num_experts_ % group_->size() != 0)
    fail("expert parallelism: ", num_experts_, " experts do not divide over expert_parallel_degree = ", group_->size());
}

std::string ExpertParallel::describe() const {
  return cat("Expert parallelism over ", group_->size(), " ranks: ", num_experts_ / group_->size(),
             " of the ", num_experts_, " experts per rank, tokens dispatched and combined by all-to-all");
}

void ExpertParallel::apply(const std::string& name, nn::Unit& experts, const std::vector<at::Tensor>& weights,
                           std::vector<ShardedParameter>& params) {
  const int64_t n = group_->size(), rank = group_->rank(), local = num_experts_ / n;
  if (weights.empty() || weights[0].dim() != 3) fail("expert parallelism: ", name, " needs its 3-D w1 [experts, hidden, dim] first");
  // Per received row: the row and its output (dim each), the two hidden projections and their product (hidden each).
  const int64_t row_elements = 2 * weights[0].size(2) + 3 * weights[0].size(1);
  at::NoGradGuard no_grad;
  for (const at::Tensor& w : weights) {
    ShardedParameter* p = find_parameter(params, w);
    if (!p) fail("expert parallelism: a weight that is not one of the model's parameters");
    if (w.dim() < 1 || w.size(0) != num_experts_)
      fail("expert parallelism: ", p->name, " has shape [", join_ints(w.sizes().vec()), "], not ", num_experts_, " experts first");
    p->layout = p->layout.then("ep", n, rank, Placement::shard(0));
    at::Tensor weight = w;
    if (!nn::has_storage(weight)) {
      std::vector<int64_t> shape = weight.sizes().vec();
      shape[0] = local;
      weight.set_data(nn::without_storage(shape, weight.options()));
    } else {
      weight.set_data(weight.detach().narrow(0, rank * local, local).clone());
    }
  }
  auto group = group_;
  // This rank's headroom, asked at most once a second (reading it may mean reading /proc files).
  auto headroom = [source = headroom_, cached = std::make_shared<std::pair<double, double>>(-1.0, 0.0)]() -> double {
    if (const auto limit = test_faults::expert_receive_limit_bytes()) return *limit;
    if (!source) return -1;  // no check
    const double now = now_seconds();
    if (cached->first < 0 || now - cached->first > 1.0) *cached = {now, source()};
    return cached->second;
  };
  experts.add_wrapper("expert_parallel", [group, n, rank, local, name, row_elements, headroom](
                                             const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next) {
    // Under autocast the experts compute in its dtype anyway: the rows travel in it (half the bytes of float32).
    at::Tensor x = inputs[0];
    if (at::autocast::is_autocast_enabled(x.device().type()) && at::isFloatingType(x.scalar_type()))
      x = x.to(at::autocast::get_autocast_dtype(x.device().type()));
    const at::Tensor counts = inputs[1].to(at::kCPU).to(at::kLong).contiguous();
    if (counts.numel() != n * local) fail("internal: expert parallelism got ", counts.numel(), " token counts for ", n * local, " experts");
    // Every rank's counts for every expert, and its headroom: each rank can tell what every rank will receive.
    at::Tensor table;
    {
      at::Tensor mine = at::cat({counts, at::full({1}, static_cast<int64_t>(headroom()), at::kLong)}).to(group->tensor_device());
      at::Tensor all = at::empty({n * (n * local + 1)}, mine.options());
      group->all_gather_into(all, mine);
      table = all.to(at::kCPU).view({n, n * local + 1});
    }
    const int64_t bytes_per_row = row_elements * static_cast<int64_t>(x.element_size());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t capacity = table[j][n * local].item<int64_t>();
      const at::Tensor arriving = table.narrow(1, j * local, local);  // [source, local expert of rank j]
      const int64_t rows = arriving.sum().item<int64_t>();
      if (capacity >= 0 && rows * bytes_per_row > capacity) {
        std::vector<int64_t> per_source, per_expert;
        for (int64_t i = 0; i < n; ++i) per_source.push_back(arriving[i].sum().item<int64_t>());
        for (int64_t e = 0; e < local; ++e) per_expert.push_back(arriving.select(1, e).sum().item<int64_t>());
        fail("expert parallelism: ", name, ": the tokens routed to the experts of expert-parallel rank ", j, " (experts ", j * local,
             " to ", (j + 1) * local - 1, ") would need about ", strprintf("%.1f", rows * bytes_per_row / 1e6), " MB there, more than its ",
             strprintf("%.1f", capacity / 1e6), " MB of free memory: ", rows, " token rows (from each rank: ", join_ints(per_source),
             "; per expert: ", join_ints(per_expert), "). The router sends most tokens to few experts (see the experts: max/min "
             "figures on the log line); a larger load_balance_coeff (model.moe_load_balance_coeff), a smaller batch or "
             "more memory per rank would help");
      }
    }
    // received[i][e]: rows rank i sends for this rank's local expert e.
    const at::Tensor received = table.narrow(1, rank * local, local).contiguous();
    const at::Tensor sending = counts.view({n, local});
    std::vector<int64_t> input_rows(static_cast<size_t>(n)), output_rows(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      input_rows[static_cast<size_t>(i)] = sending[i].sum().item<int64_t>();
      output_rows[static_cast<size_t>(i)] = received[i].sum().item<int64_t>();
    }
    const at::Tensor arrived = fc::all_to_all_rows(x, output_rows, input_rows, group);
    // Arrival order is (source, expert); the experts want (expert, source).
    const int64_t* r = received.data_ptr<int64_t>();
    std::vector<int64_t> start(static_cast<size_t>(n * local));
    for (int64_t k = 0, offset = 0; k < n * local; ++k) {
      start[static_cast<size_t>(k)] = offset;
      offset += r[k];
    }
    std::vector<int64_t> order;
    order.reserve(static_cast<size_t>(arrived.size(0)));
    for (int64_t e = 0; e < local; ++e)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < r[i * local + e]; ++j) order.push_back(start[static_cast<size_t>(i * local + e)] + j);
    const at::Tensor index = at::tensor(order, at::kLong).to(x.device());
    const at::Tensor inverse = at::empty_like(index).scatter_(0, index, at::arange(index.numel(), index.options()));
    const at::Tensor local_counts = received.sum(0);
    const at::Tensor out = next({arrived.index_select(0, index), local_counts}, context);
    return fc::all_to_all_rows(out.index_select(0, inverse), input_rows, output_rows, group);
  });
}

void split_routed_rows(nn::Unit& experts, std::shared_ptr<Communicator> tp_group) {
  const int64_t n = tp_group->size(), rank = tp_group->rank();
  experts.add_wrapper("expert_parallel_row_split", [n, rank](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                             const nn::Unit::Next& next) {
    const at::Tensor& x = inputs[0];
    const at::Tensor counts = inputs[1].to(at::kCPU).to(at::kLong).contiguous();
    const int64_t* c = counts.data_ptr<int64_t>();
    std::vector<int64_t> rows, mine(static_cast<size_t>(counts.numel()));
    for (int64_t e = 0, start = 0; e < counts.numel(); start += c[e], ++e) {
      const Range share = chunk(c[e], n, rank);
      mine[static_cast<size_t>(e)] = share.length;
      for (int64_t j = 0; j < share.length; ++j) rows.push_back(start + share.begin + j);
    }
    const at::Tensor index = at::tensor(rows, at::kLong).to(x.device());
    const at::Tensor out = next({x.index_select(0, index), at::tensor(mine, at::kLong)}, context);
    return at::zeros({x.size(0), out.size(1)}, out.options()).index_copy(0, index, out);
  });
}

}  // namespace titan::distributed
