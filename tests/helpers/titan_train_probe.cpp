// Test helper: builds titan's real Trainer from `titan train` arguments and runs its steps, recording what a
// reference implementation needs to replay them: initial weights (HF layout), every micro-batch, and per-step
// loss, grad norm and learning rate.
// usage: titan_train_probe --probe.out DIR [--probe.validate] [--probe.loaded_state] [titan train options...]
// --probe.validate runs the trainer's validation after the last step and records its loss.
// --probe.loaded_state writes loaded_state.safetensors: the full weights, AdamW moments and MoE biases right after start-up
// (a checkpoint load), under the checkpoint's keys, gathered from whatever layout this run uses.
// Steps continue from a loaded checkpoint's step.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/common/process_exit.h"
#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/components/metrics/memory.h"
#include "titan/config/loader.h"
#include "titan/distributed/mpi_runtime.h"
#include "titan/models/common/decoder_hf.h"
#include "titan/trainer/trainer.h"

namespace {

// Full weights in HF layout (collective: every rank must call it).
std::vector<std::pair<std::string, at::Tensor>> hf_weights(titan::Trainer& trainer) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& args = titan::models::as_decoder(trainer.model_args(), "the probe");
  for (auto& [name, full] : titan::distributed::gather_full(trainer.parameters(), *trainer.mesh().world())) {
    if (const int64_t experts = titan::models::hf_slices(name, args)) {  // one HF tensor per expert
      for (int64_t j = 0; j < experts; ++j) out.emplace_back(titan::models::hf_slice_name(name, j), full[j].cpu().contiguous());
      continue;
    }
    out.emplace_back(*titan::models::to_hf_name(name, args), titan::models::to_hf_tensor(name, full.cpu(), args));
  }
  return out;
}

}  // namespace

