#include "titan/distributed/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::distributed::pipeline {
namespace {

const std::vector<ScheduleTraits>& all_traits() {
  static const std::vector<ScheduleTraits> traits = {
      {"GPipe", true, false, false},
      {"1F1B", true, false, false},
      {"Interleaved1F1B", false, false, false},
      {"LoopedBFS", false, false, false},
      {"InterleavedZeroBubble", false, false, true},
      {"ZBVZeroBubble", false, true, true},
      {"DualPipeV", false, true, true},
  };
  return traits;
}

// Builds one rank's order, numbering each stage's forwards, backwards and weight steps in the order they are added.
class Order {
 public:
  void add(int stage, Op op) {
    int& next = counters_[{stage, op == Op::Backward ? Op::BackwardInput : op}];
    actions.push_back(Action{stage, op, next++});
  }
  std::vector<Action> actions;

 private:
  std::map<std::pair<int, Op>, int> counters_;
};

std::vector<Action> gpipe(int rank, int m) {
  Order o;
  for (int i = 0; i < m; ++i) o.add(rank, Op::Forward);
  for (int i = 0; i < m; ++i) o.add(rank, Op::Backward);
  return o.actions;
}

// 1F1B: the last stage alternates from the start; each rank further from it runs one more forward first.
std::vector<Action> one_f_one_b(int rank, int p, int m) {
  Order o;
  const int warmup = std::min(m, p - 1 - rank);
  for (int i = 0; i < warmup; ++i) o.add(rank, Op::Forward);
  for (int i = warmup; i < m; ++i) {
    o.add(rank, Op::Forward);
    o.add(rank, Op::Backward);
  }
  for (int i = 0; i < warmup; ++i) o.add(rank, Op::Backward);
  return o.actions;
}

// Breadth-first: every micro-batch through the rank's first stage, then its next; backwards in reverse.
std::vector<Action> looped_bfs(int rank, int p, int local, int m) {
  Order o;
  for (int k = 0; k < local; ++k)
    for (int i = 0; i < m; ++i) o.add(k * p + rank, Op::Forward);
  std::vector<Action> out = o.actions;
  for (int k = local - 1; k >= 0; --k)
    for (int i = m - 1; i >= 0; --i) out.push_back(Action{k * p + rank, Op::Backward, i});
  return out;
}

// Depth-first interleaving (Megatron's interleaved 1F1B, and the ZB-1P zero-bubble variant): micro-batches move
// through the rank's stages in rounds of `per_round`; a warm-up of forwards, a steady phase pairing each forward
// with a backward, then the remaining backwards. With `zero_bubble` backward is split and each weight step follows
// its input step `rank` pairs later (the rest at the end), filling what would be idle time.
std::vector<Action> interleaved(int rank, int p, int local, int m, bool zero_bubble) {
  const int rounds = std::max(1, m / p);
  const int per_round = m / rounds;
  const int warmup = std::min((local - 1) * per_round + (zero_bubble ? 1 : 2) * (p - 1 - rank), m * local);
  const int steady = m * local - warmup;
  const int total = m * local + warmup;  // warm-up forwards, steady pairs, cool-down backwards
  auto forward_stage = [&](int step) { return ((step / per_round) % local) * p + rank; };
  auto backward_stage = [&](int step) { return (local - 1 - ((step - warmup) / per_round) % local) * p + rank; };
  Order o;
  std::vector<int> backward_steps;
  size_t weights_done = 0;
  auto backward = [&](int step) {
    o.add(backward_stage(step), zero_bubble ? Op::BackwardInput : Op::Backward);
    backward_steps.push_back(step);
    if (zero_bubble && step - warmup >= rank) o.add(backward_stage(backward_steps[weights_done++]), Op::BackwardWeight);
  };
  for (int step = 0; step < total; ++step) {
    if (step < warmup) {
      o.add(forward_stage(step), Op::Forward);
    } else if (step < warmup + steady) {
      o.add(forward_stage(step), Op::Forward);
      backward(step);
    } else {
      backward(step);
    }
  }
  while (zero_bubble && weights_done < backward_steps.size()) o.add(backward_stage(backward_steps[weights_done++]), Op::BackwardWeight);
  return o.actions;
}

// ZB-V: two stages per rank in a V (rank r holds r and 2p - 1 - r); forwards of the first chunk, then alternating
// chunks, each backward split into I and W, weight steps held back to the end of the cool-down.
std::vector<Action> zbv(int rank, int p, int m) {
  const int n = std::max(2 * p - 1, m);  // built for at least 2p - 1 micro-batches, then trimmed to m
  const int c0 = rank, c1 = 2 * p - 1 - rank;
  std::vector<Action> a;
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  auto push = [&](int stage, Op op, int mb) { a.push_back(Action{stage, op, mb}); };
  for (int i = 0; i < 2 * (p - rank) - 1; ++i) push(c0, Op::Forward, f0++);
  for (int i = 0; i < rank; ++i) push(c1, Op::Forward, f1++), push(c0, Op::Forward, f0++);
  for (int i = 0; i < p - rank; ++i) {
    push(c1, Op::Forward, f1++);
    push(c1, Op::BackwardInput, b1);
    push(c1, Op::BackwardWeight, b1++);
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) push(c0, Op::Forward, f0++);
    push(c0, Op::BackwardInput, b0);
    push(c0, Op::BackwardWeight, b0++);
    push(c1, Op::Forward, f1++);
    push(c1, Op::BackwardInput, b1);
    push(c1, Op::BackwardWeight, b1++);
  }
  int w0 = b0, w1 = b1;
  for (int i = 0; i < rank; ++i) push(c0, Op::BackwardInput, b0++), push(c1, Op::BackwardInput, b1++);
  for (int i = 0; i < p - rank; ++i) push(c0, Op::BackwardInput, b0++), push(c0, Op::BackwardWeight, w0++);
  while (w1 < b1) push(c1, Op::BackwardWeight, w1++);
  while (w0 < b0) push(c0, Op::BackwardWeight, w0++);
  std::vector<Action> out;
  for (const auto& x : a)
    if (x.microbatch < m) out.push_back(x);
  return out;
}

