#include "titan/distributed/pipeline/runner.h"

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <optional>
#include <set>
#include <tuple>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/common/test_faults.h"
#include "titan/distributed/pipeline/zero_bubble.h"

namespace titan::distributed::pipeline {
namespace {

constexpr int kHeaderLength = 8;         // an activation's dtype, rank and sizes, sent before it
constexpr size_t kReceiveLookahead = 3;  // actions whose receives are posted before they run

}  // namespace

// One direction of one stage boundary. Messages on it are matched in the order they are sent; both stages take
// micro-batches in the same order (Schedule::check), so the sender's k-th message is the receiver's k-th receive.
struct PipelineRunner::Channel {
  std::shared_ptr<Communicator> comm;  // a two-rank communicator; null when both stages live on this rank
  int peer = 0;                        // the other rank within `comm`
  std::deque<at::Tensor> local;        // both stages here: what was sent and not yet received
  // Activations only: the dtype and shape the first message since activation_shapes_may_change() announced in its
  // header. Both ends keep it; later messages carry no header, so the receiver reads nothing back from the device.
  using Shape = Stage::Shape;  // dtype and sizes
  std::optional<Shape> shape;
};

struct PipelineRunner::Slot {
  at::Tensor input;     // received activation (a leaf whose gradient goes back), undefined on the first stage
  at::Tensor output;    // this stage's output (or the loss on the last stage), what backward starts from
  at::Tensor gradient;  // posted receive of the output's gradient
  std::shared_ptr<Work> gradient_work;
  at::Tensor activation;  // posted receive of the input (the previous stage's output), once its shape is known
  std::shared_ptr<Work> activation_work;
  DeferredWeights deferred;
};

PipelineRunner::PipelineRunner(Schedule schedule, std::vector<Stage> stages, std::shared_ptr<Communicator> pp_group, at::Device device)
    : schedule_(std::move(schedule)), group_(std::move(pp_group)), device_(device) {
  for (auto& s : stages) stages_.emplace(s.index, std::move(s));
  const int me = group_->rank();
  const auto expected = schedule_.stages_of(me);
  if (expected.size() != stages_.size())
    fail("internal: pipeline rank ", me, " was given ", stages_.size(), " stages; the schedule places ", expected.size(), " here");
  for (int s : expected)
    if (!stages_.count(s)) fail("internal: pipeline rank ", me, " lacks stage ", s);
  // Each direction of each boundary between stages on different ranks gets its own two-rank communicator: on NCCL
  // each has its own stream, so a receive waiting for one neighbour never holds back a message to or from another
  // (or the collectives of other mesh dimensions, which have their own communicators). Collective over the group,
  // in the same order on every rank.
  const int boundaries = schedule_.stages() - 1;
  activations_.resize(static_cast<size_t>(std::max(boundaries, 0)));
  gradients_.resize(activations_.size());
  for (int b = 0; b < boundaries; ++b) {
    const int low = schedule_.rank_of(b), high = schedule_.rank_of(b + 1);
    if (low == high) continue;
    const bool member = me == low || me == high;
    for (bool forward : {true, false}) {
      const int sender = forward ? low : high;
      auto comm = group_->split(member ? 0 : -1, me == sender ? 0 : 1,
                                cat("pp ", forward ? "activations" : "gradients", " of stages ", b, "/", b + 1, " (pipeline ranks ",
                                    sender, " -> ", forward ? high : low, ")"),
                                member ? 2 : 0);
      if (!member) continue;
      Channel& c = forward ? activations_[static_cast<size_t>(b)] : gradients_[static_cast<size_t>(b)];
      c.comm = std::move(comm);
      c.peer = 1 - c.comm->rank();
    }
  }
  warm_channels();
  const auto stop = test_faults::stop_before();  // the failure tests' hanging stage
  stop_step_ = stop.step;
  stop_action_ = stop.action;
}

void PipelineRunner::warm_channels() {
  // NCCL connects two ranks on their first message, a handshake inside the send and the receive. Made later, behind
  // receives posted ahead that spin on the device, a device-wide synchronising call meanwhile (the allocator freeing
  // on an out-of-memory retry, a pinned allocation) could deadlock. So every channel carries one tiny message now, in
  // the same order on every rank (boundary by boundary, activations before gradients), which cannot deadlock: each
  // rank's first exchange is with a rank whose earlier exchanges are all with lower boundaries.
  const at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (size_t b = 0; b < activations_.size(); ++b)
    for (auto* channels : {&activations_, &gradients_}) {
      Channel& c = (*channels)[b];
      if (!c.comm) continue;
      try {
        if (c.comm->rank() == 0) {  // the sender (split with key 0)
          c.comm->send(token, c.peer, 0, /*async=*/false);
        } else {
          at::Tensor received = at::empty_like(token);
          c.comm->recv(received, c.peer, 0, /*async=*/false);
        }
      } catch (const std::exception& e) {
        fail("pipeline rank ", group_->rank(), ": the first message on ", c.comm->name(), " failed: ", e.what());
      }
    }
}

PipelineRunner::~PipelineRunner() = default;

void PipelineRunner::set_timeout(std::chrono::seconds timeout) {
  for (auto* channels : {&activations_, &gradients_})
    for (auto& c : *channels)
      if (c.comm) c.comm->set_timeout(timeout);
}

PipelineRunner::Slot& PipelineRunner::slot(int stage, int microbatch) {
  auto& s = slots_[{stage, microbatch}];
  if (!s) s = std::make_unique<Slot>();
  return *s;
}

void PipelineRunner::wait(const std::shared_ptr<Work>& work, const std::string& what, double& waited) {
  const double start = now_seconds();
  try {
    work->wait();
  } catch (const std::exception& e) {
    fail("pipeline rank ", group_->rank(), ": ", what, " failed: ", e.what());
  }
  waited += now_seconds() - start;
}

void PipelineRunner::post_receives(const std::vector<Action>& actions, size_t from) {
  // Receives are posted in the order of the actions that take them, which is each channel's message order; a
  // receive that cannot be posted yet holds back the later ones of its channel.
  const int last = schedule_.stages() - 1;
  std::set<int> held_gradients, held_activations;  // by the stage that receives
  for (size_t i = from; i < std::min(actions.size(), from + kReceiveLookahead); ++i) {
    const Action& a = actions[i];
    if (a.op == Op::Forward && a.stage > 0 && !held_activations.count(a.stage)) {
      Channel& c = activations_[static_cast<size_t>(a.stage - 1)];
      if (!c.comm) continue;
      // An activation's shape is known once its channel's first message (with the header) has arrived.
      if (!c.shape) {
        held_activations.insert(a.stage);
        continue;
      }
      Slot& s = slot(a.stage, a.microbatch);
      if (s.activation_work) continue;
      s.activation = at::empty(c.shape->second, at::TensorOptions().dtype(c.shape->first).device(device_));
      s.activation_work = c.comm->recv(s.activation, c.peer, 0, /*async=*/true);
      continue;
    }
    if ((a.op != Op::Backward && a.op != Op::BackwardInput) || a.stage == last || held_gradients.count(a.stage)) continue;
    Channel& c = gradients_[static_cast<size_t>(a.stage)];
    if (!c.comm) continue;
    auto it = slots_.find({a.stage, a.microbatch});
    // The gradient's shape is the output's, known once its forward ran.
    if (it == slots_.end() || !it->second->output.defined()) {
      held_gradients.insert(a.stage);
      continue;
    }
    Slot& s = *it->second;
    if (s.gradient_work) continue;
    s.gradient = at::empty(s.output.sizes(), s.output.options().requires_grad(false));
    s.gradient_work = c.comm->recv(s.gradient, c.peer, 0, /*async=*/true);
  }
}

at::Tensor PipelineRunner::take_local(Channel& c, const std::string& what) {
  if (c.local.empty()) fail("internal: pipeline rank ", group_->rank(), ": ", what, " found nothing sent");
  at::Tensor t = std::move(c.local.front());
  c.local.pop_front();
  return t;
}

at::Tensor PipelineRunner::receive_activation(int stage, int microbatch, double& waited) {
  Channel& c = activations_[static_cast<size_t>(stage - 1)];
  const int peer = schedule_.rank_of(stage - 1);
  const std::string what = cat("stage ", stage, " receiving micro-batch ", microbatch, "'s activation from stage ", stage - 1,
                               " (pipeline rank ", peer, ")");
  if (!c.comm) return take_local(c, what);
  Slot& s = slot(stage, microbatch);
  if (s.activation_work) {  // posted ahead (post_receives)
    wait(s.activation_work, what, waited);
    s.activation_work.reset();
    return std::move(s.activation);
  }
  if (!c.shape) {
    const Stage& receiver = stages_.at(stage);
    if (c.comm->simulated()) {
      // The fake backend: no header comes (the neighbour's send went nowhere); the stage says what it takes.
      if (!receiver.input_shape) fail("internal: stage ", stage, " does not say the shape of its input, which the fake backend needs");
      c.shape.emplace(receiver.input_shape());
    } else {
      at::Tensor header = at::empty({kHeaderLength}, at::TensorOptions().dtype(at::kLong).device(device_));
      wait(c.comm->recv(header, c.peer, 0, /*async=*/true), what, waited);
      const at::Tensor h_cpu = header.cpu();  // the one read back from the device per channel and shape
      ++header_reads_;
      const auto* h = h_cpu.data_ptr<int64_t>();
      c.shape.emplace(static_cast<at::ScalarType>(h[0]), std::vector<int64_t>(h + 2, h + 2 + h[1]));
      // What the stage expects is what the fake backend builds its stand-ins from: held to every real first message.
      if (const Stage::Shape expected = receiver.input_shape ? receiver.input_shape() : *c.shape; expected != *c.shape) {
        fail("internal: stage ", stage, " expects ", expected.first, " ", at::IntArrayRef(expected.second), " from stage ", stage - 1,
             ", which sent ", c.shape->first, " ", at::IntArrayRef(c.shape->second));
      }
    }
  }
  at::Tensor buffer = at::empty(c.shape->second, at::TensorOptions().dtype(c.shape->first).device(device_));
  wait(c.comm->recv(buffer, c.peer, 0, /*async=*/true), what, waited);
  return buffer;
}

at::Tensor PipelineRunner::receive_gradient(int stage, int microbatch, double& waited) {
  Channel& c = gradients_[static_cast<size_t>(stage)];
  const int peer = schedule_.rank_of(stage + 1);
  const std::string what = cat("stage ", stage, " receiving micro-batch ", microbatch, "'s gradient from stage ", stage + 1,
                               " (pipeline rank ", peer, ")");
  if (!c.comm) return take_local(c, what);
  Slot& s = slot(stage, microbatch);
  if (!s.gradient_work) {
    s.gradient = at::empty(s.output.sizes(), s.output.options().requires_grad(false));
    s.gradient_work = c.comm->recv(s.gradient, c.peer, 0, /*async=*/true);
  }
  wait(s.gradient_work, what, waited);
  s.gradient_work.reset();
  at::Tensor g = s.gradient;
  s.gradient = at::Tensor();
  return g;
}

void PipelineRunner::send_activation(int stage, int microbatch, const at::Tensor& output) {
  Channel& c = activations_[static_cast<size_t>(stage)];
  if (!c.comm) {
    c.local.push_back(output.detach().clone());
    return;
  }
  at::Tensor data = output.detach().contiguous();
  if (c.shape) {
    // The receiver expects this shape without a header: a different one would be a message of another size.
    if (c.shape->first != data.scalar_type() || c.shape->second != data.sizes().vec())
      fail("internal: stage ", stage, "'s activation of micro-batch ", microbatch, " is ", data.scalar_type(), " ", data.sizes(),
           " where this batch's earlier ones were ", c.shape->first, " ", at::IntArrayRef(c.shape->second),
           " (PipelineRunner::activation_shapes_may_change was not called)");
    sends_.emplace_back(c.comm->send(data, c.peer, 0, /*async=*/true), data);
    bytes_sent_ += static_cast<int64_t>(data.nbytes());
    return;
  }
  if (data.dim() > kHeaderLength - 2) fail("internal: a pipeline activation has more than ", kHeaderLength - 2, " dimensions");
  c.shape.emplace(data.scalar_type(), data.sizes().vec());
  at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
  auto* h = header.data_ptr<int64_t>();
  h[0] = static_cast<int64_t>(data.scalar_type());
  h[1] = data.dim();
  for (int64_t d = 0; d < data.dim(); ++d) h[2 + d] = data.size(d);
  header = header.to(device_);
  sends_.emplace_back(c.comm->send(header, c.peer, 0, /*async=*/true), header);
  sends_.emplace_back(c.comm->send(data, c.peer, 0, /*async=*/true), data);
  bytes_sent_ += static_cast<int64_t>(data.nbytes() + header.nbytes());
}

void PipelineRunner::send_gradient(int stage, int microbatch, const at::Tensor& grad) {
  (void)microbatch;
  Channel& c = gradients_[static_cast<size_t>(stage - 1)];
  if (!c.comm) {
    c.local.push_back(grad.clone());
    return;
  }
  at::Tensor data = grad.contiguous();
  sends_.emplace_back(c.comm->send(data, c.peer, 0, /*async=*/true), data);
  bytes_sent_ += static_cast<int64_t>(data.nbytes());
}

void PipelineRunner::finish_sends() {
  double ignored = 0;
  for (auto& [work, tensor] : sends_) wait(work, "a send to a neighbouring stage", ignored);
  sends_.clear();
}

void PipelineRunner::activation_shapes_may_change() {
  for (auto& c : activations_) c.shape.reset();
}

at::Tensor PipelineRunner::train(const StageLoss& loss_fn, int64_t step) {
  const int rank = group_->rank();
  const int last = schedule_.stages() - 1;
  const auto& actions = schedule_.actions(rank);
  const double step_start = now_seconds();
  // Summed where the losses are (in float64), never read back here: the trainer reads the step's loss when it needs it.
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  double compute = 0;
  int in_flight = 0;
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    if (step == stop_step_ && a.str() == stop_action_) std::raise(SIGSTOP);
    post_receives(actions, i);
    const double start = now_seconds();
    // waited: receiving before computing (the waits and what lies between them); computed: when the result existed
    // (before it was sent on)
    double waited = 0, computed = 0;
    Stage& stage = stages_.at(a.stage);
    Slot& s = slot(a.stage, a.microbatch);
    if (a.op == Op::Forward) {
      if (a.stage > 0) {
        s.input = receive_activation(a.stage, a.microbatch, waited).requires_grad_(true);
        waited = now_seconds() - start;
      }
      at::Tensor out = stage.forward(s.input, a.microbatch);
      if (a.stage == last) {
        s.output = loss_fn(out, a.microbatch);
        loss_sum += s.output.detach().to(at::kDouble).reshape({});
        computed = now_seconds();
      } else {
        s.output = out;
        computed = now_seconds();
        send_activation(a.stage, a.microbatch, out);
      }
      max_in_flight_ = std::max(max_in_flight_, ++in_flight);
    } else if (a.op == Op::Backward || a.op == Op::BackwardInput) {
      at::Tensor grad;
      if (a.stage < last) {
        grad = receive_gradient(a.stage, a.microbatch, waited);
        waited = now_seconds() - start;
      }
      {
        std::optional<DeferredWeights::Capture> capture;
        if (a.op == Op::BackwardInput) capture.emplace(s.deferred);
        if (grad.defined()) torch::autograd::backward({s.output}, {grad});
        else torch::autograd::backward({s.output});
      }
      computed = now_seconds();
      if (a.stage > 0) send_gradient(a.stage, a.microbatch, s.input.grad());
      s.input = at::Tensor();
      s.output = at::Tensor();
      --in_flight;
    } else {
      s.deferred.apply();
      computed = now_seconds();
    }
    if (a.op == Op::Backward || a.op == Op::BackwardWeight) slots_.erase({a.stage, a.microbatch});
    const double end = now_seconds();
    compute += end - start - waited;
    if (record_) timeline_.push_back({step, a.str(), start, computed, waited});
  }
  finish_sends();
  if (!slots_.empty()) fail("internal: pipeline rank ", rank, " ended a step with ", slots_.size(), " micro-batch(es) unfinished");
  compute_seconds_ += compute;
  step_seconds_ += now_seconds() - step_start;
  ++steps_;
  return loss_sum;
}

