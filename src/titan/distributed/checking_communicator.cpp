#include "titan/distributed/checking_communicator.h"

#include <atomic>
#include <functional>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::distributed {

namespace {

enum class Op : int64_t { AllReduce = 1, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier, Split, Message, AllToAllV };
constexpr int64_t kFields = 6;  // call number, op, dtype, count, reduction, root

const char* op_name(int64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::AllReduce: return "all_reduce";
    case Op::AllGather: return "all_gather_into";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllToAll: return "all_to_all";
    case Op::Broadcast: return "broadcast";
    case Op::Barrier: return "barrier";
    case Op::Split: return "split";
    case Op::Message: return "a point-to-point message";
    case Op::AllToAllV: return "all_to_all_v";
  }
  return "an unknown operation";
}

std::string describe(const int64_t* f) {
  const auto op = static_cast<Op>(f[1]);
  if (op == Op::Barrier || op == Op::Split) return op_name(f[1]);
  if (op == Op::AllToAllV) return cat(op_name(f[1]), "(", c10::toString(static_cast<at::ScalarType>(f[2])), ")");
  std::string s = cat(op_name(f[1]), "(", c10::toString(static_cast<at::ScalarType>(f[2])), " x ", f[3]);
  if (op == Op::AllReduce || op == Op::ReduceScatter) s += cat(", ", reduce_op_name(static_cast<ReduceOp>(f[4])));
  if (op == Op::Broadcast) s += cat(", root ", f[5]);
  return s + ")";
}

