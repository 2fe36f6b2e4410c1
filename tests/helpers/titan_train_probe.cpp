// Test helper: builds titan's real Trainer from `titan train` arguments and runs its steps, recording what a
// reference implementation needs to replay them: initial weights (HF layout), every micro-batch, and per-step
// loss, grad norm and learning rate.
// usage: titan_train_probe --probe.out DIR [titan train options...]
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "titan/common/error.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/config/loader.h"
#include "titan/models/llama3/state_dict_adapter.h"
#include "titan/trainer/trainer.h"

namespace {

std::vector<std::pair<std::string, at::Tensor>> hf_weights(titan::Trainer& trainer) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& item : trainer.model().named_parameters())
    out.emplace_back(*titan::llama3::to_hf_name(item.key()),
                     titan::llama3::to_hf_tensor(item.key(), item.value().detach().to(at::kFloat), trainer.model().args()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args;
  std::string out_dir;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--probe.out" && i + 1 < argc) out_dir = argv[++i];
    else args.push_back(a);
  }
  try {
    if (out_dir.empty()) titan::fail("--probe.out DIR is required");
    std::filesystem::create_directories(out_dir);
    titan::Trainer trainer(titan::config::load_job_config(args));
    titan::safetensors::save(out_dir + "/initial.safetensors", hf_weights(trainer));
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
    titan::safetensors::save(out_dir + "/batches.safetensors", batches);
    titan::safetensors::save(out_dir + "/final.safetensors", hf_weights(trainer));
    nlohmann::json meta = {{"steps", steps},
                           {"microbatches", trainer.gradient_accumulation_steps()},
                           {"bos_id", trainer.tokenizer().bos_id().value_or(-1)},
                           {"eos_id", trainer.tokenizer().eos_id().value_or(-1)}};
    std::ofstream(out_dir + "/metrics.json") << meta.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "titan_train_probe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
