// Test helper: runs titan's real training dataloader for this process's data-parallel rank (rank and world size
// from mpirun / srun / torchrun variables; every rank is a data-parallel rank) and records what it served.
// usage: titan_data_probe --probe.out DIR --probe.batches N [--probe.resume DIR] [--probe.mixture DOCS]
//                         [titan train options...]
// Writes DIR/rank<R>.json ({"batches": [[window tokens...] per row] per batch, "wait_seconds"}) and
// DIR/state<R>.json (the state after the last batch). --probe.resume loads every state*.json of DIR first.
// --probe.mixture counts the sources of the first DOCS documents of the stream instead (DIR/mixture.json).
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/process_exit.h"
#include "titan/components/data/dataloader.h"
#include "titan/config/loader.h"
#include "titan/distributed/communicator.h"

static int run_probe(int argc, char** argv) {
  std::vector<std::string> args;
  std::string out_dir, resume_dir;
  int64_t batches = 0, mixture = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--probe.out" && i + 1 < argc) out_dir = argv[++i];
    else if (a == "--probe.batches" && i + 1 < argc) batches = std::stoll(argv[++i]);
    else if (a == "--probe.resume" && i + 1 < argc) resume_dir = argv[++i];
    else if (a == "--probe.mixture" && i + 1 < argc) mixture = std::stoll(argv[++i]);
    else args.push_back(a);
  }
  try {
    if (out_dir.empty()) titan::fail("--probe.out DIR is required");
    std::filesystem::create_directories(out_dir);
    auto loaded = titan::config::load_job_config(args);
    const auto& c = loaded.config;
    auto sources = titan::data::resolve_sources(c.training);
    if (mixture > 0) {
      titan::data::StreamOptions so = titan::data::training_loader_options(c, 0, 1).stream;
      titan::data::DocumentStream stream(sources, so);
      std::vector<int64_t> counts(sources.size());
      for (int64_t i = 0; i < mixture && stream.skip(); ++i) {
      }
      nlohmann::json j;
      for (size_t s = 0; s < sources.size(); ++s) {
        j["rows"].push_back(stream.state().sources[s].rows_served);
        j["epochs"].push_back(stream.state().sources[s].epoch);
        j["names"].push_back(sources[s].name);
      }
      std::ofstream(out_dir + "/mixture.json") << j.dump();
      return 0;
    }
    auto launch = titan::distributed::detect_launch();
    auto tokenizer = titan::tokenizer::load(c.model.hf_assets_path);
    auto options = titan::data::training_loader_options(c, launch.rank, launch.world_size);
    titan::data::DataLoader loader(std::move(sources), tokenizer.get(), options);
    if (!resume_dir.empty()) {
      std::vector<std::string> states;
      for (const auto& e : std::filesystem::directory_iterator(resume_dir)) {
        const std::string name = e.path().filename().string();
        if (name.starts_with("state") && name.ends_with(".json")) {
          std::ifstream in(e.path());
          states.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        }
      }
      loader.load_state_dict(states);
    }
    nlohmann::json served = nlohmann::json::array();
    for (int64_t b = 0; b < batches; ++b) {
      auto batch = loader.next();
      nlohmann::json rows = nlohmann::json::array();
      for (int64_t r = 0; r < batch.inputs.size(0); ++r) {
        at::Tensor window = at::cat({batch.inputs[r], batch.labels[r].narrow(0, batch.labels.size(1) - 1, 1)});
        rows.push_back(std::vector<int64_t>(window.data_ptr<int64_t>(), window.data_ptr<int64_t>() + window.numel()));
      }
      served.push_back(rows);
    }
    const std::string rank = std::to_string(launch.rank);
    std::ofstream(out_dir + "/rank" + rank + ".json")
        << nlohmann::json{{"batches", served}, {"lanes", loader.lanes()}, {"wait_seconds", loader.wait_seconds()}}.dump();
    std::ofstream(out_dir + "/state" + rank + ".json") << loader.state_dict();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}

// Ends without LibTorch's static destructors, as titan does (common/process_exit.h).
int main(int argc, char** argv) { titan::exit_skipping_static_destructors(run_probe(argc, argv)); }
