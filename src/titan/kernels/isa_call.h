// TITAN_ISA_CALL(fn, args...): calls isa::<copy>::fn(args...) for the instruction set this CPU runs (cpu_isa()).
// For the dispatching sources only (fused_ops.cpp, grouped_mm.cpp): CMakeLists.txt gives them the definitions that
// say which copies this build holds.
#pragma once
#include "titan/kernels/cpu_isa.h"
#include "titan/kernels/isa/kernels.h"

#if defined(TITAN_AVX512BF16_KERNELS)
#define TITAN_ISA_CALL_AVX512BF16(fn, ...) \
  case ::titan::kernels::Isa::avx512bf16: ::titan::kernels::isa::avx512bf16::fn(__VA_ARGS__); break;
#else
#define TITAN_ISA_CALL_AVX512BF16(fn, ...) \
  case ::titan::kernels::Isa::avx512bf16: break;  /* never chosen: cpu_supports() says no */
#endif
#if defined(TITAN_X86_KERNELS)
#define TITAN_ISA_CALL(fn, ...)                                     \
  do {                                                              \
    switch (::titan::kernels::cpu_isa()) {                                            \
      TITAN_ISA_CALL_AVX512BF16(fn, __VA_ARGS__)                    \
      case ::titan::kernels::Isa::avx512: ::titan::kernels::isa::avx512::fn(__VA_ARGS__); break;        \
      case ::titan::kernels::Isa::avx2: ::titan::kernels::isa::avx2::fn(__VA_ARGS__); break;            \
      case ::titan::kernels::Isa::generic: ::titan::kernels::isa::generic::fn(__VA_ARGS__); break;      \
    }                                                               \
  } while (0)
#else
#define TITAN_ISA_CALL(fn, ...) ::titan::kernels::isa::generic::fn(__VA_ARGS__)
#endif