// DualPipeV (DeepSeek-V3's bidirectional schedule folded into a V, as torch.distributed.pipelining orders it): rank r
// holds stages r and 2p - 1 - r. After a warm-up of forwards it runs pairs of one stage's forward with the other's
// full backward (DualPipe overlaps each pair's computation with the other's communication; here they run one after
// the other); the cool-down splits the last backwards, and their weight steps fill the tail in the order the input
// steps ran.
std::vector<Action> dual_pipe_v(int rank, int p, int m) {
  const int c0 = rank, c1 = 2 * p - 1 - rank;
  Order o;
  std::deque<Action> weights;  // weight steps of input steps already run, oldest first
  auto forward = [&](int stage) { o.add(stage, Op::Forward); };
  auto backward = [&](int stage, bool split) {
    o.add(stage, split ? Op::BackwardInput : Op::Backward);
    if (split) weights.push_back(Action{stage, Op::BackwardWeight, o.actions.back().microbatch});
  };
  auto weight = [&] {  // numbered by the queue: a stage's full backwards leave gaps in its weight steps' micro-batches
    if (weights.empty()) return;
    o.actions.push_back(weights.front());
    weights.pop_front();
  };
  const int after = p - rank - 1;  // ranks after this one
  for (int i = 0; i < 2 * after; ++i) forward(c0);
  for (int i = 0; i <= rank; ++i) forward(c0), forward(c1);
  for (int i = 0; i < after; ++i) backward(c1, true), weight(), forward(c1);
  for (int i = 0; i < m - 2 * p + rank + 1; ++i) {
    forward(c0), backward(c1, false);  // the last rank's first pair is not overlapped in DualPipe: same order here
    forward(c1), backward(c0, false);
  }
  for (int i = 0; i < after; ++i) backward(c1, false), forward(c1), backward(c0, false);
  // The cool-down: the later half of these backwards is split (from stage c1 on odd ranks, c0 on even ones).
  bool split = false;
  for (int i = 0; i <= rank; ++i) {
    if (i == (rank + 1) / 2 && rank % 2 == 1) split = true;
    backward(c1, split);
    if (i == (rank + 1) / 2 && rank % 2 == 0) split = true;
    backward(c0, split);
  }
  for (int i = 0; i < after; ++i) weight(), backward(c0, split);
  while (!weights.empty()) weight();
  return o.actions;
}

