// Micro-benchmark of titan's fused kernels against the ATen operations they replace, in one process on the same
// threads: time per call (median of repeats), achieved GFLOP/s for attention, and the ratio ATen / fused.
// Never passes or fails on time. With --device cuda: titan's CUDA kernels (SwiGLU, RoPE, the fused loss's row
// passes) at Llama 3 8B's shapes, each call followed by a device synchronisation (scripts/test_gpu.sh runs it).
//
// Float8 linears (nn/float8.h, every recipe) against LibTorch's bf16 linear, forward and backward: on the CPU emulated
// (float8 values, float32 matmuls: expected slower than bf16), on CUDA through at::_scaled_mm where the GPU has it.
//
// MoE grouped matrix products (kernels/grouped_mm.h) against the per-expert loop of ATen products the model runs
// without them and against LibTorch's own at::_grouped_mm, at debugmodel_moe's and 30B-A3B's expert shapes with
// tokens routed at random (uneven groups); bf16 on AMX and, for comparison, off it (bf16 dot products, or float32
// vectors on CPUs without them). The routing is the
// same on every repeat, so oneDNN's cache of per-shape products is warm for the loop (in training it is not:
// docs/moe.md).
//
// usage: titan_bench_kernels [--threads N] [--repeats N] [--isa generic|avx2|avx512|avx512bf16] [--device cpu|cuda]
//                            [--only attention,elementwise,loss,float8,grouped] [--dtype bf16|fp32]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <torch/cuda.h>

#include "titan/distributed/loss_parallel.h"
#include "titan/kernels/cpu_isa.h"
#include "titan/kernels/fused_ops.h"
#include "titan/kernels/grouped_mm.h"
#include "titan/models/llama3/args.h"
#include "titan/models/common/decoder.h"
#include "titan/nn/float8.h"

