// Which compiled copy of the CPU kernels runs (kernels/isa): chosen once from the CPU's features at run time, never
// from the build machine's; TITAN_CPU_ISA=generic|avx2|avx512|avx512bf16 picks a lower one (tests run every copy this
// way). avx512bf16 is the AVX-512 copy whose bf16 attention runs on the CPU's bf16 dot-product instruction.
#pragma once
#include <string>

namespace titan::kernels {

enum class Isa { generic, avx2, avx512, avx512bf16 };

// The best copy this CPU runs (and this build has), or the one TITAN_CPU_ISA names.
Isa cpu_isa();
// Overrides the choice for this process (tests); fails with a clear error when the CPU lacks the instructions.
void set_cpu_isa(Isa isa);
// Whether this CPU can run `isa` and this build holds that copy.
bool cpu_supports(Isa isa);
std::string isa_name(Isa isa);
// Whether this x86 CPU has AVX-512 F, BW, VL and DQ, whatever this build holds (false elsewhere): what LibTorch
// checks before sending bf16 matrix products to oneDNN (nn/matmul.h).
bool cpu_has_avx512_core();
// Whether this x86 CPU has AVX-512's BF16 extension (bf16 dot products in hardware: Cooper Lake, Sapphire Rapids
// and later, AMD Zen 4 and later), whatever this build holds (false elsewhere). oneDNN's bf16 GEMM on AVX-512 CPUs
// without it widens every element in software (nn/matmul.h).
bool cpu_has_avx512_bf16();

}  // namespace titan::kernels