bool is_backward(Op op) { return op == Op::Backward || op == Op::BackwardInput; }

}  // namespace

std::string Action::str() const { return cat(stage, static_cast<char>(op), microbatch); }

std::vector<std::string> schedule_names() {
  std::vector<std::string> out;
  for (const auto& t : all_traits()) out.push_back(t.name);
  return out;
}

ScheduleTraits schedule_traits(const std::string& name) {
  for (const auto& t : all_traits())
    if (to_lower(t.name) == to_lower(name)) return t;
  fail("parallelism.pipeline_parallel_schedule = ", quote(name), " is not a schedule titan.cpp knows; valid: ",
       join(schedule_names(), ", "), " (or a custom order in parallelism.pipeline_parallel_schedule_csv)");
}

Schedule Schedule::make(const std::string& name, int pp, int stages, int m) {
  const ScheduleTraits t = schedule_traits(name);
  // Built, checked and simulated once per process for each (schedule, ranks, stages, micro-batches): titan plan's
  // search asks for the same few thousands of times (a tenth of its time went here). Refusals are not kept: they
  // throw again.
  static std::mutex mutex;
  static std::map<std::tuple<std::string, int, int, int>, Schedule> built;
  const auto key = std::make_tuple(t.name, pp, stages, m);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = built.find(key); it != built.end()) return it->second;
  }
  Schedule s = build(t, pp, stages, m);
  std::lock_guard<std::mutex> lock(mutex);
  built.emplace(key, s);
  return s;
}

Schedule Schedule::build(const ScheduleTraits& t, int pp, int stages, int m) {
  Schedule s;
  s.name_ = t.name;
  s.pp_ = pp;
  s.stages_ = stages;
  s.microbatches_ = m;
  s.v_shape_ = t.v_shape;
  const std::string what = cat("parallelism.pipeline_parallel_schedule = ", quote(t.name), " with ", pp, " pipeline ranks, ",
                               stages, " stages and ", m, " micro-batches");
  if (stages % pp != 0) fail(what, ": the stages do not divide evenly over the ranks");
  const int local = stages / pp;
  if (t.single_stage && local != 1)
    fail(what, ": ", t.name, " runs one stage per rank, got ", local, "; use Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
         "ZBVZeroBubble or DualPipeV for virtual stages");
  if (!t.single_stage && local < 2 && pp > 1)
    fail(what, ": ", t.name, " needs at least 2 stages per rank, got ", local,
         "; lower parallelism.pipeline_parallel_layers_per_stage or use GPipe/1F1B");
  if (t.v_shape && local != 2) fail(what, ": ", t.name, " needs exactly 2 stages per rank, got ", local);
  if (t.name == "DualPipeV" && m < stages)
    fail(what, ": DualPipeV needs at least as many micro-batches as stages; raise training.local_batch_size or lower "
         "parallelism.pipeline_parallel_microbatch_size (micro-batches = local_batch_size / microbatch_size)");
  if (t.name == "1F1B" && m < stages)
    fail(what, ": 1F1B needs at least as many micro-batches as stages; raise training.local_batch_size or lower "
         "parallelism.pipeline_parallel_microbatch_size (micro-batches = local_batch_size / microbatch_size)");
  if (t.name == "Interleaved1F1B" || t.name == "InterleavedZeroBubble") {
    const int rounds = std::max(1, m / pp);
    if (m % rounds != 0)
      fail(what, ": ", t.name, " needs the micro-batches to be a multiple of their rounds (max(1, ", m, " / ", pp, ") = ",
           rounds, "); use a multiple of ", pp, " or fewer micro-batches than ranks");
  }
  for (int r = 0; r < pp; ++r) {
    if (t.name == "GPipe") s.per_rank_.push_back(gpipe(r, m));
    else if (t.name == "1F1B") s.per_rank_.push_back(one_f_one_b(r, pp, m));
    else if (t.name == "LoopedBFS") s.per_rank_.push_back(looped_bfs(r, pp, local, m));
    else if (t.name == "ZBVZeroBubble") s.per_rank_.push_back(zbv(r, pp, m));
    else if (t.name == "DualPipeV") s.per_rank_.push_back(dual_pipe_v(r, pp, m));
    else s.per_rank_.push_back(interleaved(r, pp, local, m, t.splits_backward));
  }
  s.check(what);
  s.simulate();
  return s;
}

