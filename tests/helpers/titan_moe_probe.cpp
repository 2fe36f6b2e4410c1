// Test helper: titan's Mixture-of-Experts layer alone (models/common/moe.h) with any MoEArgs, on given weights (the
// layer's own parameter names, which are torchtitan's MoE module's) and input: forward, then backward of
// sum(output * grad_output); writes the output, the input's gradient and every parameter's gradient.
// usage: titan_moe_probe --args A.json --weights W.safetensors --input X.safetensors --out O.safetensors
// A.json: {"dim", "hidden_dim", "num_experts", "num_shared_experts", "top_k", "score_func", "route_norm",
//          "route_scale", "score_before_experts", "num_expert_groups" (or null), "num_limited_groups" (or null),
//          optionally "load_balance_coeff" (default: none, no balancing) and "mx": true or "float8": true (the
//          experts and the shared experts converted as quantize.grouped_mm.mx / .float8 with fqns = ["experts"] do)}
// X.safetensors: "x" [batch, seq, dim] and "grad_output" of the same shape, float32; with balancing it may hold
// "x.1", "grad_output.1", ...: further passes, each after the balancing update of the one before (their outputs and
// gradients are written; "expert_bias.i" is the bias after pass i's update, "tokens_per_expert.i" its counts).
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "titan/common/process_exit.h"
#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/components/quantization/float8.h"
#include "titan/models/common/moe.h"

static int run_probe(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 1; i + 1 < argc; i += 2) opt[argv[i]] = argv[i + 1];
  try {
    std::ifstream in(opt.at("--args"));
    const nlohmann::json j = nlohmann::json::parse(in);
    titan::models::MoEArgs args;
    args.hidden_dim = j.at("hidden_dim").get<int64_t>();
    args.num_experts = j.at("num_experts").get<int64_t>();
    args.num_shared_experts = j.at("num_shared_experts").get<int64_t>();
    args.top_k = j.at("top_k").get<int64_t>();
    args.score_func = j.at("score_func").get<std::string>();
    args.route_norm = j.at("route_norm").get<bool>();
    args.route_scale = j.at("route_scale").get<double>();
    args.score_before_experts = j.at("score_before_experts").get<bool>();
    if (!j.at("num_expert_groups").is_null()) args.num_expert_groups = j.at("num_expert_groups").get<int64_t>();
    if (!j.at("num_limited_groups").is_null()) args.num_limited_groups = j.at("num_limited_groups").get<int64_t>();
    args.load_balance_coeff = j.contains("load_balance_coeff") ? std::optional<double>(j.at("load_balance_coeff").get<double>()) : std::nullopt;
    args.check();
    titan::models::MoE moe(j.at("dim").get<int64_t>(), args, {});
    if (j.value("mx", false) || j.value("float8", false)) {
      titan::config::JobConfig config;
      const bool mx = j.value("mx", false);
      config.model.converters = {mx ? "quantize.grouped_mm.mx" : "quantize.grouped_mm.float8"};
      (mx ? config.quantize.grouped_mm.mx.fqns : config.quantize.grouped_mm.float8.fqns) = {"experts"};
      config.training.seq_len = 32;
      titan::quantization::convert_grouped(moe, config);
    }
    titan::safetensors::File weights(opt.at("--weights"));
    {
      at::NoGradGuard no_grad;
      for (auto& item : moe.named_parameters()) item.value().copy_(weights.load(item.key()));
    }
    titan::safetensors::File input(opt.at("--input"));
    std::vector<std::pair<std::string, at::Tensor>> result;
    for (int pass = 0;; ++pass) {
      const std::string suffix = pass == 0 ? "" : "." + std::to_string(pass);
      if (pass > 0 && !input.contains("x" + suffix)) break;
      for (auto& item : moe.named_parameters()) item.value().mutable_grad() = at::Tensor();
      const at::Tensor x = input.load("x" + suffix).requires_grad_(true);
      const at::Tensor out = moe(x, titan::nn::Context{});
      out.backward(input.load("grad_output" + suffix));
      result.emplace_back("output" + suffix, out.detach());
      result.emplace_back("grad.x" + suffix, x.grad());
      for (auto& item : moe.named_parameters()) result.emplace_back("grad." + item.key() + suffix, item.value().grad());
      if (!moe.expert_bias.defined()) break;
      result.emplace_back("tokens_per_expert." + std::to_string(pass), moe.tokens_per_expert.clone());
      titan::models::update_expert_biases({&moe}, {0}, 1, nullptr);
      result.emplace_back("expert_bias." + std::to_string(pass), moe.expert_bias.clone());
    }
    titan::safetensors::save(opt.at("--out"), result);
  } catch (const std::exception& e) {
    std::cerr << "titan_moe_probe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

// Ends without LibTorch's static destructors, as titan does (common/process_exit.h).
int main(int argc, char** argv) { titan::exit_skipping_static_destructors(run_probe(argc, argv)); }