namespace {

int g_repeats = 5;
at::Device g_device = at::kCPU;

void synchronize() {
  if (g_device.is_cuda()) torch::cuda::synchronize();
}

double median_ms(const std::function<void()>& run) {
  run();  // warm-up
  synchronize();
  std::vector<double> times;
  for (int i = 0; i < g_repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    synchronize();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

void report(const std::string& what, double fused_ms, double aten_ms, double flops) {
  std::printf("%-44s fused %8.2f ms", what.c_str(), fused_ms);
  if (flops > 0) std::printf(" (%6.1f GFLOP/s)", flops / fused_ms / 1e6);
  std::printf("   ATen %8.2f ms", aten_ms);
  if (flops > 0) std::printf(" (%6.1f GFLOP/s)", flops / aten_ms / 1e6);
  std::printf("   ATen/fused %5.2fx\n", aten_ms / fused_ms);
}

void attention(at::ScalarType dtype, int64_t b, int64_t h, int64_t hk, int64_t s, int64_t d) {
  auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor q = at::randn({b, s, h, d}, opts).transpose(1, 2), k = at::randn({b, s, hk, d}, opts).transpose(1, 2),
             v = at::randn({b, s, hk, d}, opts).transpose(1, 2), grad = at::randn({b, h, s, d}, opts);
  // Causal: half of the s x s scores; forward 2 matmuls, backward 5 (with the recomputed scores).
  const double matmul = 2.0 * static_cast<double>(b * h) * static_cast<double>(s) * static_cast<double>(s) / 2 * static_cast<double>(d);
  const std::string name = std::string(dtype == at::kFloat ? "fp32" : "bf16") + " attention b" + std::to_string(b) + " h" +
                           std::to_string(h) + "/" + std::to_string(hk) + " s" + std::to_string(s) + " d" + std::to_string(d);
  at::NoGradGuard no_grad;
  const double fused_fwd = median_ms([&] { titan::kernels::attention(q, k, v, {}); });
  const double aten_fwd = median_ms([&] {
    at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, std::nullopt, h != hk);
  });
  report(name + " fwd", fused_fwd, aten_fwd, 2 * matmul);
  at::AutoGradMode grad_mode(true);
  const double fused_all = median_ms([&] {
    at::Tensor q1 = leaf(q), k1 = leaf(k), v1 = leaf(v);
    titan::kernels::attention(q1, k1, v1, {}).backward(grad);
  });
  const double aten_all = median_ms([&] {
    at::Tensor q1 = leaf(q), k1 = leaf(k), v1 = leaf(v);
    at::scaled_dot_product_attention(q1, k1, v1, std::nullopt, 0.0, true, std::nullopt, h != hk).backward(grad);
  });
  report(name + " fwd+bwd", fused_all, aten_all, 7 * matmul);
}

void elementwise(at::ScalarType dtype, int64_t tokens, int64_t dim, int64_t hidden, int64_t heads, int64_t head_dim) {
  auto opts = at::TensorOptions().dtype(dtype).device(g_device);
  const std::string tag = std::string(dtype == at::kFloat ? "fp32 " : "bf16 ");
  at::AutoGradMode grad_mode(true);
  if (g_device.is_cpu()) {  // on CUDA RMSNorm is LibTorch's own fused kernel
    at::Tensor x = at::randn({tokens, dim}, opts), w = at::randn({dim}, opts), g = at::randn({tokens, dim}, opts);
    const double fused = median_ms([&] { titan::kernels::rms_norm(leaf(x), leaf(w), 1e-5).backward(g); });
    const double aten = median_ms([&] { at::rms_norm(leaf(x), {dim}, leaf(w), 1e-5).backward(g); });
    report(tag + "RMSNorm fwd+bwd " + std::to_string(tokens) + "x" + std::to_string(dim), fused, aten, 0);
  }
  {
    at::Tensor a = at::randn({tokens, hidden}, opts), u = at::randn({tokens, hidden}, opts), g = at::randn({tokens, hidden}, opts);
    const double fused = median_ms([&] { titan::kernels::swiglu(leaf(a), leaf(u)).backward(g); });
    const double aten = median_ms([&] { (at::silu(leaf(a)) * leaf(u)).backward(g); });
    report(tag + "SwiGLU fwd+bwd " + std::to_string(tokens) + "x" + std::to_string(hidden), fused, aten, 0);
  }
  {
    const auto table = titan::models::precompute_rope(head_dim, tokens, 500000.0, titan::llama3::flavor("8B").rope_scaling).to(g_device);
    at::Tensor q = at::randn({1, tokens, heads, head_dim}, opts), k = at::randn({1, tokens, heads, head_dim}, opts);
    at::Tensor g = at::randn({1, tokens, heads, head_dim}, opts);
    const double fused = median_ms([&] {
      auto [a, b] = titan::kernels::rope(leaf(q), leaf(k), table, {});
      (a * g).sum().add((b * g).sum()).backward();
    });
    const double aten = median_ms([&] {
      at::Tensor a = titan::kernels::rope_reference(leaf(q), table, {}), b = titan::kernels::rope_reference(leaf(k), table, {});
      (a * g).sum().add((b * g).sum()).backward();
    });
    report(tag + "RoPE q+k fwd+bwd (+ a product) " + std::to_string(tokens) + "x" + std::to_string(heads), fused, aten, 0);
  }
}

// The fused output projection + cross-entropy (chunked; the row passes are titan's kernels) against the projection
// followed by ATen's cross-entropy on float32 logits, forward + backward.
void loss(at::ScalarType dtype, int64_t tokens, int64_t dim, int64_t vocab) {
  auto opts = at::TensorOptions().dtype(dtype).device(g_device);
  at::Tensor x = at::randn({tokens, dim}, opts) * 0.5, w = at::randn({vocab, dim}, opts) * 0.02;
  at::Tensor labels = at::randint(0, vocab, {tokens}, opts.dtype(at::kLong));
  at::AutoGradMode grad_mode(true);
  const double fused = median_ms([&] {
    titan::distributed::linear_cross_entropy_sum(leaf(x), leaf(w), labels, 0, nullptr, -100).backward();
  });
  const double aten = median_ms([&] {
    at::cross_entropy_loss(at::linear(leaf(x), leaf(w)).to(at::kFloat), labels, {}, at::Reduction::Sum, -100).backward();
  });
  report(std::string(dtype == at::kFloat ? "fp32 " : "bf16 ") + "projection + loss fwd+bwd " + std::to_string(tokens) + "x" +
             std::to_string(dim) + " vocab " + std::to_string(vocab),
         fused, aten, 6.0 * static_cast<double>(tokens) * static_cast<double>(dim) * static_cast<double>(vocab));
}

// One expert linear [experts, out, in] over tokens routed top_k at random: forward, input gradient and weight
// gradient, titan's grouped kernels against one ATen product per expert.
void grouped(at::ScalarType dtype, int64_t tokens, int64_t experts, int64_t top_k, int64_t in, int64_t out) {
  const at::Tensor choice = std::get<1>(at::rand({tokens, experts}).topk(top_k, 1)).flatten();
  const at::Tensor counts = at::bincount(choice, {}, experts).to(at::kLong);
  const int64_t rows = tokens * top_k;
  const auto opts = at::TensorOptions().dtype(dtype);
  const at::Tensor x = at::randn({rows, in}, opts), w = at::randn({experts, out, in}, opts) * 0.02;
  const at::Tensor g = at::randn({rows, out}, opts);
  const int64_t* count = counts.data_ptr<int64_t>();
  at::NoGradGuard no_grad;
  const auto fused = [&] {
    titan::kernels::grouped_linear(x, w, counts);
    titan::kernels::grouped_linear_input_grad(g, w, counts);
    titan::kernels::grouped_linear_weight_grad(g, x, counts);
  };
  const double aten = median_ms([&] {
    at::Tensor y = at::empty({rows, out}, opts), dx = at::empty({rows, in}, opts), dw = at::zeros_like(w);
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
      if (count[e] == 0) continue;
      const at::Tensor xe = x.narrow(0, start, count[e]), ge = g.narrow(0, start, count[e]);
      at::Tensor ye = y.narrow(0, start, count[e]), dxe = dx.narrow(0, start, count[e]), dwe = dw[e];
      at::mm_out(ye, xe, w[e].t());
      at::mm_out(dxe, ge, w[e]);
      at::mm_out(dwe, ge.t(), xe);
    }
  });
  // LibTorch's own grouped matmul (at::_grouped_mm, also on the CPU) for the same three products.
  const double libtorch = median_ms([&] {
    titan::kernels::libtorch_grouped_linear(x, w, counts);
    titan::kernels::libtorch_grouped_linear_input_grad(g, w, counts);
    titan::kernels::libtorch_grouped_linear_weight_grad(g, x, counts);
  });
  const double flops = 6.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
  const std::string name = std::string(dtype == at::kFloat ? "fp32" : "bf16") + " grouped " + std::to_string(experts) + "x" +
                           std::to_string(out) + "x" + std::to_string(in) + " " + std::to_string(rows) + " rows";
  if (dtype == at::kBFloat16 && titan::kernels::grouped_mm_uses_amx()) {
    report(name + " AMX", median_ms(fused), aten, flops);
    titan::kernels::set_grouped_mm_amx(false);
    report(name + " vectors", median_ms(fused), aten, flops);
    titan::kernels::set_grouped_mm_amx(std::nullopt);
  } else {
    report(name, median_ms(fused), aten, flops);
  }
  std::printf("%-44s LibTorch at::_grouped_mm %8.2f ms (%6.1f GFLOP/s)\n", name.c_str(), libtorch, flops / libtorch / 1e6);
}

void float8_linear(int64_t tokens, int64_t k, int64_t n) {
  auto opts = at::TensorOptions().dtype(at::kBFloat16).device(g_device);
  const bool emulate = !titan::nn::float8::has_float8_matmul(g_device, nullptr);
  at::Tensor x = at::randn({tokens, k}, opts), w = at::randn({n, k}, opts) * 0.02, g = at::randn({tokens, n}, opts);
  at::AutoGradMode grad_mode(true);
  const double bf16 = median_ms([&] { at::linear(leaf(x), leaf(w)).backward(g); });
  const double flops = 6.0 * static_cast<double>(tokens) * static_cast<double>(k) * static_cast<double>(n);
  for (const auto& name : titan::nn::float8::recipe_names()) {
    const auto recipe = titan::nn::float8::recipe(name);
    const double f8 = median_ms([&] { titan::nn::float8::linear(leaf(x), leaf(w), recipe, emulate).backward(g); });
    std::printf("float8 %-18s linear fwd+bwd %lldx%lldx%lld%s  float8 %8.2f ms (%6.1f GFLOP/s)   bf16 %8.2f ms (%6.1f GFLOP/s)"
                "   bf16/float8 %5.2fx\n",
                name.c_str(), static_cast<long long>(tokens), static_cast<long long>(k), static_cast<long long>(n),
                emulate ? " (emulated)" : "", f8, flops / f8 / 1e6, bf16, flops / bf16 / 1e6, bf16 / f8);
  }
}

titan::kernels::Isa isa_named(const std::string& name) {
  using titan::kernels::Isa;
  for (Isa isa : {Isa::generic, Isa::avx2, Isa::avx512, Isa::avx512bf16})
    if (titan::kernels::isa_name(isa) == name) return isa;
  std::fprintf(stderr, "--isa %s: expected generic, avx2, avx512 or avx512bf16\n", name.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  std::string only = "attention,elementwise,loss,float8,grouped";
  std::string dtypes;  // both when empty
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) g_repeats = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--isa")) titan::kernels::set_cpu_isa(isa_named(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    else if (!std::strcmp(argv[i], "--dtype")) {
      dtypes = argv[i + 1];
      if (dtypes != "bf16" && dtypes != "fp32") {
        std::fprintf(stderr, "--dtype %s: expected bf16 or fp32\n", argv[i + 1]);
        return 2;
      }
    }
    else if (!std::strcmp(argv[i], "--device")) {
      if (std::strcmp(argv[i + 1], "cpu") && std::strcmp(argv[i + 1], "cuda")) {
        std::fprintf(stderr, "--device %s: expected cpu or cuda\n", argv[i + 1]);
        return 2;
      }
      g_device = at::Device(argv[i + 1]);
    }
  }
  at::set_num_threads(threads);
  at::manual_seed(0);
  if (g_device.is_cuda()) {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "--device cuda: no CUDA device here (torch::cuda::is_available() is false)\n");
      return 2;
    }
    if (!titan::kernels::cuda_kernels_built()) {
      std::fprintf(stderr, "--device cuda: this build has no CUDA kernels of titan's (LibTorch without CUDA)\n");
      return 2;
    }
    // A kernel that disagrees with ATen on its first call stops the benchmark instead of timing ATen against itself.
    titan::kernels::set_cuda_checks_strict(true);
    std::printf("titan CUDA kernels against ATen on the GPU, median of %d (each call synchronised)\n", g_repeats);
    for (auto dtype : {at::kBFloat16, at::kFloat}) {
      elementwise(dtype, 8192, 4096, 14336, 32, 128);  // Llama 3 8B, one 8,192-token sequence
      loss(dtype, 8192, 4096, 128256);
    }
    for (const auto& line : titan::kernels::cuda_kernel_checks()) std::printf("first-call check: %s\n", line.c_str());
    float8_linear(8192, 4096, 14336);  // Llama 3 8B's feed-forward, one 8,192-token sequence
    float8_linear(8192, 4096, 4096);   // its attention output projection
    return 0;
  }
  std::printf("titan fused CPU kernels (%s copy) against ATen, %d threads, median of %d\n",
              titan::kernels::isa_name(titan::kernels::cpu_isa()).c_str(), threads, g_repeats);
  const auto wanted = [&](const char* section) { return ("," + only + ",").find(std::string(",") + section + ",") != std::string::npos; };
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    if (!dtypes.empty() && dtypes != (dtype == at::kFloat ? "fp32" : "bf16")) continue;
    if (wanted("attention")) {
      attention(dtype, 8, 16, 16, 512, 16);   // debug model, 8 x 512
      attention(dtype, 4, 12, 4, 512, 64);    // 100M flavor, 4 x 512
      attention(dtype, 1, 12, 4, 2048, 64);   // 100M flavor, 1 x 2048
      attention(dtype, 1, 8, 2, 1024, 128);   // Llama 3 8B's head_dim
      attention(dtype, 4, 16, 16, 256, 192);  // DeepSeek-V3 debugmodel's latent attention, 4 x 256
    }
    if (wanted("elementwise")) elementwise(dtype, 4096, 768, 2048, 12, 64);
    if (wanted("loss")) loss(dtype, 2048, 256, 32768);
    if (wanted("grouped")) {
      grouped(dtype, 8192, 1, 1, 256, 768);    // one expert: the products at their largest (8,192 rows)
      grouped(dtype, 1024, 64, 8, 256, 768);   // debugmodel_moe's w1 (and w3), 4 x 256 tokens
      grouped(dtype, 1024, 64, 8, 768, 256);   // its w2
      grouped(dtype, 2048, 128, 8, 2048, 768); // 30B-A3B's w1, 2,048 tokens (128 rows per expert on average)
    }
  }
  if (wanted("float8")) {
    float8_linear(2048, 768, 2048);   // the 100M flavor's feed-forward, 2 x 1024 tokens
    float8_linear(2048, 1024, 4096);
  }
  return 0;
}