Schedule Schedule::from_csv(const std::string& path, int pp, int stages, int m, bool v_shape) {
  std::ifstream in(path);
  if (!in) fail("parallelism.pipeline_parallel_schedule_csv = ", quote(path), ": cannot open the file");
  Schedule s;
  s.name_ = "CSV " + path;
  s.pp_ = pp;
  s.stages_ = stages;
  s.microbatches_ = m;
  s.v_shape_ = v_shape;
  std::string line;
  int row = 0;
  while (std::getline(in, line)) {
    ++row;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (row > pp && trim(line).empty()) continue;
    if (row > pp) fail(quote(path), " row ", row, ": the schedule has more rows than the ", pp, " pipeline ranks");
    std::vector<Action> actions;
    int column = 0;
    for (const auto& raw : split(line, ',')) {
      ++column;
      const std::string cell = trim(raw);
      if (cell.empty()) continue;
      size_t i = 0;
      while (i < cell.size() && std::isdigit(static_cast<unsigned char>(cell[i]))) ++i;
      size_t j = i;
      while (j < cell.size() && std::isalpha(static_cast<unsigned char>(cell[j]))) ++j;
      const std::string type = cell.substr(i, j - i);
      const bool digits_after = j < cell.size() && std::all_of(cell.begin() + static_cast<std::ptrdiff_t>(j), cell.end(),
                                                              [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      if (i == 0 || type.size() != 1 || std::string("FBIW").find(type) == std::string::npos || !digits_after)
        fail(quote(path), " row ", row, " column ", column, ": ", quote(cell), " is not a compute action; expected ",
             "[stage][F|B|I|W][micro-batch] such as 0F1 (compute-only format: communication is derived)");
      actions.push_back(Action{std::stoi(cell.substr(0, i)), static_cast<Op>(type[0]), std::stoi(cell.substr(j))});
    }
    s.per_rank_.push_back(std::move(actions));
  }
  if (static_cast<int>(s.per_rank_.size()) != pp)
    fail(quote(path), ": the schedule has ", s.per_rank_.size(), " rows; expected one per pipeline rank (", pp, ")");
  s.check(quote(path));
  s.simulate();
  return s;
}

int Schedule::rank_of(int stage) const {
  if (!v_shape_) return stage % pp_;
  const int lap = stage / pp_, within = stage % pp_;
  return lap % 2 == 0 ? within : pp_ - 1 - within;
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < stages_; ++s)
    if (rank_of(s) == rank) out.push_back(s);
  return out;
}

bool Schedule::splits_backward() const {
  for (const auto& actions : per_rank_)
    for (const auto& a : actions)
      if (a.op == Op::BackwardInput) return true;
  return false;
}

void Schedule::check(const std::string& where) const {
  std::map<std::tuple<int, char, int>, int> seen;  // (stage, F|B|I|W, micro-batch) -> rank
  for (int r = 0; r < pp_; ++r) {
    for (const auto& a : per_rank_[static_cast<size_t>(r)]) {
      if (a.stage < 0 || a.stage >= stages_)
        fail(where, ": rank ", r, " runs ", a.str(), " but there are stages 0..", stages_ - 1);
      if (a.microbatch < 0 || a.microbatch >= microbatches_)
        fail(where, ": rank ", r, " runs ", a.str(), " but there are micro-batches 0..", microbatches_ - 1);
      if (rank_of(a.stage) != r) fail(where, ": rank ", r, " runs ", a.str(), " but stage ", a.stage, " lives on rank ", rank_of(a.stage));
      auto [it, fresh] = seen.emplace(std::tuple{a.stage, static_cast<char>(a.op), a.microbatch}, r);
      if (!fresh) fail(where, ": ", a.str(), " appears twice");
    }
  }
  for (int s = 0; s < stages_; ++s)
    for (int m = 0; m < microbatches_; ++m) {
      auto has = [&](Op op) { return seen.count({s, static_cast<char>(op), m}) > 0; };
      const std::string id = cat("stage ", s, " micro-batch ", m);
      if (!has(Op::Forward)) fail(where, ": ", id, " has no forward (", Action{s, Op::Forward, m}.str(), ")");
      const bool full = has(Op::Backward), input = has(Op::BackwardInput), weight = has(Op::BackwardWeight);
      if (full && (input || weight)) fail(where, ": ", id, " has both a full backward and a split one");
      if (!full && !(input && weight))
        fail(where, ": ", id, " needs a backward: ", Action{s, Op::Backward, m}.str(), ", or both ", Action{s, Op::BackwardInput, m}.str(),
             " and ", Action{s, Op::BackwardWeight, m}.str());
    }
  // Messages between two stages are matched in the order they are sent (NCCL has no tags), so neighbouring stages
  // must take the micro-batches in the same order: forwards for activations, backwards for their gradients.
  auto order = [&](int stage, bool forward) {
    std::vector<int> out;
    for (const auto& a : per_rank_[static_cast<size_t>(rank_of(stage))])
      if (a.stage == stage && (forward ? a.op == Op::Forward : a.op == Op::Backward || a.op == Op::BackwardInput))
        out.push_back(a.microbatch);
    return out;
  };
  auto text = [](const std::vector<int>& v) {
    std::string out;
    for (int m : v) out += cat(out.empty() ? "" : " ", m);
    return out;
  };
  for (int s = 0; s + 1 < stages_; ++s)
    for (bool forward : {true, false}) {
      const auto low = order(s, forward), high = order(s + 1, forward);
      if (low != high)
        fail(where, ": stage ", s, " runs its ", forward ? "forwards" : "backwards", " in micro-batch order ", text(low),
             " but stage ", s + 1, " in ", text(high), "; activations and gradients between neighbouring stages are "
             "matched in the order they are sent, so both stages must take the micro-batches in the same order");
    }
}

Schedule::Simulation Schedule::simulate() const {
  // A forward, an input step and a weight step take one unit each; a full backward two (it is both steps).
  auto duration = [](Op op) -> int64_t { return op == Op::Backward ? 2 : 1; };
  std::map<std::tuple<int, char, int>, int64_t> ends;
  auto end_of = [&](int s, Op op, int m) -> std::optional<int64_t> {
    auto it = ends.find({s, static_cast<char>(op), m});
    if (it == ends.end()) return std::nullopt;
    return it->second;
  };
  // When every action `a` depends on has ended, the latest of those ends; nothing while one has not.
  auto ready_at = [&](const Action& a) -> std::optional<int64_t> {
    std::vector<std::optional<int64_t>> needs;
    switch (a.op) {
      case Op::Forward:
        if (a.stage > 0) needs.push_back(end_of(a.stage - 1, Op::Forward, a.microbatch));
        break;
      case Op::Backward:
      case Op::BackwardInput:
        needs.push_back(end_of(a.stage, Op::Forward, a.microbatch));
        if (a.stage < stages_ - 1) {
          auto next = end_of(a.stage + 1, Op::Backward, a.microbatch);
          needs.push_back(next ? next : end_of(a.stage + 1, Op::BackwardInput, a.microbatch));
        }
        break;
      case Op::BackwardWeight: needs.push_back(end_of(a.stage, Op::BackwardInput, a.microbatch)); break;
    }
    int64_t at = 0;
    for (const auto& n : needs) {
      if (!n) return std::nullopt;
      at = std::max(at, *n);
    }
    return at;
  };
  Simulation sim;
  sim.slot.resize(static_cast<size_t>(pp_));
  std::vector<size_t> next(static_cast<size_t>(pp_), 0);
  std::vector<int64_t> free(static_cast<size_t>(pp_), 0);
  int64_t busy = 0;
  for (;;) {
    bool progress = false, remaining = false;
    for (int r = 0; r < pp_; ++r) {
      const auto& actions = per_rank_[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      int64_t& at = free[static_cast<size_t>(r)];
      for (; i < actions.size(); ++i) {
        const auto dependencies = ready_at(actions[i]);
        if (!dependencies) break;
        at = std::max(at, *dependencies);
        sim.slot[static_cast<size_t>(r)].push_back(at);
        at += duration(actions[i].op);
        busy += duration(actions[i].op);
        ends[{actions[i].stage, static_cast<char>(actions[i].op), actions[i].microbatch}] = at;
        progress = true;
      }
      remaining = remaining || i < actions.size();
    }
    if (!remaining) break;
    if (!progress) {
      std::vector<std::string> stuck;
      for (int r = 0; r < pp_; ++r) {
        const auto& actions = per_rank_[static_cast<size_t>(r)];
        if (next[static_cast<size_t>(r)] < actions.size()) stuck.push_back(cat("rank ", r, " at ", actions[next[static_cast<size_t>(r)]].str()));
      }
      fail("pipeline schedule ", name_, " deadlocks: every rank waits for another (", join(stuck, "; "),
           "); each forward needs the previous stage's forward, each backward the next stage's backward");
    }
  }
  sim.makespan = *std::max_element(free.begin(), free.end());
  sim.bubble = sim.makespan == 0 ? 0.0 : 1.0 - static_cast<double>(busy) / static_cast<double>(sim.makespan * pp_);
  return sim;
}

int Schedule::max_in_flight(int rank) const {
  int now = 0, most = 0;
  for (const auto& a : actions(rank)) {
    if (a.op == Op::Forward) most = std::max(most, ++now);
    else if (is_backward(a.op)) --now;
  }
  return most;
}

std::vector<Schedule::Held> Schedule::held(int rank, bool graph_until_weight_step) const {
  std::vector<Held> states;
  Held now;
  for (const auto& a : actions(rank)) {
    if (a.op == Op::Forward) ++now.forwards;
    else if (graph_until_weight_step ? a.op == Op::Backward || a.op == Op::BackwardWeight : is_backward(a.op)) --now.forwards;
    if (a.op == Op::BackwardInput) ++now.deferred;
    else if (a.op == Op::BackwardWeight) --now.deferred;
    states.push_back(now);
  }
  std::vector<Held> kept;
  for (const Held& s : states) {
    const bool covered = std::any_of(states.begin(), states.end(), [&](const Held& o) {
      return o.forwards >= s.forwards && o.deferred >= s.deferred && (o.forwards > s.forwards || o.deferred > s.deferred);
    });
    const bool repeated = std::any_of(kept.begin(), kept.end(), [&](const Held& o) { return o.forwards == s.forwards && o.deferred == s.deferred; });
    if (!covered && !repeated) kept.push_back(s);
  }
  return kept;
}

std::string Schedule::to_csv() const {
  std::string out;
  for (const auto& actions : per_rank_) {
    std::vector<std::string> cells;
    for (const auto& a : actions) cells.push_back(a.str());
    out += join(cells, ",") + "\n";
  }
  return out;
}

}  // namespace titan::distributed::pipeline
