// Matrix products in the compute dtype, with one exception: bf16 products on x86 CPUs without bf16 hardware.
//
// LibTorch multiplies bf16 matrices on the CPU through oneDNN only where the CPU has AVX-512 (F, BW, VL and DQ) or
// AMX. Elsewhere (AVX2 machines: AMD EPYC before Zen 4, Intel before Skylake-SP) it falls back to a scalar loop,
// measured on 2026-11-25 on a 2-core AVX2 EPYC at 0.6 GFLOP/s against 50 GFLOP/s for float32: a bf16 run of the
// debug model trained at 67 tokens/s there. On AVX-512 CPUs without its BF16 extension (Skylake-SP, Cascade Lake,
// Ice Lake) oneDNN widens every bf16 element in software: measured on 2026-11-28 on a 2-core Skylake-SP at 31-50
// GFLOP/s against 100-145 for float32. On such CPUs titan computes a bf16 product as the float32 product of the
// same bf16 inputs, rounded to bf16 once: the inputs, the float32 accumulation and the bf16 result are those of
// oneDNN's bf16 GEMM, only the order of the additions may differ. Everywhere else (CUDA, CPUs with AVX512_BF16 or
// AMX, other dtypes) these functions are LibTorch's.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace titan::nn {

// Whether bf16 products on the CPU are computed in float32 here (the CPU lacks AVX512_BF16, or the test
// variable TITAN_TEST_BF16_PRODUCTS_IN_FLOAT is 1; 0 keeps LibTorch's bf16 GEMM on any CPU).
bool emulates_bf16_gemm();
// Forces either path for this process (tests); std::nullopt restores the CPU's rule.
void set_bf16_gemm_emulation(std::optional<bool> emulate);

// a @ b (2-D), a @ b into `out`, and at::matmul's broadcasting product.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b);
void mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b);

// x @ weight^T as at::linear computes it, under autocast in the autocast dtype, differentiable. Where bf16 is
// computed in float32 it keeps the bf16 input and weight for backward, as autocast's linear would.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
// linear(x, weight) whose result `y` is already known (kept by op-level selective checkpointing, nn/kept_ops.h):
// returns y, differentiable as linear's result (under autocast through the same casts), computing no product.
at::Tensor linear_with_output(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y);

// Refuses an output op-level checkpointing kept (nn/kept_ops.h) that is not this product's: `x`'s leading shape,
// `out_features` columns, `dtype` (a mismatch means the forward and the recomputation ran different products).
// `what` names the product in the message.
void check_kept_output(const char* what, const at::Tensor& kept, const at::Tensor& x, int64_t out_features, at::ScalarType dtype);

}  // namespace titan::nn
