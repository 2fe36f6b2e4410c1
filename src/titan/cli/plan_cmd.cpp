// `titan plan`: predicted memory per rank, step time, tokens/s and MFU of a job's layout on a cluster profile, or
// with --search the fastest layouts that fit a number of GPUs.
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/cli/commands.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/config/loader.h"
#include "titan/distributed/pipeline/stages.h"
#include "titan/models/registry.h"
#include "titan/plan/plan.h"

namespace titan::cli {

namespace {

const char* kPlanUsage =
    "usage: titan plan --cluster C [--gpus N] [--json] [--as titan|torchtitan] [--job.config_file FILE] [--section.key value ...]\n"
    "       titan plan --search --gpus N --cluster C [--top K] [--json] --model.flavor F --training.seq_len S\n"
    "                  --training.global_batch_size B [...]\n"
    "Predicts a layout's memory per rank, step time, tokens/s per device and MFU on a cluster, from shapes alone;\n"
    "--search ranks every layout of N GPUs that fits (--top K of them, default 5). C: a built-in profile (%s) or a\n"
    "TOML file (docs/plan.md). --as torchtitan predicts torchtitan's execution instead of titan's (docs/plan.md).\n";

double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

int64_t parse_count(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == value.size() && v > 0) return v;
  } catch (const std::exception&) {
  }
  fail(flag, " ", quote(value), ": expected a positive integer");
}

nlohmann::ordered_json to_json(const plan::Plan& p, const plan::ClusterProfile& cluster) {
  nlohmann::ordered_json memory = nlohmann::ordered_json::object();
  for (const auto& t : p.memory.terms) memory[t.name] = t.bytes;
  // Terms of the loss and of the blocks' backward are not held at once: allocated_bytes counts the larger group.
  nlohmann::ordered_json apart = {{"loss", nlohmann::ordered_json::array()}, {"blocks_backward", nlohmann::ordered_json::array()}};
  for (const auto& t : p.memory.terms)
    if (t.phase != protocols::Phase::step && t.bytes > 0) apart[t.phase == protocols::Phase::loss ? "loss" : "blocks_backward"].push_back(t.name);
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
          {"mfu", p.time.mfu},
          {"bound", p.time.bound},
          {"not_runnable", p.not_runnable}};
}

void print_plan(const plan::Plan& p, const plan::ClusterProfile& cluster) {
  std::cout << "layout: " << p.layout << " (" << p.dims.world_size << " ranks)\n"
            << "memory per rank" << (p.dims.pp > 1 ? " (the busiest pipeline stage)" : "") << ":\n";
  bool apart = false;
  for (const auto& t : p.memory.terms) {
    if (t.bytes <= 0) continue;
    const char* when = t.phase == protocols::Phase::loss ? " (loss)" : t.phase == protocols::Phase::blocks_backward ? " (backward)" : "";
    apart = apart || *when;
    std::cout << strprintf("  %-18s %9.2f GiB%s\n", t.name.c_str(), gib(t.bytes), when);
  }
  if (apart) std::cout << "  (the loss's and the backward's terms are not held at once: allocated counts the larger)\n";
  std::cout << strprintf("  %-18s %9.2f GiB\n", "allocated", gib(p.memory.total()))
            << strprintf("  %-18s %9.2f GiB (allocator blocks and rounding)\n", "reserved", gib(p.reserved_bytes))
            << strprintf("  %-18s %9.2f GiB of %.2f GiB (%s): %s\n", "with context", gib(p.device_bytes), gib(cluster.memory_bytes),
                         cluster.name.c_str(), p.fits ? "fits" : "DOES NOT FIT");
  for (const auto& r : p.pipeline_ranks)
    std::cout << strprintf("  %-18s %9.2f GiB allocated (pipeline rank %lld)\n", (r.kind + " stage").c_str(), gib(r.memory.total()),
                           static_cast<long long>(r.rank));
  std::cout << strprintf("time per step: %.3f s\n", p.time.step_seconds);
  for (const auto& t : p.time.terms) {
    std::string hidden = t.total > t.seconds * 1.0001 ? strprintf(" (%.3f s in all, the rest hidden)", t.total) : "";
    std::cout << strprintf("  %-22s %9.3f s%s  %s\n", t.name.c_str(), t.seconds, hidden.c_str(), t.detail.c_str());
  }
  std::cout << strprintf("predicted: %.0f tokens/s per device, MFU %.1f%%, bound by %s\n", p.time.tokens_per_second_per_device,
                         p.time.mfu * 100, p.time.bound.c_str());
  if (!p.not_runnable.empty())
    std::cout << "modelled, but titan cannot run it yet: " << join(p.not_runnable, "; ") << "\n";
}

}  // namespace

int run_plan(const std::vector<std::string>& raw_args) {
  bool as_json = false, search = false;
  std::string cluster_spec;
  int64_t gpus = 0, top = 5;
  protocols::Execution execution = protocols::Execution::titan;
  std::vector<std::string> args;
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
    else if (is("--gpus")) gpus = parse_count("--gpus", value("--gpus"));
    else if (is("--top")) top = parse_count("--top", value("--top"));
    else if (is("--as")) {
      const std::string v = value("--as");
      if (v != "titan" && v != "torchtitan") fail("--as ", quote(v), ": expected titan (the default) or torchtitan");
      execution = v == "torchtitan" ? protocols::Execution::torchtitan : protocols::Execution::titan;
    }
    else args.push_back(a);
  }
  auto loaded = config::load_job_config(args);
  if (loaded.help_requested) {
    std::vector<std::string> names;
    for (const auto& p : plan::builtin_cluster_profiles()) names.push_back(p.name);
    std::cout << strprintf(kPlanUsage, join(names, ", ").c_str());
    return 0;
  }
  if (cluster_spec.empty()) {
    std::vector<std::string> names;
    for (const auto& p : plan::builtin_cluster_profiles()) names.push_back(p.name);
    fail("titan plan needs --cluster: a built-in profile (", join(names, ", "), ") or a TOML file (docs/plan.md)");
  }
  const auto cluster = plan::load_cluster_profile(cluster_spec);
  const auto& c = loaded.config;
  const protocols::ModelSpec& spec = models::job_spec(loaded);
  const protocols::JobModel job = spec.job_model(loaded);
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
      std::cout << strprintf("%2d. %8.0f tokens/s per device, MFU %4.1f%%, %6.2f GiB, bound by %-16s %s\n", ++rank,
                             p.time.tokens_per_second_per_device, p.time.mfu * 100, gib(p.device_bytes), p.time.bound.c_str(),
                             p.layout.c_str());
    return 0;
  }
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
  const auto p = plan::make_plan(spec, model, c, dims, cluster, execution);
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
