#include "titan/distributed/pipeline/runner.h"

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/distributed/pipeline/zero_bubble.h"

namespace titan::distributed::pipeline {
namespace {

// Message kinds between neighbouring stages.
constexpr int kHeader = 0;      // the activation's dtype and shape (8 int64)
constexpr int kActivation = 1;
constexpr int kGradient = 2;
constexpr int kHeaderLength = 8;
constexpr size_t kReceiveLookahead = 3;  // actions whose receives are posted before they run

}  // namespace

struct PipelineRunner::Slot {
  at::Tensor input;     // received activation (a leaf whose gradient goes back), undefined on the first stage
  at::Tensor output;    // this stage's output (or the loss on the last stage), what backward starts from
  at::Tensor header;    // posted receive of the activation's header
  std::shared_ptr<Work> header_work;
  at::Tensor gradient;  // posted receive of the output's gradient
  std::shared_ptr<Work> gradient_work;
  DeferredWeights deferred;
};

PipelineRunner::PipelineRunner(Schedule schedule, std::vector<Stage> stages, std::shared_ptr<Communicator> pp_group, at::Device device)
    : schedule_(std::move(schedule)), group_(std::move(pp_group)), device_(device) {
  for (auto& s : stages) stages_.emplace(s.index, std::move(s));
  const auto expected = schedule_.stages_of(group_->rank());
  if (expected.size() != stages_.size())
    fail("internal: pipeline rank ", group_->rank(), " was given ", stages_.size(), " stages; the schedule places ", expected.size(), " here");
  for (int s : expected)
    if (!stages_.count(s)) fail("internal: pipeline rank ", group_->rank(), " lacks stage ", s);
}

PipelineRunner::~PipelineRunner() = default;

bool PipelineRunner::has_stage(int index) const { return stages_.count(index) > 0; }

PipelineRunner::Slot& PipelineRunner::slot(int stage, int microbatch) {
  auto& s = slots_[{stage, microbatch}];
  if (!s) s = std::make_unique<Slot>();
  return *s;
}

int PipelineRunner::tag(int stage, int microbatch, int kind) const {
  // Unique per (receiving or sending stage, micro-batch, kind) within a step; MPI keeps order per tag anyway.
  return ((microbatch * schedule_.stages() + stage) * 3 + kind) % 32768;
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
  const int last = schedule_.stages() - 1;
  for (size_t i = from; i < std::min(actions.size(), from + kReceiveLookahead); ++i) {
    const Action& a = actions[i];
    if (a.op == Op::Forward && a.stage > 0) {
      Slot& s = slot(a.stage, a.microbatch);
      if (s.header_work || s.input.defined()) continue;
      s.header = at::empty({kHeaderLength}, at::kLong);
      s.header_work = group_->recv(s.header, schedule_.rank_of(a.stage - 1), tag(a.stage, a.microbatch, kHeader), /*async=*/true);
    } else if ((a.op == Op::Backward || a.op == Op::BackwardInput) && a.stage < last) {
      Slot& s = slot(a.stage, a.microbatch);
      if (s.gradient_work || !s.output.defined()) continue;  // the output's shape is known once its forward ran
      s.gradient = at::empty(s.output.sizes(), s.output.options().requires_grad(false));
      s.gradient_work = group_->recv(s.gradient, schedule_.rank_of(a.stage + 1), tag(a.stage, a.microbatch, kGradient), /*async=*/true);
    }
  }
}

at::Tensor PipelineRunner::receive_activation(int stage, int microbatch, double& waited) {
  Slot& s = slot(stage, microbatch);
  const int peer = schedule_.rank_of(stage - 1);
  const std::string what = cat("stage ", stage, " receiving micro-batch ", microbatch, "'s activation from stage ", stage - 1,
                               " (pipeline rank ", peer, ")");
  if (!s.header_work) {
    s.header = at::empty({kHeaderLength}, at::kLong);
    s.header_work = group_->recv(s.header, peer, tag(stage, microbatch, kHeader), /*async=*/true);
  }
  wait(s.header_work, what, waited);
  const auto* h = s.header.data_ptr<int64_t>();
  std::vector<int64_t> shape(h + 2, h + 2 + h[1]);
  at::Tensor buffer = at::empty(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(h[0])).device(device_));
  wait(group_->recv(buffer, peer, tag(stage, microbatch, kActivation), /*async=*/true), what, waited);
  s.header_work.reset();
  return buffer;
}

