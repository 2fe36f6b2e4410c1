// PipelineRunner: executes a Schedule on this rank's stages. Activations go forward and their gradients back to
// the neighbouring stages' ranks by non-blocking point-to-point messages, on one two-rank communicator per
// direction of each stage boundary, split from the "pp" group. Messages are matched in order (as NCCL does), sends
// are never waited for until the step ends and receives are posted a few actions ahead, so a stage blocks
// only on data it needs. Records what ran when, for the bubble and the timeline.
#pragma once
#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"
#include "titan/distributed/pipeline/schedule.h"

namespace titan::distributed::pipeline {

struct Stage {
  int index = 0;
  // Micro-batch `microbatch`'s forward through this stage's modules. `input` is undefined on the first stage (the
  // stage reads its tokens itself) and the previous stage's output otherwise.
  std::function<at::Tensor(const at::Tensor& input, int microbatch)> forward;
  // Stages after the first: the dtype and sizes of the input the stage takes for the current batch (the previous
  // stage's output). The first message on each channel, whose header says the shape, is checked against it; on the
  // fake backend, where nothing arrives, it is the shape. Unset: taken from the header alone.
  using Shape = std::pair<at::ScalarType, std::vector<int64_t>>;
  std::function<Shape()> input_shape;
};

// On the last stage: the loss backward starts from (already scaled for the global batch), from the logits.
using StageLoss = std::function<at::Tensor(const at::Tensor& logits, int microbatch)>;

struct TimelineEntry {
  int64_t step = 0;
  std::string action;   // "1F0", "0B3", "2I1", "2W1"
  double start = 0;     // steady-clock seconds (CLOCK_MONOTONIC: comparable between processes of one machine)
  double end = 0;       // when its result existed (before it was sent on)
  double waited = 0;    // receiving from a neighbour after `start`: computing began at start + waited
};

class PipelineRunner {
 public:
  PipelineRunner(Schedule schedule, std::vector<Stage> stages, std::shared_ptr<Communicator> pp_group, at::Device device);
  ~PipelineRunner();

  // One pass of the schedule over its micro-batches with gradients; returns the sum of the losses computed on this
  // rank (zero without the last stage), a float64 scalar on the device, not read back. `step` labels the timeline.
  at::Tensor train(const StageLoss& loss, int64_t step);
  // Forward only (validation), `microbatches` of them, stage by stage; returns the sum of `loss` on the last stage
  // (a float64 scalar on the device).
  at::Tensor evaluate(const StageLoss& loss, int microbatches);
  // In train(), activations carry a shape header only in the first message on each channel after this call (and
  // after construction); later ones must have that shape. Every rank of the pipeline calls it at the same points:
  // pipeline::Pipeline when the training sequence length changes (the micro-batch size is fixed by the configuration).
  // evaluate() sends every activation with its header and leaves training's shapes as they were.
  void activation_shapes_may_change();
  // Shape headers read back from the device since construction: one per receiving channel and training shape, and
  // one per activation received in evaluate().
  int64_t header_reads() const { return header_reads_; }

  const Schedule& schedule() const { return schedule_; }
  // For the communicators between stages (comm.train_timeout_seconds after the first step).
  void set_timeout(std::chrono::seconds timeout);
  // Measured over every train() so far: the share of the steps' time this rank spent not computing.
  double bubble() const { return step_seconds_ > 0 ? 1.0 - compute_seconds_ / step_seconds_ : 0.0; }
  double step_seconds() const { return step_seconds_; }
  int64_t steps() const { return steps_; }
  int max_in_flight() const { return max_in_flight_; }  // measured: forwards not yet backward at once
  int64_t bytes_sent() const { return bytes_sent_; }
  // Every action since the last clear_timeline(), when recording (debug.pipeline_timeline), oldest first.
  const std::vector<TimelineEntry>& timeline() const { return timeline_; }
  void record_timeline(bool on) { record_ = on; }
  void clear_timeline() { timeline_.clear(); }

 private:
  struct Slot;     // one (stage, micro-batch)'s tensors in flight
  struct Channel;  // one direction of one stage boundary
  Slot& slot(int stage, int microbatch);
  void post_receives(const std::vector<Action>& actions, size_t from);
  at::Tensor take_local(Channel& c, const std::string& what);  // both stages here: what was handed over
  void warm_channels();
  at::Tensor receive_activation(int stage, int microbatch, double& waited);
  at::Tensor receive_gradient(int stage, int microbatch, double& waited);
  void send_activation(int stage, int microbatch, const at::Tensor& output);
  void send_gradient(int stage, int microbatch, const at::Tensor& grad);
  void wait(const std::shared_ptr<Work>& work, const std::string& what, double& waited);
  void finish_sends();

  Schedule schedule_;
  std::map<int, Stage> stages_;
  std::shared_ptr<Communicator> group_;
  at::Device device_;
  std::map<std::pair<int, int>, std::unique_ptr<Slot>> slots_;
  std::vector<std::pair<std::shared_ptr<Work>, at::Tensor>> sends_;
  std::vector<Channel> activations_, gradients_;  // by boundary: [b] links stages b and b + 1
  int64_t stop_step_ = -1;                         // TITAN_TEST_STOP_BEFORE
  std::string stop_action_;
  double compute_seconds_ = 0, step_seconds_ = 0;
  int64_t steps_ = 0, bytes_sent_ = 0, header_reads_ = 0;
  int max_in_flight_ = 0;
  bool record_ = false;
  std::vector<TimelineEntry> timeline_;
};

}  // namespace titan::distributed::pipeline