// The dtypes titan's NCCL backend moves (nccl_communicator.cpp; bool as uint8).
bool nccl_moves(at::ScalarType t) {
  switch (t) {
    case at::kByte: case at::kBool: case at::kChar: case at::kInt: case at::kLong: case at::kHalf: case at::kFloat:
    case at::kDouble: case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

// A point-to-point message and its header: the header is checked as soon as it has arrived (in wait() or completed()).
class CheckedWork final : public Work {
 public:
  CheckedWork(std::shared_ptr<Work> check, std::shared_ptr<Work> work, std::function<void()> verify)
      : check_(std::move(check)), work_(std::move(work)), verify_(std::move(verify)) {}
  void wait() override {
    check_->wait();
    verify_once();
    work_->wait();
  }
  bool completed() override {
    if (!check_->completed()) return false;
    verify_once();
    return work_->completed();
  }

 private:
  void verify_once() {
    if (!verified_.exchange(true)) verify_();
  }
  std::shared_ptr<Work> check_, work_;
  std::function<void()> verify_;
  std::atomic<bool> verified_{false};
};

class CheckingCommunicator final : public Communicator {
 public:
  explicit CheckingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) { name_ = inner_->name(); }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend() + " (checked: TITAN_CHECK_COLLECTIVES)"; }
  at::Device tensor_device() const override { return inner_->tensor_device(); }
  void set_timeout(std::chrono::seconds timeout) override { inner_->set_timeout(timeout); }
  bool globally_ordered() const override { return inner_->globally_ordered(); }
  bool simulated() const override { return inner_->simulated(); }
  int64_t bytes_communicated() const override { return inner_->bytes_communicated() - overhead_bytes_; }

  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op, bool async) override {
    require(tensor, "all_reduce", op == ReduceOp::Avg);
    return collective(Op::AllReduce, tensor, tensor.numel(), op, -1, async, [&] { return inner_->all_reduce(tensor, op, true); });
  }
  std::shared_ptr<Work> all_gather_into(at::Tensor& output, const at::Tensor& input, bool async) override {
    require(input, "all_gather_into input", false);
    require(output, "all_gather_into output", false);
    same_dtype(output, input, "all_gather_into");
    if (output.numel() != size() * input.numel())
      violation(cat("all_gather_into: the output holds ", output.numel(), " elements, not size ", size(), " x ", input.numel()));
    return collective(Op::AllGather, input, input.numel(), ReduceOp::Sum, -1, async,
                      [&] { return inner_->all_gather_into(output, input, true); });
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op, bool async) override {
    require(input, "reduce_scatter input", op == ReduceOp::Avg);
    require(output, "reduce_scatter output", op == ReduceOp::Avg);
    same_dtype(output, input, "reduce_scatter");
    if (input.numel() != size() * output.numel())
      violation(cat("reduce_scatter: the input holds ", input.numel(), " elements, not size ", size(), " x ", output.numel()));
    return collective(Op::ReduceScatter, output, output.numel(), op, -1, async,
                      [&] { return inner_->reduce_scatter(output, input, op, true); });
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input, bool async) override {
    require(input, "all_to_all input", false);
    require(output, "all_to_all output", false);
    same_dtype(output, input, "all_to_all");
    if (input.numel() != output.numel() || input.numel() % size() != 0)
      violation(cat("all_to_all: input and output must hold the same multiple of size ", size(), " elements, got ",
                    input.numel(), " and ", output.numel()));
    return collective(Op::AllToAll, input, input.numel(), ReduceOp::Sum, -1, async,
                      [&] { return inner_->all_to_all(output, input, true); });
  }
  // Each rank's counts differ, so the fingerprint carries none; a second exchange gives every rank all ranks' splits,
  // and each checks that every rank receives from each peer exactly what that peer sends to it (all refuse alike).
  std::shared_ptr<Work> all_to_all_v(at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                                     const std::vector<int64_t>& input_splits, bool async) override {
    require(input, "all_to_all_v input", false);
    require(output, "all_to_all_v output", false);
    same_dtype(output, input, "all_to_all_v");
    const int n = size();
    if (static_cast<int>(output_splits.size()) != n || static_cast<int>(input_splits.size()) != n)
      violation(cat("all_to_all_v: ", input_splits.size(), " input and ", output_splits.size(), " output splits for ", n, " ranks"));
    return collective(Op::AllToAllV, input, -1, ReduceOp::Sum, -1, async, [&] {
      std::vector<int64_t> mine = input_splits;
      mine.insert(mine.end(), output_splits.begin(), output_splits.end());
      at::Tensor local = at::tensor(mine, at::kLong).to(tensor_device());
      at::Tensor all = at::empty({n * 2 * n}, local.options());
      const int64_t before = inner_->bytes_communicated();
      inner_->all_gather_into(all, local, false);
      overhead_bytes_ += inner_->bytes_communicated() - before;
      const at::Tensor host = all.cpu();
      const int64_t* f = host.data_ptr<int64_t>();  // rank i: sends f[i*2n + j] to j, expects f[i*2n + n + j] from j
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
          if (f[i * 2 * n + j] != f[j * 2 * n + n + i])
            violation(cat("all_to_all_v: rank ", i, " sends ", f[i * 2 * n + j], " elements to rank ", j, ", which expects ",
                          f[j * 2 * n + n + i]));
      return inner_->all_to_all_v(output, input, output_splits, input_splits, true);
    });
  }
  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root, bool async) override {
    require(tensor, "broadcast", false);
    peer(root, "broadcast root", true);
    return collective(Op::Broadcast, tensor, tensor.numel(), ReduceOp::Sum, root, async,
                      [&] { return inner_->broadcast(tensor, root, true); });
  }
  void barrier() override {
    collective(Op::Barrier, at::Tensor(), 0, ReduceOp::Sum, -1, false, [&] {
      inner_->barrier();
      return completed_work();
    });
  }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name, int size = 0) override {
    std::shared_ptr<Communicator> child;
    collective(Op::Split, at::Tensor(), 0, ReduceOp::Sum, -1, false, [&] {
      child = inner_->split(color, key, name, size);
      return completed_work();
    });
    return child ? std::make_shared<CheckingCommunicator>(child) : nullptr;
  }

  std::shared_ptr<Work> send(const at::Tensor& tensor, int destination, int tag, bool async) override {
    require(tensor, "send", false);
    peer(destination, "send destination", false);
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor header = message_header(tensor);
    const int64_t before = inner_->bytes_communicated();
    auto check = inner_->send(header, destination, tag, true);
    overhead_bytes_ += inner_->bytes_communicated() - before;
    auto work = std::make_shared<CheckedWork>(check, inner_->send(tensor, destination, tag, true), [header] {});
    if (!async) work->wait();
    return work;
  }
  std::shared_ptr<Work> recv(at::Tensor& tensor, int source, int tag, bool async) override {
    require(tensor, "recv", false);
    peer(source, "recv source", false);
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor header = at::empty({kFields}, at::TensorOptions().dtype(at::kLong).device(tensor_device()));
    auto check = inner_->recv(header, source, tag, true);
    auto work = std::make_shared<CheckedWork>(check, inner_->recv(tensor, source, tag, true),
                                              [this, header, expected = message_fields(tensor), source] {
                                                verify_message(header, expected, source);
                                              });
    if (!async) work->wait();
    return work;
  }
  std::shared_ptr<Work> send_recv(const at::Tensor& send, int destination, at::Tensor& recv, int source, bool async) override {
    require(send, "send_recv send", false);
    require(recv, "send_recv recv", false);
    peer(destination, "send_recv destination", true);
    peer(source, "send_recv source", true);
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor out = message_header(send);
    at::Tensor in = at::empty({kFields}, out.options());
    const int64_t before = inner_->bytes_communicated();
    auto check = inner_->send_recv(out, destination, in, source, true);
    overhead_bytes_ += inner_->bytes_communicated() - before;
    auto work = std::make_shared<CheckedWork>(check, inner_->send_recv(send, destination, recv, source, true),
                                              [this, in, out, expected = message_fields(recv), source] {
                                                verify_message(in, expected, source);
                                              });
    if (!async) work->wait();
    return work;
  }

 private:
  [[noreturn]] void violation(const std::string& what) const {
    fail("collective check (TITAN_CHECK_COLLECTIVES) on communicator ", quote(name_), ", rank ", rank(), " of ", size(),
         ": ", what);
  }

  void require(const at::Tensor& t, const char* what, bool average) const {
    if (!t.defined()) violation(cat(what, ": an undefined tensor"));
    if (t.device() != tensor_device())
      violation(cat(what, ": a tensor on ", t.device().str(), "; this backend's tensors live on ", tensor_device().str(),
                    " (a host object must go through a tensor on that device)"));
    if (!t.is_contiguous()) violation(cat(what, ": a non-contiguous tensor of shape [", join_ints(t.sizes().vec()), "]"));
    if (!nccl_moves(t.scalar_type())) violation(cat(what, ": dtype ", c10::toString(t.scalar_type()), ", which the NCCL backend cannot move"));
    if (average && !at::isFloatingType(t.scalar_type()))
      violation(cat(what, ": an average of ", c10::toString(t.scalar_type()), " (NCCL averages floating types only)"));
  }
  void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) const {
    if (a.scalar_type() != b.scalar_type())
      violation(cat(what, ": output ", c10::toString(a.scalar_type()), " but input ", c10::toString(b.scalar_type())));
  }
  void peer(int r, const char* what, bool self_allowed) const {
    if (r < 0 || r >= size() || (!self_allowed && r == rank()))
      violation(cat(what, " ", r, " is not another rank of the group (0 to ", size() - 1, ", this is ", rank(), ")"));
  }

  std::vector<int64_t> message_fields(const at::Tensor& t) const {
    return {0, static_cast<int64_t>(Op::Message), static_cast<int64_t>(t.scalar_type()), t.numel(), 0, 0};
  }
  at::Tensor message_header(const at::Tensor& t) const {
    auto f = message_fields(t);
    return at::tensor(f, at::kLong).to(tensor_device());
  }
  void verify_message(const at::Tensor& header, const std::vector<int64_t>& expected, int source) const {
    const at::Tensor got = header.cpu();
    const int64_t* g = got.data_ptr<int64_t>();
    if (g[2] != expected[2] || g[3] != expected[3])
      violation(cat("rank ", source, " sent ", c10::toString(static_cast<at::ScalarType>(g[2])), " x ", g[3],
                    " but this rank receives ", c10::toString(static_cast<at::ScalarType>(expected[2])), " x ", expected[3]));
  }

  // Exchanges the calls' fingerprints (a small all-gather on this communicator) and checks them before the
  // operation is issued, so that a mismatched one never reaches the backend. Blocking here adds no deadlock the MPI
  // backend would not have (it runs all collectives in one issue order); the lock keeps another thread's call on
  // this communicator from coming between the two.
  template <typename Issue>
  std::shared_ptr<Work> collective(Op op, const at::Tensor& t, int64_t count, ReduceOp reduction, int root, bool async,
                                   Issue&& issue) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t call = ++calls_;
    const std::vector<int64_t> mine = {call, static_cast<int64_t>(op), t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1,
                                       count, static_cast<int64_t>(reduction), root};
    at::Tensor local = at::tensor(mine, at::kLong).to(tensor_device());
    at::Tensor all = at::empty({size() * kFields}, local.options());
    const int64_t before = inner_->bytes_communicated();
    inner_->all_gather_into(all, local, false);
    overhead_bytes_ += inner_->bytes_communicated() - before;
    verify_collective(all, mine);
    std::shared_ptr<Work> work = issue();
    if (!async) work->wait();
    return work;
  }
  void verify_collective(const at::Tensor& all, const std::vector<int64_t>& mine) const {
    const at::Tensor host = all.cpu();
    const int64_t* f = host.data_ptr<int64_t>();
    bool agree = true;
    for (int r = 0; r < size(); ++r)
      for (int64_t k = 0; k < kFields; ++k)
        if (f[r * kFields + k] != mine[static_cast<size_t>(k)] && !(mine[1] == static_cast<int64_t>(Op::Split) && k > 1))
          agree = false;
    if (agree) return;
    std::string calls;
    for (int r = 0; r < size(); ++r)
      calls += cat(r ? "; " : "", "rank ", r, " call #", f[r * kFields], ": ", describe(f + r * kFields));
    violation(cat("the ranks issued different operations (", calls, "); on NCCL this hangs or corrupts data"));
  }

  std::shared_ptr<Communicator> inner_;
  std::mutex mutex_;
  int64_t calls_ = 0;
  std::atomic<int64_t> overhead_bytes_{0};
};

}  // namespace

bool collective_checks_enabled() {
  const char* v = std::getenv("TITAN_CHECK_COLLECTIVES");
  return v && std::string(v) == "1";
}

std::shared_ptr<Communicator> make_checking_communicator(std::shared_ptr<Communicator> inner) {
  if (dynamic_cast<CheckingCommunicator*>(inner.get())) return inner;
  return std::make_shared<CheckingCommunicator>(std::move(inner));
}

std::shared_ptr<Communicator> maybe_checking(std::shared_ptr<Communicator> inner) {
  if (!inner || !collective_checks_enabled()) return inner;
  return make_checking_communicator(std::move(inner));
}

}  // namespace titan::distributed