static int run_probe(int argc, char** argv) {
  std::vector<std::string> args;
  std::string out_dir;
  bool validate = false, loaded_state = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--probe.out" && i + 1 < argc) out_dir = argv[++i];
    else if (a == "--probe.validate") validate = true;
    else if (a == "--probe.loaded_state") loaded_state = true;
    else args.push_back(a);
  }
  try {
    if (out_dir.empty()) titan::fail("--probe.out DIR is required");
    std::filesystem::create_directories(out_dir);
    titan::Trainer trainer(titan::config::load_job_config(args));
    const bool writer = trainer.mesh().world()->rank() == 0;
    const bool single = trainer.mesh().world()->size() == 1;
    if (loaded_state) {
      // Optimizer moments gathered like the weights: the same placements, the moments as local tensors.
      std::vector<titan::distributed::ShardedParameter> moments;
      const auto& state = trainer.optimizer().state();
      for (size_t i = 0; i < trainer.parameters().size() && i < state.size(); ++i) {
        auto p = trainer.parameters()[i];
        if (!state[i].exp_avg.defined()) continue;
        p.name = "optimizer.exp_avg." + p.name;
        p.local = state[i].exp_avg;
        moments.push_back(p);
        p.name.replace(0, 18, "optimizer.exp_avg_sq.");
        p.local = state[i].exp_avg_sq;
        moments.push_back(p);
      }
      std::vector<std::pair<std::string, at::Tensor>> out;
      for (auto& [name, t] : titan::distributed::gather_full(trainer.parameters(), *trainer.mesh().world())) out.emplace_back("model." + name, t);
      for (auto& item : titan::distributed::gather_full(moments, *trainer.mesh().world())) out.push_back(item);
      for (auto& [name, t] : titan::distributed::gather_full(trainer.buffers(), *trainer.mesh().world())) out.emplace_back("model." + name, t);
      if (writer) titan::safetensors::save(out_dir + "/loaded_state.safetensors", out);
    }
    auto initial = hf_weights(trainer);
    if (writer) titan::safetensors::save(out_dir + "/initial.safetensors", initial);
    std::vector<std::pair<std::string, at::Tensor>> batches;
    const int64_t rss_before_steps = titan::metrics::current_rss_bytes();  // parameters, process baseline
    nlohmann::json steps = nlohmann::json::array();
    for (int64_t step = trainer.step() + 1; step <= trainer.config().training.steps; ++step) {
      auto microbatches = trainer.next_microbatches();
      for (size_t m = 0; m < microbatches.size(); ++m) {
        std::string p = "step" + std::to_string(step) + ".mb" + std::to_string(m) + ".";
        batches.emplace_back(p + "inputs", microbatches[m].inputs);
        batches.emplace_back(p + "labels", microbatches[m].labels);
      }
      auto data_parallel_bytes = [&trainer] {
        int64_t bytes = 0;
        for (auto& part : trainer.model_parts()) bytes += part.data_parallel->bytes_communicated();
        return bytes;
      };
      auto tensor_parallel_bytes = [&trainer] {
        return trainer.mesh().dims().tp > 1 ? trainer.mesh().get("tp")->bytes_communicated() : int64_t{0};
      };
      const int64_t bytes_before = data_parallel_bytes(), tp_bytes_before = tensor_parallel_bytes();
      auto r = trainer.train_step(microbatches);
      steps.push_back({{"step", step}, {"loss", r.loss}, {"grad_norm", r.grad_norm}, {"lr", r.lr}, {"tokens", r.tokens},
                       {"data_parallel_bytes", data_parallel_bytes() - bytes_before},
                       {"tensor_parallel_bytes", tensor_parallel_bytes() - tp_bytes_before}});
    }
    if (writer && single) titan::safetensors::save(out_dir + "/batches.safetensors", batches);  // local batches only
    auto final_weights = hf_weights(trainer);
    if (writer) titan::safetensors::save(out_dir + "/final.safetensors", final_weights);
    int64_t local_elements = 0, state_elements = 0;
    for (const auto& p : trainer.optimizer().parameters()) local_elements += p.numel();
    for (const auto& s : trainer.optimizer().state()) state_elements += s.exp_avg.numel() + s.exp_avg_sq.numel();
    nlohmann::json meta = {{"steps", steps},
                           {"world_size", trainer.mesh().world()->size()},
                           {"local_parameter_elements", local_elements},
                           {"optimizer_state_elements", state_elements},
                           {"microbatches", trainer.gradient_accumulation_steps()},
                           {"bos_id", trainer.tokenizer().bos_id().value_or(-1)},
                           {"eos_id", trainer.tokenizer().eos_id().value_or(-1)}};
    nlohmann::json layouts = nlohmann::json::object();
    for (const auto& p : trainer.parameters())
      layouts[p.name] = {{"placement", p.layout.str()}, {"box", p.layout.local_box().str()}, {"local_shape", p.local.sizes().vec()}};
    meta["layouts"] = layouts;  // this rank's (the writer's: rank 0)
    if (auto* pipeline = trainer.pipeline()) {
      const auto& r = pipeline->runner();
      meta["pipeline"] = {{"schedule", r.schedule().name()},
                          {"stages", r.schedule().stages()},
                          {"microbatches", r.schedule().microbatches()},
                          {"max_in_flight", r.max_in_flight()},
                          {"schedule_max_in_flight", r.schedule().max_in_flight(0)},
                          {"measured_bubble", r.bubble()},
                          {"simulated_bubble", r.schedule().simulate().bubble},
                          {"bytes_sent", r.bytes_sent()},
                          {"csv", r.schedule().to_csv()}};
    }
    meta["peak_rss_bytes"] = titan::metrics::peak_rss_bytes();
    meta["rss_before_steps_bytes"] = rss_before_steps;
    if (validate) meta["validation_loss"] = trainer.validate();
    if (writer) std::ofstream(out_dir + "/metrics.json") << meta.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "titan_train_probe: " << e.what() << "\n";
    return 1;
  }
  titan::distributed::shutdown();
  return 0;
}

// Ends without LibTorch's static destructors, as titan does (common/process_exit.h).
int main(int argc, char** argv) { titan::exit_skipping_static_destructors(run_probe(argc, argv)); }
