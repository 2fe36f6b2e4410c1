// Test helper: loads Hugging Face-layout weights into a registered family's model (through its spec and state-dict
// adapter), runs forward + loss + backward on given tokens (optionally with activation checkpointing) and writes
// logits, loss and gradients in HF layout.
// usage: titan_model_probe [--model llama3|qwen3] --flavor F|--hf-config DIR/config.json --weights W.safetensors
//                          --batch B.safetensors --out O.safetensors [--ac-mode none|full|selective] [--ac-option N|op]
//                          [--autocast-bf16] [--float8 tensorwise|rowwise|rowwise_with_gw_hp] [--mx RECIPE] [--kept-shapes K.json]
//                          [--memory-json M.json]
//        titan_model_probe --args-json A.json --titan-weights W.safetensors --batch B.safetensors --out O.safetensors
// With --hf-config the family is config.json's model_type. With --args-json (ModelArgs::to_json, as checkpoint
// metadata holds it: every MoE option) the weights and the gradients written carry titan's (= torchtitan's) names,
// and buffers found in the weights file (the MoE balancing biases) are loaded too. --kept-shapes writes, for each
// block's forward under op-level selective checkpointing, the shapes of the tensors it kept (a JSON list of lists).
// --memory-json writes the tensor bytes the forward and loss leave allocated ("after_forward") and the peak through
// forward and backward ("peak"), both above what was allocated before the forward (bench/bench_activation_memory.py).
#include <ATen/autocast_mode.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "titan/common/process_exit.h"
#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/components/metrics/allocation_tracker.h"
#include "titan/components/quantization/float8.h"
#include "titan/nn/loss.h"
#include "titan/config/job_config.h"
#include "titan/models/common/decoder.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/registry.h"
#include "titan/nn/kept_ops.h"

