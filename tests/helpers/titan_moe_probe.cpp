// Test helper: titan's Mixture-of-Experts layer alone (models/common/moe.h) with any MoEArgs, on given weights (the
// layer's own parameter names, which are torchtitan's MoE module's) and input: forward, then backward of
// sum(output * grad_output); writes the output, the input's gradient and every parameter's gradient.
// usage: titan_moe_probe --args A.json --weights W.safetensors --input X.safetensors --out O.safetensors
// A.json: {"dim", "hidden_dim", "num_experts", "num_shared_experts", "top_k", "score_func", "route_norm",
//          "route_scale", "score_before_experts", "num_expert_groups" (or null), "num_limited_groups" (or null)}
// X.safetensors: "x" [batch, seq, dim] and "grad_output" of the same shape, float32.
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/models/common/moe.h"

int main(int argc, char** argv) {
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
    args.check();
    titan::models::MoE moe(j.at("dim").get<int64_t>(), args, {});
    titan::safetensors::File weights(opt.at("--weights"));
    {
      at::NoGradGuard no_grad;
      for (auto& item : moe.named_parameters()) item.value().copy_(weights.load(item.key()));
    }
    titan::safetensors::File input(opt.at("--input"));
    const at::Tensor x = input.load("x").requires_grad_(true);
    const at::Tensor out = moe(x, titan::nn::Context{});
    out.backward(input.load("grad_output"));
    std::vector<std::pair<std::string, at::Tensor>> result = {{"output", out.detach()}, {"grad.x", x.grad()}};
    for (auto& item : moe.named_parameters()) result.emplace_back("grad." + item.key(), item.value().grad());
    titan::safetensors::save(opt.at("--out"), result);
  } catch (const std::exception& e) {
    std::cerr << "titan_moe_probe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
