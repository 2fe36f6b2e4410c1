// `titan plan`: predicted memory per rank, step time, tokens/s and MFU of a job's layout on a cluster profile, or
// with --search the fastest layouts that fit a number of GPUs.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/cli/arguments.h"
#include "titan/cli/commands.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/config/loader.h"
#include "titan/distributed/pipeline/stages.h"
#include "titan/models/registry.h"
#include "titan/trainer/job_model.h"
#include "titan/plan/plan.h"

namespace titan::cli {

namespace {

const char* kPlanUsage =
    "usage: titan plan --cluster C [--gpus N] [--json] [--as titan|torchtitan] [--job.config_file FILE] [--section.key value ...]\n"
    "       titan plan --search --gpus N --cluster C [--top K] [--json] --model.flavor F --training.seq_len S\n"
    "                  --training.global_batch_size B [...]\n"
    "Predicts a layout's memory per rank, step time, tokens/s per device and MFU on a cluster, from shapes alone;\n"
    "--search ranks every layout of N GPUs that fits (--top K of them, default 5). C: a built-in profile (%s) or a\n"
    "TOML file (docs/plan.md). --as torchtitan predicts torchtitan's execution instead of titan's (docs/plan.md).\n"
    "       titan plan --calibrate RUNS.jsonl [--folds K] [--json]\n"
    "Fits the calibrated constants to measured runs (one JSON object per line: \"args\", the plan's arguments with\n"
    "--cluster; \"tokens_per_second_per_device\"; optionally \"memory_gib\" and \"group\") and reports how well\n"
    "constants fitted on the other folds predict each fold's runs (K folds of whole groups; default: one per group).\n"
    "       titan plan --evaluate RUNS.jsonl [--json]\n"
    "Predicts the runs of such a file with their profiles' constants, fitting nothing, and reports each run's\n"
    "predicted / measured ratio, how many are within 15%% (10%% on memory) and how many inside the printed band.\n";

double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

const char* phase_name(protocols::Phase phase) {
  switch (phase) {
    case protocols::Phase::loss: return "loss";
    case protocols::Phase::blocks_backward: return "blocks_backward";
    case protocols::Phase::activations: return "activations";
    case protocols::Phase::gradients: return "gradients";
    case protocols::Phase::head_gradients: return "head_gradients";
    case protocols::Phase::last_gradients: return "last_gradients";
    case protocols::Phase::embedding_backward: return "embedding_backward";
    case protocols::Phase::optimizer_step: return "optimizer_step";
    case protocols::Phase::step: break;
  }
  return "step";
}

// The rank whose memory the dry run (comm.mode = "fake_backend") measures: under a pipeline the first rank, in the
// mesh's order (pp outermost), of the pipeline rank with the largest estimate; rank 0 otherwise.
int64_t dry_run_rank(const plan::Plan& p) {
  int64_t pipeline_rank = 0;
  double largest = -1;
  for (const auto& r : p.pipeline_ranks)
    if (r.memory.total() > largest) largest = r.memory.total(), pipeline_rank = r.rank;
  return pipeline_rank * p.dims.world_size / p.dims.pp;
}

nlohmann::ordered_json to_json(const plan::Plan& p, const plan::ClusterProfile& cluster) {
  nlohmann::ordered_json memory = nlohmann::ordered_json::object();
  for (const auto& t : p.memory.terms) memory[t.name] = t.bytes;
  // Terms not held through the whole step, by when they are (protocols::Phase; allocated_bytes says how they combine).
  nlohmann::ordered_json apart = {{"loss", nlohmann::ordered_json::array()}, {"blocks_backward", nlohmann::ordered_json::array()},
                                  {"activations", nlohmann::ordered_json::array()}, {"gradients", nlohmann::ordered_json::array()},
                                  {"optimizer_step", nlohmann::ordered_json::array()}, {"head_gradients", nlohmann::ordered_json::array()},
                                  {"last_gradients", nlohmann::ordered_json::array()}, {"embedding_backward", nlohmann::ordered_json::array()}};
  for (const auto& t : p.memory.terms)
    if (t.phase != protocols::Phase::step && t.bytes > 0) apart[phase_name(t.phase)].push_back(t.name);
  nlohmann::ordered_json time = nlohmann::ordered_json::object();
  for (const auto& t : p.time.terms) time[t.name] = {{"seconds", t.seconds}, {"total_seconds", t.total}, {"detail", t.detail}};
  nlohmann::ordered_json stages = nlohmann::ordered_json::array();
  for (const auto& r : p.pipeline_ranks) stages.push_back({{"kind", r.kind}, {"pipeline_rank", r.rank}, {"allocated_bytes", r.memory.total()}});
  return {{"layout", p.layout},
          {"degrees", {{"dp_replicate", p.dims.dp_replicate}, {"dp_shard", p.dims.dp_shard}, {"cp", p.dims.cp}, {"tp", p.dims.tp}, {"pp", p.dims.pp}, {"ep", p.dims.ep}, {"etp", p.dims.etp}}},
          {"world_size", p.dims.world_size},
          {"memory", {{"terms", memory}, {"held_apart", apart}, {"allocated_bytes", p.memory.total()}, {"reserved_bytes", p.reserved_bytes},
                      {"device_bytes", p.device_bytes}, {"device_capacity_bytes", cluster.memory_bytes}, {"fits", p.fits},
                      {"pipeline_ranks", stages}}},
          {"time", {{"terms", time}, {"bubble_fraction", p.time.bubble_fraction}, {"step_seconds", p.time.step_seconds}}},
          {"tokens_per_second_per_device", p.time.tokens_per_second_per_device},
          {"tokens_per_second_band", {p.time.tokens_per_second_low, p.time.tokens_per_second_high}},
          {"mfu", p.time.mfu},
          {"bound", p.time.bound},
          {"not_runnable", p.not_runnable},
          {"dry_run", {{"NGPU", p.dims.world_size}, {"RANK", dry_run_rank(p)}}}};
}

void print_plan(const plan::Plan& p, const plan::ClusterProfile& cluster) {
  std::cout << "layout: " << p.layout << " (" << p.dims.world_size << " ranks)\n"
            << "memory per rank" << (p.dims.pp > 1 ? " (bounding every pipeline rank: the most blocks and micro-batches any holds, with the embedding and the loss)" : "") << ":\n";
  bool apart = false, made = false, optimizer = false;
  for (const auto& t : p.memory.terms) {
    if (t.bytes <= 0) continue;
    using protocols::Phase;
    const char* when = t.phase == Phase::loss              ? " (loss)"
                       : t.phase == Phase::blocks_backward ? " (backward)"
                       : t.phase == Phase::activations     ? " (freed in backward)"
                       : t.phase == Phase::gradients       ? " (made in backward)"
                       : t.phase == Phase::head_gradients  ? " (made by the loss's backward)"
                       : t.phase == Phase::last_gradients  ? " (made after the blocks')"
                       : t.phase == Phase::embedding_backward ? " (the embedding's backward)"
                       : t.phase == Phase::optimizer_step  ? " (optimizer step)"
                                                           : "";
    apart = apart || *when;
    optimizer = optimizer || t.phase == Phase::optimizer_step;
    made = made || t.phase == Phase::activations || t.phase == Phase::gradients || t.phase == Phase::head_gradients ||
           t.phase == Phase::last_gradients || t.phase == Phase::embedding_backward;
    std::cout << strprintf("  %-18s %9.2f GiB%s\n", t.name.c_str(), gib(t.bytes), when);
  }
  if (made)
    std::cout << "  (allocated counts the largest of " << (optimizer ? "four" : "three")
              << " moments: the forward's end with the loss's terms; the blocks'\n"
                 "   backward, where the gradients are made as the activations are freed, with the backward's terms; "
              << (optimizer ? "the\n   embedding's backward, with every gradient; and the optimizer's step, with every gradient)\n"
                            : "and\n   the embedding's backward, with every gradient)\n");
  else if (apart)
    std::cout << (optimizer ? "  (the loss's, the backward's and the optimizer step's terms are not held at once: allocated counts the largest)\n"
                            : "  (the loss's and the backward's terms are not held at once: allocated counts the larger)\n");
  std::cout << strprintf("  %-18s %9.2f GiB\n", "allocated", gib(p.memory.total()))
            << strprintf("  %-18s %9.2f GiB (allocator blocks and rounding)\n", "reserved", gib(p.reserved_bytes))
            << strprintf("  %-18s %9.2f GiB of %.2f GiB (%s): %s\n", "with context", gib(p.device_bytes), gib(cluster.memory_bytes),
                         cluster.name.c_str(), p.fits ? "fits" : "DOES NOT FIT");
  for (const auto& r : p.pipeline_ranks)
    std::cout << strprintf("  %-18s %9.2f GiB allocated (pipeline rank %lld)\n",
                           r.kind == "first_and_last" ? "first+last stages" : (r.kind + " stage").c_str(), gib(r.memory.total()),
                           static_cast<long long>(r.rank));
  // One rank's measured peak, on one device: comm.mode = "fake_backend" plays it alone.
  const int64_t rank = dry_run_rank(p), per_pipeline_rank = p.dims.world_size / p.dims.pp;
  std::cout << strprintf("  measure it: NGPU=%lld RANK=%lld titan train <these options> --comm.mode fake_backend --training.steps 3\n"
                         "    trains rank %lld%s alone on one device, with its shapes and memory and no communication "
                         "(docs/distributed.md)\n",
                         static_cast<long long>(p.dims.world_size), static_cast<long long>(rank), static_cast<long long>(rank),
                         p.dims.pp > 1 ? strprintf(" (pipeline rank %lld)", static_cast<long long>(rank / per_pipeline_rank)).c_str() : "");
  std::cout << strprintf("time per step: %.3f s\n", p.time.step_seconds);
  for (const auto& t : p.time.terms) {
    std::string hidden = t.total > t.seconds * 1.0001 ? strprintf(" (%.3f s in all, the rest hidden)", t.total) : "";
    std::cout << strprintf("  %-22s %9.3f s%s  %s\n", t.name.c_str(), t.seconds, hidden.c_str(), t.detail.c_str());
  }
  std::cout << strprintf("predicted: %.0f tokens/s per device, MFU %.1f%%, bound by %s\n", p.time.tokens_per_second_per_device,
                         p.time.mfu * 100, p.time.bound.c_str())
            << strprintf("  likely %.0f to %.0f tokens/s: where 80%% of 58 published runs fell, each predicted by "
                         "constants not fitted on it (docs/plan.md)\n",
                         p.time.tokens_per_second_low, p.time.tokens_per_second_high);
  if (!p.not_runnable.empty())
    std::cout << "modelled, but titan cannot run it yet: " << join(p.not_runnable, "; ") << "\n";
}

struct Request {
  bool as_json = false, search = false;
  std::string cluster_spec, calibrate, evaluate;
  int64_t gpus = 0, top = 5, folds = 0;
  protocols::Execution execution = protocols::Execution::titan;
  std::vector<std::string> args;  // the job's configuration
};

Request parse_request(const std::vector<std::string>& raw_args) {
  Request r;
  auto& [as_json, search, cluster_spec, calibrate, evaluate, gpus, top, folds, execution, args] = r;
  for (size_t i = 0; i < raw_args.size(); ++i) {
    const std::string& a = raw_args[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (a.rfind(flag + "=", 0) == 0) return a.substr(flag.size() + 1);
      if (i + 1 >= raw_args.size()) fail(flag, " needs a value");
      return raw_args[++i];
    };
    auto is = [&](const std::string& flag) { return a == flag || a.rfind(flag + "=", 0) == 0; };
    if (a == "--json") as_json = true;
    else if (a == "--search") search = true;
    else if (is("--cluster")) cluster_spec = value("--cluster");
    else if (is("--gpus")) gpus = positive_integer_argument("--gpus", value("--gpus"));
    else if (is("--top")) top = positive_integer_argument("--top", value("--top"));
    else if (is("--calibrate")) calibrate = value("--calibrate");
    else if (is("--evaluate")) evaluate = value("--evaluate");
    else if (is("--folds")) folds = positive_integer_argument("--folds", value("--folds"));
    else if (is("--as")) {
      const std::string v = value("--as");
      if (v != "titan" && v != "torchtitan") fail("--as ", quote(v), ": expected titan (the default) or torchtitan");
      execution = v == "torchtitan" ? protocols::Execution::torchtitan : protocols::Execution::titan;
    }
    else args.push_back(a);
  }
  return r;
}

std::string known_profiles() {
  std::vector<std::string> names;
  for (const auto& p : plan::builtin_cluster_profiles()) names.push_back(p.name);
  return join(names, ", ");
}

// One layout's plan (no search): the world size from --gpus or the degrees, the pipeline checked as the trainer
// checks it.
plan::Plan plan_layout(const config::LoadedConfig& loaded, const plan::ClusterProfile& cluster, int64_t gpus,
                       protocols::Execution execution, bool per_pipeline_rank) {
  const auto& c = loaded.config;
  const JobChoice choice = choose_job_model(loaded);
  const protocols::ModelSpec& spec = *choice.spec;
  const protocols::JobModel& job = choice.model;
  const auto& model = *job.args;
  int64_t world = gpus;
  const auto& par = c.parallelism;
  if (world == 0) {
    if (par.data_parallel_shard_degree == -1)
      fail("titan plan: parallelism.data_parallel_shard_degree = -1 takes the GPUs left over; give --gpus N to say how many");
    world = par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.context_parallel_degree *
            par.tensor_parallel_degree * par.pipeline_parallel_degree;
  }
  const auto dims = distributed::ParallelDims::from_config(par, world);
  // The pipeline's stages and schedule as the trainer would build them: a UserError names what cannot run.
  if (dims.pp > 1) distributed::pipeline::plan_stages(model.layers(), spec.tied_embeddings(model), c, dims.pp);
  return plan::make_plan(spec, model, c, dims, cluster, execution, per_pipeline_rank);
}

// --calibrate: the measured runs, each planned with candidate constants.
struct Run {
  std::string name, group;
  config::LoadedConfig loaded;
  plan::ClusterProfile cluster;
  int64_t gpus = 0;
  protocols::Execution execution = protocols::Execution::titan;
  double tokens_per_second = 0, memory_gib = 0;  // measured; memory 0 where not known
};

struct Ratios {
  double speed = 0, memory = 0;  // predicted / measured; memory 0 where not measured
};

Ratios predict(const Run& run, const plan::Calibration& calibration) {
  plan::ClusterProfile cluster = run.cluster;
  cluster.calibration = calibration;
  const plan::Plan p = plan_layout(run.loaded, cluster, run.gpus, run.execution, false);
  return {p.time.tokens_per_second_per_device / run.tokens_per_second,
          run.memory_gib > 0 ? p.reserved_bytes / (1024.0 * 1024.0 * 1024.0) / run.memory_gib : 0};
}

// The runs' summed absolute log errors (speed, and memory where measured): robust to the few rows no constant
// explains.
double loss(const std::vector<const Run*>& runs, const plan::Calibration& calibration) {
  double sum = 0;
  for (const Run* run : runs) {
    const Ratios r = predict(*run, calibration);
    sum += std::abs(std::log(r.speed));
    if (r.memory > 0) sum += std::abs(std::log(r.memory));
  }
  return sum;
}

// Coordinate descent over a grid per constant, from the built-in values, until a sweep changes nothing. Each
// constant is judged on the runs it affects (the others' errors do not change with it).
plan::Calibration fit(const std::vector<const Run*>& runs) {
  plan::Calibration best;
  struct Axis {
    double plan::Calibration::*member;
    double low, high, step;
    bool (*affects)(const Run&);
  };
  const std::vector<Axis> axes = {
      {&plan::Calibration::compile_memory_share, 0.1, 1.0, 0.05, [](const Run& r) { return plan::speedups_of(r.loaded.config).compile; }},
      {&plan::Calibration::float8_relative_efficiency, 0.5, 1.25, 0.05, [](const Run& r) { return plan::speedups_of(r.loaded.config).float8; }},
      {&plan::Calibration::ring_attention_overhead_per_rank, 0.0, 0.3, 0.01,
       [](const Run& r) { return r.loaded.config.parallelism.context_parallel_degree > 1; }},
      {&plan::Calibration::allocator_overhead, 0.0, 0.15, 0.005, [](const Run& r) { return r.memory_gib > 0; }}};
  for (int sweep = 0; sweep < 8; ++sweep) {
    bool changed = false;
    for (const Axis& axis : axes) {
      std::vector<const Run*> affected;
      for (const Run* r : runs)
        if (axis.affects(*r)) affected.push_back(r);
      if (affected.empty()) continue;
      double best_loss = loss(affected, best);
      for (int64_t k = 0; axis.low + k * axis.step <= axis.high + 1e-9; ++k) {
        plan::Calibration candidate = best;
        candidate.*axis.member = std::round((axis.low + k * axis.step) * 1000) / 1000;
        const double l = loss(affected, candidate);
        if (l < best_loss - 1e-12) best_loss = l, best = candidate, changed = true;
      }
    }
    if (!changed) break;
  }
  return best;
}

nlohmann::ordered_json calibration_json(const plan::Calibration& c) {
  return {{"compile_memory_share", c.compile_memory_share},
          {"float8_relative_efficiency", c.float8_relative_efficiency},
          {"ring_attention_overhead_per_rank", c.ring_attention_overhead_per_rank},
          {"allocator_overhead", c.allocator_overhead}};
}

// A prediction "hits" a measured run within 15% on tokens/s and, where the run's memory is known, 10% on memory.
bool hit(const Ratios& r) { return std::abs(r.speed - 1) <= 0.15 && (r.memory == 0 || std::abs(r.memory - 1) <= 0.10); }

int64_t hits(const std::vector<Ratios>& ratios) {
  return std::count_if(ratios.begin(), ratios.end(), hit);
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const size_t i = static_cast<size_t>(at);
  return i + 1 < v.size() ? v[i] + (v[i + 1] - v[i]) * (at - static_cast<double>(i)) : v.back();
}

// The measured runs of a --calibrate or --evaluate file, each checked to plan; errors name the file and line.
std::vector<Run> read_runs(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(flag, " ", quote(path), ": cannot open the file");
  std::vector<Run> runs;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = cat(path, ":", number);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(where, ": not a JSON object: ", e.what());
    }
    if (!j.is_object() || !j.contains("args") || !j["args"].is_array() || !j.contains("tokens_per_second_per_device") ||
        !j["tokens_per_second_per_device"].is_number() || j["tokens_per_second_per_device"].get<double>() <= 0)
      fail(where, ": expected {\"args\": [plan arguments with --cluster], \"tokens_per_second_per_device\": measured > 0, "
           "optionally \"memory_gib\": measured > 0, \"group\": a name, \"name\": a name}");
    std::vector<std::string> args;
    for (const auto& a : j["args"]) {
      if (!a.is_string()) fail(where, ": \"args\" must be strings");
      args.push_back(a.get<std::string>());
    }
    Request row = parse_request(args);
    if (row.cluster_spec.empty()) fail(where, ": the run's \"args\" need --cluster (", known_profiles(), " or a TOML file)");
    if (row.search || !row.calibrate.empty() || !row.evaluate.empty())
      fail(where, ": a run is one layout (no --search, --calibrate or --evaluate in its \"args\")");
    Run run;
    run.name = j.value("name", cat("line ", number));
    run.group = j.value("group", run.name);
    try {
      run.loaded = config::load_job_config(row.args);
      run.cluster = plan::load_cluster_profile(row.cluster_spec);
    } catch (const UserError& e) {
      fail(where, ": ", e.what());
    }
    run.gpus = row.gpus;
    run.execution = row.execution;
    run.tokens_per_second = j["tokens_per_second_per_device"].get<double>();
    if (j.contains("memory_gib") && !j["memory_gib"].is_null()) {
      if (!j["memory_gib"].is_number() || j["memory_gib"].get<double>() <= 0) fail(where, ": memory_gib must be a number > 0");
      run.memory_gib = j["memory_gib"].get<double>();
    }
    try {
      predict(run, run.cluster.calibration);
    } catch (const UserError& e) {
      fail(where, ": ", e.what());
    }
    runs.push_back(std::move(run));
  }
  if (runs.empty()) fail(flag, " ", quote(path), ": no runs in the file");
  return runs;
}