at::Tensor PipelineRunner::evaluate(const StageLoss& loss_fn, int microbatches) {
  at::NoGradGuard no_grad;
  const int last = schedule_.stages() - 1;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  double waited = 0;
  // Stage by stage, every micro-batch through the lower stage first: no rank can wait on itself.
  // Validation is rare: every activation carries its header, whatever its shape. Training's shapes are kept for
  // its next pass (each end keeps its own, so both still agree).
  std::vector<std::optional<Channel::Shape>> training_shapes;
  for (const auto& c : activations_) training_shapes.push_back(c.shape);
  for (auto& [index, stage] : stages_) {
    for (int m = 0; m < microbatches; ++m) {
      if (index > 0) activations_[static_cast<size_t>(index - 1)].shape.reset();
      at::Tensor input = index > 0 ? receive_activation(index, m, waited) : at::Tensor();
      at::Tensor out = stage.forward(input, m);
      if (index == last) {
        loss_sum += loss_fn(out, m).to(at::kDouble).reshape({});
      } else {
        activations_[static_cast<size_t>(index)].shape.reset();
        send_activation(index, m, out);
      }
    }
  }
  finish_sends();
  slots_.clear();
  for (size_t b = 0; b < activations_.size(); ++b) activations_[b].shape = std::move(training_shapes[b]);
  return loss_sum;
}

}  // namespace titan::distributed::pipeline
