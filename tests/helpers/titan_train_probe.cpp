// Test helper: builds titan's real Trainer from `titan train` arguments and runs its steps, recording what a
// reference implementation needs to replay them: initial weights (HF layout), every micro-batch, and per-step
// loss, grad norm and learning rate.
// usage: titan_train_probe --probe.out DIR [--probe.validate] [titan train options...]
// --probe.validate runs the trainer's validation after the last step and records its loss.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/config/loader.h"
#include "titan/distributed/mpi_runtime.h"
#include "titan/models/llama3/state_dict_adapter.h"
#include "titan/trainer/trainer.h"

namespace {

// Full weights in HF layout (collective under FSDP: every rank must call it).
std::vector<std::pair<std::string, at::Tensor>> hf_weights(titan::Trainer& trainer) {
  trainer.data_parallel().unshard_all();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& item : trainer.model().named_parameters())
    out.emplace_back(*titan::llama3::to_hf_name(item.key()),
                     titan::llama3::to_hf_tensor(item.key(), item.value().detach().to(at::kFloat).clone(), trainer.model().args()));
  trainer.data_parallel().reshard_all();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args;
  std::string out_dir;
  bool validate = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--probe.out" && i + 1 < argc) out_dir = argv[++i];
    else if (a == "--probe.validate") validate = true;
    else args.push_back(a);
  }
  try {
    if (out_dir.empty()) titan::fail("--probe.out DIR is required");
    std::filesystem::create_directories(out_dir);
    titan::Trainer trainer(titan::config::load_job_config(args));
    const bool writer = trainer.mesh().world()->rank() == 0;
    const bool single = trainer.mesh().world()->size() == 1;
    auto initial = hf_weights(trainer);
    if (writer) titan::safetensors::save(out_dir + "/initial.safetensors", initial);
    std::vector<std::pair<std::string, at::Tensor>> batches;
    nlohmann::json steps = nlohmann::json::array();
    for (int64_t step = 1; step <= trainer.config().training.steps; ++step) {
      auto microbatches = trainer.next_microbatches();
      for (size_t m = 0; m < microbatches.size(); ++m) {
        std::string p = "step" + std::to_string(step) + ".mb" + std::to_string(m) + ".";
        batches.emplace_back(p + "inputs", microbatches[m].inputs);
        batches.emplace_back(p + "labels", microbatches[m].labels);
      }
      auto r = trainer.train_step(microbatches);
      steps.push_back({{"step", step}, {"loss", r.loss}, {"grad_norm", r.grad_norm}, {"lr", r.lr}, {"tokens", r.tokens}});
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
    if (validate) meta["validation_loss"] = trainer.validate();
    if (writer) std::ofstream(out_dir + "/metrics.json") << meta.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "titan_train_probe: " << e.what() << "\n";
    return 1;
  }
  titan::distributed::shutdown();
  return 0;
}