int run_calibrate(const Request& request) {
  const std::vector<Run> runs = read_runs("--calibrate", request.calibrate);
  if (runs.size() < 2) fail("--calibrate ", quote(request.calibrate), ": needs at least two runs");
  // Folds of whole groups, dealt in order of first appearance.
  std::vector<std::string> groups;
  for (const Run& r : runs)
    if (std::find(groups.begin(), groups.end(), r.group) == groups.end()) groups.push_back(r.group);
  const int64_t folds = request.folds > 0 ? request.folds : static_cast<int64_t>(groups.size());
  if (folds < 2 || folds > static_cast<int64_t>(groups.size()))
    fail("--folds ", folds, ": expected 2 to ", groups.size(), " (the runs' groups; each fold holds whole groups)");
  auto fold_of = [&](const Run& r) {
    return static_cast<int64_t>(std::find(groups.begin(), groups.end(), r.group) - groups.begin()) % folds;
  };
  std::vector<const Run*> all;
  for (const Run& r : runs) all.push_back(&r);
  const plan::Calibration fitted = fit(all);
  std::vector<Ratios> held_out(runs.size()), in_sample(runs.size()), defaults(runs.size());
  std::vector<plan::Calibration> per_fold;
  for (int64_t f = 0; f < folds; ++f) {
    std::vector<const Run*> train;
    for (const Run& r : runs)
      if (fold_of(r) != f) train.push_back(&r);
    per_fold.push_back(fit(train));
    for (size_t i = 0; i < runs.size(); ++i)
      if (fold_of(runs[i]) == f) held_out[i] = predict(runs[i], per_fold.back());
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    in_sample[i] = predict(runs[i], fitted);
    defaults[i] = predict(runs[i], runs[i].cluster.calibration);
  }
  std::vector<double> speed_ratios;
  for (const Ratios& r : held_out) speed_ratios.push_back(r.speed);
  // The band a prediction P carries: the measured value lay within [P / high, P / low] for 80% of held-out runs.
  const double low = quantile(speed_ratios, 0.1), median = quantile(speed_ratios, 0.5), high = quantile(speed_ratios, 0.9);
  nlohmann::ordered_json out;
  out["runs"] = runs.size();
  out["groups"] = groups.size();
  out["folds"] = folds;
  out["built_in"] = calibration_json(plan::Calibration{});
  out["fitted"] = calibration_json(fitted);
  out["per_fold"] = nlohmann::ordered_json::array();
  for (const auto& c : per_fold) out["per_fold"].push_back(calibration_json(c));
  out["hits"] = {{"held_out", hits(held_out)}, {"fitted_on_all", hits(in_sample)}, {"profile_constants", hits(defaults)}};
  out["held_out_speed_ratio"] = {{"p10", low}, {"median", median}, {"p90", high}};
  out["built_in_band"] = {{"p10", plan::kHeldOutSpeedRatioP10}, {"p90", plan::kHeldOutSpeedRatioP90}};
  out["rows"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < runs.size(); ++i) {
    auto ratio = [](double v) { return v > 0 ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
    out["rows"].push_back({{"name", runs[i].name}, {"group", runs[i].group}, {"fold", fold_of(runs[i])},
                           {"held_out", {{"speed", held_out[i].speed}, {"memory", ratio(held_out[i].memory)}}},
                           {"fitted_on_all", {{"speed", in_sample[i].speed}, {"memory", ratio(in_sample[i].memory)}}},
                           {"profile_constants", {{"speed", defaults[i].speed}, {"memory", ratio(defaults[i].memory)}}}});
  }
  if (request.as_json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << "titan plan --calibrate: " << runs.size() << " runs in " << groups.size() << " groups, " << folds
            << " folds of whole groups\n"
            << "constants fitted on all runs: " << calibration_json(fitted).dump() << "\n";
  std::cout << strprintf("%-48s %5s %18s %18s %18s\n", "run", "fold", "held out", "fitted on all", "profile's");
  auto cell = [](const Ratios& r) {
    return r.memory > 0 ? strprintf("%5.2fx mem %4.2fx", r.speed, r.memory) : strprintf("%5.2fx          ", r.speed);
  };
  for (size_t i = 0; i < runs.size(); ++i)
    std::cout << strprintf("%-48s %5lld %18s %18s %18s\n", runs[i].name.substr(0, 48).c_str(),
                           static_cast<long long>(fold_of(runs[i])), cell(held_out[i]).c_str(), cell(in_sample[i]).c_str(),
                           cell(defaults[i]).c_str());
  std::cout << strprintf("within 15%% on tokens/s (10%% on memory): %lld held out, %lld fitted on all, %lld with the "
                         "profiles' constants, of %zu\n",
                         static_cast<long long>(hits(held_out)), static_cast<long long>(hits(in_sample)),
                         static_cast<long long>(hits(defaults)), runs.size())
            << strprintf("held-out predicted/measured tokens/s: 10th percentile %.2f, median %.2f, 90th %.2f\n", low, median, high);
  return 0;
}

// --evaluate: measured runs predicted with their profiles' constants, nothing fitted: how well the plan does on
// runs no constant was chosen on, and how many fall inside the band every prediction prints.
int run_evaluate(const Request& request) {
  const std::vector<Run> runs = read_runs("--evaluate", request.evaluate);
  std::vector<Ratios> ratios;
  std::vector<double> speed;
  for (const Run& run : runs) {
    ratios.push_back(predict(run, run.cluster.calibration));
    speed.push_back(ratios.back().speed);
  }
  // Inside the printed band: measured within [P / p90, P / p10], that is predicted / measured within [p10, p90].
  auto in_band = [](const Ratios& r) { return r.speed >= plan::kHeldOutSpeedRatioP10 && r.speed <= plan::kHeldOutSpeedRatioP90; };
  const int64_t inside = std::count_if(ratios.begin(), ratios.end(), in_band);
  const double low = quantile(speed, 0.1), median = quantile(speed, 0.5), high = quantile(speed, 0.9);
  if (request.as_json) {
    nlohmann::ordered_json out;
    out["runs"] = runs.size();
    out["hits"] = hits(ratios);
    out["inside_band"] = inside;
    out["speed_ratio"] = {{"p10", low}, {"median", median}, {"p90", high}};
    out["built_in_band"] = {{"p10", plan::kHeldOutSpeedRatioP10}, {"p90", plan::kHeldOutSpeedRatioP90}};
    out["rows"] = nlohmann::ordered_json::array();
    for (size_t i = 0; i < runs.size(); ++i)
      out["rows"].push_back({{"name", runs[i].name}, {"group", runs[i].group}, {"speed", ratios[i].speed},
                             {"memory", ratios[i].memory > 0 ? nlohmann::ordered_json(ratios[i].memory) : nlohmann::ordered_json(nullptr)},
                             {"hit", hit(ratios[i])}, {"inside_band", in_band(ratios[i])}});
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << "titan plan --evaluate: " << runs.size() << " runs predicted with their profiles' constants (nothing fitted)\n"
            << strprintf("%-56s %22s\n", "run", "predicted / measured");
  for (size_t i = 0; i < runs.size(); ++i)
    std::cout << strprintf("%-56s %6.2fx", runs[i].name.substr(0, 56).c_str(), ratios[i].speed)
              << (ratios[i].memory > 0 ? strprintf(" mem %4.2fx", ratios[i].memory) : std::string(10, ' '))
              << (hit(ratios[i]) ? "  within" : "") << "\n";
  std::cout << strprintf("within 15%% on tokens/s (10%% on memory): %lld of %zu; inside the printed band (%.2f to %.2f): %lld\n",
                         static_cast<long long>(hits(ratios)), runs.size(), plan::kHeldOutSpeedRatioP10,
                         plan::kHeldOutSpeedRatioP90, static_cast<long long>(inside))
            << strprintf("predicted/measured tokens/s: 10th percentile %.2f, median %.2f, 90th %.2f\n", low, median, high);
  return 0;
}

}  // namespace

int run_plan(const std::vector<std::string>& raw_args) {
  const Request request = parse_request(raw_args);
  const auto& [as_json, search, cluster_spec, calibrate, evaluate, gpus, top, folds, execution, args] = request;
  if (!calibrate.empty() && !evaluate.empty()) fail("titan plan: --calibrate and --evaluate are two commands; give one");
  if (!calibrate.empty()) return run_calibrate(request);
  if (!evaluate.empty()) return run_evaluate(request);
  auto loaded = config::load_job_config(args);
  if (loaded.help_requested) {
    std::cout << strprintf(kPlanUsage, known_profiles().c_str());
    return 0;
  }
  if (cluster_spec.empty())
    fail("titan plan needs --cluster: a built-in profile (", known_profiles(), ") or a TOML file (docs/plan.md)");
  const auto cluster = plan::load_cluster_profile(cluster_spec);
  const auto& c = loaded.config;
  const JobChoice choice = choose_job_model(loaded);
  const protocols::ModelSpec& spec = *choice.spec;
  const protocols::JobModel& job = choice.model;
  models::take_flavor_mask(loaded, *job.args);  // the flavor's attention mask unless the job sets one
  const auto& model = *job.args;
  const std::string header = cat("titan plan: ", spec.name, " ", job.name, ", seq_len ", c.training.seq_len, ", on ",
                                 cluster.name, " (", cluster.description, ")");
  if (search) {
    const auto result = plan::search_layouts(spec, model, c, cluster, {gpus, top, execution});
    if (as_json) {
      nlohmann::ordered_json out = {{"cluster", cluster.name}, {"gpus", gpus}, {"tried", result.tried}, {"fitting", result.fitting}};
      out["best"] = nlohmann::ordered_json::array();
      for (const auto& p : result.best) out["best"].push_back(to_json(p, cluster));
      std::cout << out.dump(2) << "\n";
      return result.best.empty() ? 1 : 0;
    }
    std::cout << header << "\n"
              << gpus << " GPUs, global batch " << c.training.global_batch_size << ": " << result.tried << " layouts tried, "
              << result.fitting << " fit\n";
    if (result.best.empty()) {
      std::cout << "no layout fits: shorten training.seq_len, lower the global batch or add GPUs\n";
      return 1;
    }
    int rank = 0;
    for (const auto& p : result.best)
      std::cout << strprintf("%2d. %8.0f tokens/s per device (%.0f-%.0f), MFU %4.1f%%, %6.2f GiB, bound by %-16s %s\n", ++rank,
                             p.time.tokens_per_second_per_device, p.time.tokens_per_second_low, p.time.tokens_per_second_high,
                             p.time.mfu * 100, gib(p.device_bytes), p.time.bound.c_str(), p.layout.c_str());
    return 0;
  }
  const auto p = plan_layout(loaded, cluster, gpus, execution, true);
  if (as_json) {
    auto out = to_json(p, cluster);
    out["cluster"] = cluster.name;
    out["flavor"] = c.model.flavor;
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << header << "\n";
  print_plan(p, cluster);
  return 0;
}

}  // namespace titan::cli
