#include "titan/kernels/cpu_isa.h"

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::kernels {
namespace {

std::atomic<int> g_isa{-1};

Isa parse(const std::string& name) {
  if (name == "generic") return Isa::generic;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  if (name == "avx512bf16") return Isa::avx512bf16;
  fail("TITAN_CPU_ISA = ", quote(name), " is not a kernel instruction set; expected generic, avx2, avx512 or avx512bf16");
}

Isa best() {
  if (cpu_supports(Isa::avx512bf16)) return Isa::avx512bf16;
  if (cpu_supports(Isa::avx512)) return Isa::avx512;
  if (cpu_supports(Isa::avx2)) return Isa::avx2;
  return Isa::generic;
}

}  // namespace

bool cpu_has_avx512_core() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  // CPUID leaf 7, sub-leaf 1: EAX bit 5 is AVX512_BF16 (read directly: older compilers' __builtin_cpu_supports lacks it).
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return cpu_has_avx512_core() && (eax & (1u << 5)) != 0;
#else
  return false;
#endif
}

bool cpu_supports(Isa isa) {
  if (isa == Isa::generic) return true;
#if defined(TITAN_X86_KERNELS) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == Isa::avx2) return avx2;
  const bool avx512 = avx2 && cpu_has_avx512_core();
  if (isa == Isa::avx512) return avx512;
#if defined(TITAN_AVX512BF16_KERNELS)
  return avx512 && __builtin_cpu_supports("avx512bf16");
#else
  return false;  // this build has no avx512bf16 copy (the compiler lacks -mavx512bf16)
#endif
#else
  return false;
#endif
}

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::generic: break;
  }
  return "generic";
}

void set_cpu_isa(Isa isa) {
  if (!cpu_supports(isa))
    fail("the CPU kernels for ", isa_name(isa), " cannot run here (this CPU or this build lacks them); the best here is ",
         isa_name(best()));
  g_isa = static_cast<int>(isa);
}

Isa cpu_isa() {
  int chosen = g_isa.load();
  if (chosen >= 0) return static_cast<Isa>(chosen);
  const char* env = std::getenv("TITAN_CPU_ISA");
  const Isa isa = env && *env ? parse(env) : best();
  set_cpu_isa(isa);
  return isa;
}

}  // namespace titan::kernels
