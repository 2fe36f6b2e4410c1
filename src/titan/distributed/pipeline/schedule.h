// Pipeline schedules: which compute action (forward, backward, or the zero-bubble split of backward into input
// and weight gradients) each pipeline rank runs in which order, for torchtitan's schedule names (the orders of
// torch.distributed.pipelining's GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
// DualPipeV) or a CSV file in its compute-only format. Pure data: no tensors, no communication.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace titan::distributed::pipeline {

enum class Op : char {
  Forward = 'F',
  Backward = 'B',         // full backward: input and weight gradients together
  BackwardInput = 'I',    // zero-bubble: gradients of activations (and of non-matmul weights) only
  BackwardWeight = 'W',   // zero-bubble: the deferred matmul weight gradients of an earlier I
};

struct Action {
  int stage = 0;
  Op op = Op::Forward;
  int microbatch = 0;
  std::string str() const;  // "2F0", torch.distributed.pipelining's notation
  bool operator==(const Action&) const = default;
};

// What a schedule name implies before any micro-batch count is known.
struct ScheduleTraits {
  std::string name;         // canonical spelling
  bool single_stage = true; // one stage per rank (GPipe, 1F1B); the others hold several
  bool v_shape = false;     // rank r holds stages r and 2p - 1 - r (ZBVZeroBubble, DualPipeV) instead of r, r + p, ...
  bool splits_backward = false;
};
// Case-insensitive as torchtitan; throws UserError listing the valid names.
ScheduleTraits schedule_traits(const std::string& name);
std::vector<std::string> schedule_names();

class Schedule {
 public:
  // The named schedule for `pp` ranks, `stages` stages in all and `microbatches` micro-batches; throws UserError
  // naming the numbers when the schedule cannot run them (torch.distributed.pipelining's rules).
  static Schedule make(const std::string& name, int pp, int stages, int microbatches);
  // torchtitan's pipeline_parallel_schedule_csv: one row per rank, one action per cell ("0F1", "1B0", "2I0",
  // "2W0"; empty cells are idle slots). Stages are placed as `v_shape` says. Throws UserError naming the file, row
  // and cell of anything malformed, missing, duplicated or unrunnable.
  static Schedule from_csv(const std::string& path, int pp, int stages, int microbatches, bool v_shape);

  const std::string& name() const { return name_; }
  int pp() const { return pp_; }
  int stages() const { return stages_; }
  int microbatches() const { return microbatches_; }
  int rank_of(int stage) const;
  std::vector<int> stages_of(int rank) const;  // ascending
  const std::vector<Action>& actions(int rank) const { return per_rank_.at(static_cast<size_t>(rank)); }
  bool splits_backward() const;

  // Simulated in time units, communication free: a forward, an input step (I) and a weight step (W) take one unit
  // each, a full backward two. Gives when each action starts, per rank, and the idle fraction of the ranks' time
  // until the last action ends. Throws UserError naming the stuck actions when the order deadlocks.
  struct Simulation {
    std::vector<std::vector<int64_t>> slot;  // per rank, per action: its start
    int64_t makespan = 0;
    double bubble = 0;
  };
  Simulation simulate() const;
  // The most micro-batches whose forward ran and whose (input) backward has not, on `rank`'s stages together.
  int max_in_flight(int rank) const;
  // What `rank` holds after each of its actions, counted in (stage, micro-batch) pairs: forwards whose (input)
  // backward has not run, which keep their activations, and input steps whose weight step has not, which keep their
  // linears' inputs and output gradients (zero-bubble schedules; always 0 for the others). Only the states no other
  // state holds at least as much of both, in action order. `graph_until_weight_step`: a forward keeps its
  // activations until its weight step (torch.distributed.pipelining's input step retains the graph for it).
  struct Held {
    int forwards = 0;
    int deferred = 0;
  };
  std::vector<Held> held(int rank, bool graph_until_weight_step = false) const;
  // One CSV row per rank in the from_csv format.
  std::string to_csv() const;

 private:
  static Schedule build(const ScheduleTraits& traits, int pp, int stages, int microbatches);
  // Every (stage, micro-batch) computed exactly once, on its rank; neighbouring stages take micro-batches in the
  // same order (their messages are matched in order).
  void check(const std::string& where) const;
  std::string name_;
  int pp_ = 1, stages_ = 1, microbatches_ = 1;
  bool v_shape_ = false;
  std::vector<std::vector<Action>> per_rank_;
};

}  // namespace titan::distributed::pipeline
