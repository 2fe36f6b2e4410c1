// Grouped matrix products for Mixture-of-Experts layers on the CPU: rows sorted by expert (counts[e] rows for expert e,
// in order) against 3-D expert weights [experts, out, in] (torchtitan's layout), in one call rather than one ATen
// product per expert. The kernels (kernels/isa/grouped_mm.cpp) copy each expert's operands into padded blocks and
// compute the output tiles of every expert in one parallel pass; float32 in float32, bf16 on the AMX unit where the
// CPU has one (products in float32, rounded once), elsewhere in float32 from the bf16 values. Empty groups are
// skipped (their weight gradient is zero).
//
// models/common/moe.cpp uses these where fused_kernel_applies(Op::grouped_mm, ...) says so (training.fused_kernels);
// otherwise it runs the loop of ATen products they are tested against.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace titan::kernels {

// y[rows of e] = x[rows of e] w[e]^T: x [rows, in], w [experts, out, in], counts int64 [experts] on the CPU.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts);
// The input gradient: grad [rows, out] -> [rows, in], grad[rows of e] w[e].
at::Tensor grouped_linear_input_grad(const at::Tensor& grad, const at::Tensor& w, const at::Tensor& counts);
// The weight gradient: [experts, out, in], grad[rows of e]^T x[rows of e] (zero for experts without rows).
at::Tensor grouped_linear_weight_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& counts);

// LibTorch's own grouped matrix product (at::_grouped_mm, the one torchtitan's MoE calls) for the same three
// products: what runs on CUDA GPUs that have it (bf16, compute capability 9.0 and newer, widths divisible by 8);
// on the CPU only when TITAN_CPU_GROUPED_MM=libtorch (for comparisons). A call that fails on CUDA turns it off for
// the rest of the process with a warning, and the per-expert loop takes over.
bool libtorch_grouped_mm_applies(const at::Tensor& x, const at::Tensor& w);
at::Tensor libtorch_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts);
at::Tensor libtorch_grouped_linear_input_grad(const at::Tensor& grad, const at::Tensor& w, const at::Tensor& counts);
at::Tensor libtorch_grouped_linear_weight_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& counts);
// Turns LibTorch's grouped product off after `error` (logged once as a warning).
void libtorch_grouped_mm_failed(const std::string& error);

// Whether the model uses these kernels for `dtype` where training.fused_kernels is on. By default bf16 only: float32
// stays on LibTorch's per-expert products, which trained debugmodel_moe faster here (bench/bench_moe.py, docs/moe.md).
// TITAN_CPU_GROUPED_MM=0 turns them off, =1 uses them for float32 too, =libtorch runs LibTorch's at::_grouped_mm
// instead (for comparisons).
bool grouped_mm_enabled(at::ScalarType dtype);

// Whether bf16 grouped products run on the AMX unit in this process: the avx512bf16 kernels are chosen, the CPU has
// AMX with bf16, Linux let titan use its tile registers, and TITAN_CPU_AMX is not 0.
bool grouped_mm_uses_amx();
// Forces the choice for this process (tests and benchmarks); true fails clearly where AMX cannot run. std::nullopt
// restores the rule above.
void set_grouped_mm_amx(std::optional<bool> use);

}  // namespace titan::kernels