static int run_probe(int argc, char** argv) {
  std::map<std::string, std::string> opt = {{"--ac-mode", "none"}, {"--ac-option", "1"}};
  bool autocast = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--autocast-bf16") autocast = true;
    else if (i + 1 < argc) opt[a] = argv[++i];
  }
  try {
    const bool track_memory = opt.count("--memory-json") > 0;
    if (track_memory) titan::metrics::install_cpu_allocation_tracker();
    // The shape: a flavor, or a Hugging Face config.json (--hf-config).
    const bool from_hf = opt.count("--hf-config") > 0, titan_layout = opt.count("--args-json") > 0;
    nlohmann::json args_json;
    if (titan_layout) args_json = nlohmann::json::parse(std::ifstream(opt.at("--args-json")));
    const auto& spec = from_hf ? titan::models::spec_for_hf_directory(std::filesystem::path(opt.at("--hf-config")).parent_path().string())
                       : titan_layout ? titan::models::model_spec(args_json.at("family").get<std::string>())
                                      : titan::models::model_spec(opt.count("--model") ? opt.at("--model") : "llama3");
    auto configured = from_hf        ? spec.read_hf_config(opt.at("--hf-config"))
                      : titan_layout ? spec.args_from_json(args_json, opt.at("--args-json"))
                                     : spec.flavor(opt.at("--flavor"));
    titan::safetensors::File batch(opt.at("--batch"));
    at::Tensor inputs = batch.load("inputs"), labels = batch.load("labels");
    // The batch's length, or the configured one where longer (YaRN depends on it: DeepSeek-V3).
    const auto args = configured->with_context_length(std::max<int64_t>(inputs.size(1), configured->context_length()));
    auto built = spec.build(*args, {});
    auto model = std::dynamic_pointer_cast<titan::models::Decoder>(built);
    const auto adapter = spec.state_dict_adapter(*args);
    titan::safetensors::File weights(opt.at(titan_layout ? "--titan-weights" : "--weights"));
    if (titan_layout) {
      at::NoGradGuard no_grad;
      for (auto& item : model->named_parameters()) item.value().copy_(weights.load(item.key()));
      for (auto& item : model->named_buffers())
        if (weights.contains(item.key())) item.value().copy_(weights.load(item.key()));
    } else {
      at::NoGradGuard no_grad;
      for (auto& item : model->named_parameters()) {
        if (const int64_t slices = adapter->hf_slices(item.key())) {  // one HF tensor per expert
          for (int64_t j = 0; j < slices; ++j) item.value()[j].copy_(weights.load(adapter->hf_slice_name(item.key(), j)));
          continue;
        }
        auto hf = adapter->to_hf_name(item.key());
        item.value().copy_(adapter->from_hf_tensor(item.key(), weights.load(*hf)));
      }
      for (auto& item : model->named_buffers())  // DeepSeek-V3's balancing biases (e_score_correction_bias)
        if (auto hf = adapter->to_hf_name(item.key()); hf && weights.contains(*hf)) item.value().copy_(weights.load(*hf));
    }
    if (opt.count("--float8")) {  // float8 linears (emulated), the output projection kept in high precision
      titan::config::JobConfig job;
      job.model.converters = {"float8"};
      job.quantize.linear.float8.recipe_name = opt.at("--float8");
      job.quantize.linear.float8.emulate = true;
      job.quantize.linear.float8.filter_fqns = {"output"};
      titan::quantization::convert_to_float8(*model, job);
    }
    if (opt.count("--mx")) {  // MXFP8 linears (emulated), the output projection kept in high precision
      titan::config::JobConfig job;
      job.model.converters = {"mx"};
      job.quantize.linear.mx.recipe_name = opt.at("--mx");
      job.quantize.linear.mx.emulate = true;
      job.quantize.linear.mx.filter_fqns = {"output"};
      titan::quantization::convert_to_mx(*model, job);
    }
    titan::config::ActivationCheckpoint ac;
    ac.mode = opt["--ac-mode"];
    ac.selective_ac_option = opt["--ac-option"];
    titan::models::apply_activation_checkpointing(*model, titan::distributed::ModuleRange::whole(*model), ac);
    nlohmann::json kept = nlohmann::json::array();
    titan::nn::KeptOps::set_observer([&kept](const std::vector<at::Tensor>& tensors) {
      nlohmann::json block = nlohmann::json::array();
      for (const auto& t : tensors) block.push_back(t.sizes().vec());
      kept.push_back(block);
    });

    at::Tensor logits, loss;
    titan::metrics::reset_cpu_peak_bytes();
    const int64_t before_forward = titan::metrics::cpu_bytes_in_use();
    if (autocast) {
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCPU, true);
    }
    logits = model->forward(inputs);
    const double valid = static_cast<double>(titan::count_valid_tokens(labels));
    loss = titan::cross_entropy_sum(logits, labels) / valid;
    if (autocast) {
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    const int64_t after_forward = titan::metrics::cpu_bytes_in_use() - before_forward;
    loss.backward();
    if (track_memory)
      std::ofstream(opt.at("--memory-json")) << nlohmann::json{{"after_forward", after_forward},
                                                               {"peak", titan::metrics::cpu_peak_bytes() - before_forward}}.dump();

    std::vector<std::pair<std::string, at::Tensor>> out = {{"logits", logits.detach().to(at::kFloat)},
                                                           {"loss", loss.detach().reshape({1})}};
    for (auto& item : model->named_parameters()) {
      if (titan_layout) {
        out.emplace_back("grad." + item.key(), item.value().grad().contiguous());
        continue;
      }
      if (const int64_t slices = adapter->hf_slices(item.key())) {
        for (int64_t j = 0; j < slices; ++j)
          out.emplace_back("grad." + adapter->hf_slice_name(item.key(), j), item.value().grad()[j].contiguous());
        continue;
      }
      out.emplace_back("grad." + *adapter->to_hf_name(item.key()), adapter->to_hf_tensor(item.key(), item.value().grad()));
    }
    titan::safetensors::save(opt.at("--out"), out);
    if (opt.count("--kept-shapes")) std::ofstream(opt.at("--kept-shapes")) << kept.dump();
  } catch (const std::exception& e) {
    std::cerr << "titan_model_probe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

// Ends without LibTorch's static destructors, as titan does (common/process_exit.h).
int main(int argc, char** argv) { titan::exit_skipping_static_destructors(run_probe(argc, argv)); }
