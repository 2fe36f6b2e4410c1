// Test helper: one float8 or MXFP8 linear (nn/float8.h), forward and backward, on given tensors.
// usage: titan_float8_probe --in IN.safetensors --recipe RECIPE --out OUT.safetensors
// RECIPE: tensorwise|rowwise|rowwise_with_gw_hp (float8, emulated) or mxfp8_cublas|mxfp8_cublas_rceil (MXFP8, emulated).
// IN holds x [..., K], weight [N, K] and grad [..., N] (any float dtypes); OUT gets y, grad_x and grad_weight.
// With "counts" (int64 [experts]) in IN, weight is [experts, N, K] and the grouped matmul runs on x's rows sorted by
// expert: MXFP8 for an mxfp8 recipe, float8 rowwise for RECIPE float8_rowwise.
#include <iostream>
#include <map>

#include "titan/common/process_exit.h"
#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/nn/float8.h"

static int run_probe(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 1; i + 1 < argc; i += 2) opt[argv[i]] = argv[i + 1];
  try {
    titan::safetensors::File in(opt.at("--in"));
    at::Tensor x = in.load("x").requires_grad_(), weight = in.load("weight").requires_grad_();
    const std::string name = opt.at("--recipe");
    using titan::nn::float8::GroupedCast;
    const auto grouped = name == "float8_rowwise" ? GroupedCast::float8_rowwise
                         : titan::nn::float8::mx_recipe(name.rfind("mxfp8", 0) == 0 ? name : "mxfp8_cublas_rceil") ==
                                 titan::nn::float8::MxScaleRounding::rceil
                             ? GroupedCast::mx_rceil
                             : GroupedCast::mx_floor;
    at::Tensor y = in.contains("counts")            ? titan::nn::float8::grouped_linear(x, weight, in.load("counts"), grouped)
                   : name.rfind("mxfp8", 0) == 0 ? titan::nn::float8::mx_linear(x, weight, titan::nn::float8::mx_recipe(name))
                                                 : titan::nn::float8::linear(x, weight, titan::nn::float8::recipe(name), /*emulate=*/true);
    y.backward(in.load("grad"));
    titan::safetensors::save(opt.at("--out"), {{"y", y.detach()}, {"grad_x", x.grad()}, {"grad_weight", weight.grad()}});
  } catch (const std::exception& e) {
    std::cerr << "titan_float8_probe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

// Ends without LibTorch's static destructors, as titan does (common/process_exit.h).
int main(int argc, char** argv) { titan::exit_skipping_static_destructors(run_probe(argc, argv)); }