at::Tensor PipelineRunner::receive_gradient(int stage, int microbatch, double& waited) {
  Slot& s = slot(stage, microbatch);
  const int peer = schedule_.rank_of(stage + 1);
  if (!s.gradient_work) {
    s.gradient = at::empty(s.output.sizes(), s.output.options().requires_grad(false));
    s.gradient_work = group_->recv(s.gradient, peer, tag(stage, microbatch, kGradient), /*async=*/true);
  }
  wait(s.gradient_work, cat("stage ", stage, " receiving micro-batch ", microbatch, "'s gradient from stage ", stage + 1,
                            " (pipeline rank ", peer, ")"), waited);
  s.gradient_work.reset();
  at::Tensor g = s.gradient;
  s.gradient = at::Tensor();
  return g;
}

void PipelineRunner::send_activation(int stage, int microbatch, const at::Tensor& output) {
  const int peer = schedule_.rank_of(stage + 1);
  at::Tensor data = output.detach().contiguous();
  if (data.dim() > kHeaderLength - 2) fail("internal: a pipeline activation has more than ", kHeaderLength - 2, " dimensions");
  at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
  auto* h = header.data_ptr<int64_t>();
  h[0] = static_cast<int64_t>(data.scalar_type());
  h[1] = data.dim();
  for (int64_t d = 0; d < data.dim(); ++d) h[2 + d] = data.size(d);
  sends_.emplace_back(group_->send(header, peer, tag(stage + 1, microbatch, kHeader), /*async=*/true), header);
  sends_.emplace_back(group_->send(data, peer, tag(stage + 1, microbatch, kActivation), /*async=*/true), data);
  bytes_sent_ += static_cast<int64_t>(data.nbytes() + header.nbytes());
}

void PipelineRunner::send_gradient(int stage, int microbatch, const at::Tensor& grad) {
  at::Tensor data = grad.contiguous();
  sends_.emplace_back(group_->send(data, schedule_.rank_of(stage - 1), tag(stage - 1, microbatch, kGradient), /*async=*/true), data);
  bytes_sent_ += static_cast<int64_t>(data.nbytes());
}

void PipelineRunner::finish_sends() {
  double ignored = 0;
  for (auto& [work, tensor] : sends_) wait(work, "a send to a neighbouring stage", ignored);
  sends_.clear();
}

double PipelineRunner::train(const StageLoss& loss_fn, int64_t step) {
  const int rank = group_->rank();
  const int last = schedule_.stages() - 1;
  const auto& actions = schedule_.actions(rank);
  const double step_start = now_seconds();
  double loss_sum = 0, compute = 0;
  int in_flight = 0;
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    post_receives(actions, i);
    const double start = now_seconds();
    double waited = 0, computed = 0;  // computed: when the result existed (before sending it on)
    Stage& stage = stages_.at(a.stage);
    Slot& s = slot(a.stage, a.microbatch);
    if (a.op == Op::Forward) {
      if (a.stage > 0) s.input = receive_activation(a.stage, a.microbatch, waited).requires_grad_(true);
      at::Tensor out = stage.forward(s.input, a.microbatch);
      if (a.stage == last) {
        s.output = loss_fn(out, a.microbatch);
        loss_sum += s.output.detach().to(at::kDouble).item<double>();
        computed = now_seconds();
      } else {
        s.output = out;
        computed = now_seconds();
        send_activation(a.stage, a.microbatch, out);
      }
      max_in_flight_ = std::max(max_in_flight_, ++in_flight);
    } else if (a.op == Op::Backward || a.op == Op::BackwardInput) {
      at::Tensor grad = a.stage == last ? at::Tensor() : receive_gradient(a.stage, a.microbatch, waited);
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

double PipelineRunner::evaluate(const StageLoss& loss_fn, int microbatches) {
  at::NoGradGuard no_grad;
  const int last = schedule_.stages() - 1;
  double loss_sum = 0, waited = 0;
  // Stage by stage, every micro-batch through the lower stage first: no rank can wait on itself.
  for (auto& [index, stage] : stages_) {
    for (int m = 0; m < microbatches; ++m) {
      at::Tensor input = index > 0 ? receive_activation(index, m, waited) : at::Tensor();
      at::Tensor out = stage.forward(input, m);
      if (index == last) loss_sum += loss_fn(out, m).to(at::kDouble).item<double>();
      else send_activation(index, m, out);
    }
  }
  finish_sends();
  slots_.clear();
  return loss_sum;
}

}  // namespace titan::distributed::pipeline
