#include "titan/kernels/grouped_mm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_grouped_mm.h>

#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/kernels/cpu_isa.h"
#include "titan/kernels/isa/kernels.h"
#include "titan/kernels/isa_call.h"

namespace titan::kernels {
namespace {

using isa::MatmulPacking;
using isa::MatmulProblem;

// The most packed bytes one chunk of problems takes, unless two problems per thread (at most kMinChunkProblems) need
// more: small enough that a chunk's copies are still in the last-level cache when its tiles read them (at 128 MiB,
// weights packed for debugmodel_moe's 64 experts went out to memory and back, and its products took about 10% longer
// on a 32 MiB-L3 Zen 4), with enough problems per chunk to keep every thread busy (one 30B-A3B expert per chunk in
// float32 took 10% longer than chunks of four). The buffer is at most the larger of the two: 8 MiB, or 8 of the
// largest experts' copies (30B-A3B's in bf16: 29 MiB).
constexpr int64_t kScratchBytes = int64_t{8} << 20;
constexpr size_t kMinChunkProblems = 8;

// -1: the rule (grouped_mm_uses_amx), 0 or 1: forced.
std::atomic<int> g_amx_forced{-1};

// Whether this CPU has AMX tiles with bf16 products and Linux grants this process their registers (asked once).
bool amx_available() {
#if defined(__linux__) && defined(__x86_64__) && defined(TITAN_AVX512BF16_KERNELS)
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
    if (!tile || !bf16) return false;
    // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it the first tile instruction kills the process.
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return available;
#else
  return false;
#endif
}

bool amx_allowed_by_environment() {
  const char* env = std::getenv("TITAN_CPU_AMX");
  return !(env && std::strcmp(env, "0") == 0);
}

bool use_amx(bool bf16) {
  return bf16 && grouped_mm_uses_amx();
}

// The packed copies' buffer, kept between calls (a new one each call cost a page fault per 4 KiB, as much time as the
// products at debugmodel_moe's shapes); per thread, grown to the largest chunk (see kScratchBytes).
uint8_t* scratch(int64_t bytes) {
  thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < bytes)
    buffer = at::empty({std::max<int64_t>(bytes, 64)}, at::TensorOptions().dtype(at::kByte));
  return static_cast<uint8_t*>(buffer.data_ptr());
}

// Runs every problem: packs operands (parallel over problems), then computes tiles (parallel over all tiles), in
// chunks of problems whose packed copies fit a bounded scratch buffer.
void run(const std::vector<MatmulProblem>& problems, bool bf16) {
  const bool amx = use_amx(bf16);
  std::vector<MatmulPacking> packing(problems.size());
  for (size_t i = 0; i < problems.size(); ++i) TITAN_ISA_CALL(matmul_packing, problems[i], bf16, amx, &packing[i]);
  size_t first = 0;
  while (first < problems.size()) {
    size_t last = first;
    int64_t bytes = 0;
    const size_t at_least = first + std::min<size_t>(2 * static_cast<size_t>(at::get_num_threads()), kMinChunkProblems);
    while (last < problems.size() &&
           (last < at_least || bytes + packing[last].a_bytes + packing[last].b_bytes <= kScratchBytes))
      bytes += packing[last].a_bytes + packing[last].b_bytes, ++last;
    auto* base = scratch(bytes);
    std::vector<uint8_t*> a(last - first), b(last - first);
    std::vector<int64_t> tile_end(last - first);
    int64_t offset = 0, tiles = 0;
    for (size_t i = first; i < last; ++i) {
      a[i - first] = base + offset;
      b[i - first] = base + offset + packing[i].a_bytes;
      offset += packing[i].a_bytes + packing[i].b_bytes;
      tiles += packing[i].tiles;
      tile_end[i - first] = tiles;
    }
    // Packing units: each problem in slices of about a quarter of the chunk's bytes per thread, so that a chunk of
    // few large problems still packs on every thread (the AMX copy packs a problem whole).
    const int64_t slice_bytes = std::max<int64_t>(bytes / (4 * at::get_num_threads()), 1);
    std::vector<std::array<int64_t, 3>> units;  // (problem in the chunk, part, parts)
    for (size_t i = first; i < last; ++i) {
      const int64_t parts =
          amx ? 1 : std::clamp<int64_t>((packing[i].a_bytes + packing[i].b_bytes) / slice_bytes, 1, 64);
      for (int64_t part = 0; part < parts; ++part) units.push_back({static_cast<int64_t>(i - first), part, parts});
    }
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const auto [i, part, parts] = units[u];
        TITAN_ISA_CALL(matmul_pack, problems[first + i], bf16, amx, a[i], b[i], part, parts);
      }
    });

    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      // The problems these tiles belong to, each with its own range of tiles.
      auto i = static_cast<size_t>(std::upper_bound(tile_end.begin(), tile_end.end(), begin) - tile_end.begin());
      for (; i < tile_end.size() && begin < end; ++i) {
        const int64_t start = i == 0 ? 0 : tile_end[i - 1];
        const int64_t stop = std::min(end, tile_end[i]);
        TITAN_ISA_CALL(matmul_tiles, problems[first + i], bf16, amx, a[i], b[i], begin - start, stop - start);
        begin = stop;
      }
    });
    first = last;
  }
}

void check_counts(const char* what, const at::Tensor& counts, int64_t experts, int64_t rows) {
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.device().is_cpu() && counts.size(0) == experts,
              "grouped ", what, ": expected int64 counts [", experts, "] on the CPU, got ", counts.scalar_type(), " ",
              counts.sizes(), " on ", counts.device());
  const int64_t total = counts.sum().item<int64_t>();
  TORCH_CHECK(total == rows, "grouped ", what, ": the counts add up to ", total, " rows, the input has ", rows);
}

void check_operands(const char* what, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "grouped ", what, ": expected float32 or bf16 CPU tensors of one dtype, got ", a.scalar_type(), " on ",
              a.device(), " and ", b.scalar_type(), " on ", b.device());
}

void check_shapes(const char* what, const at::Tensor& rows, const at::Tensor& w, int64_t width) {
  TORCH_CHECK(rows.dim() == 2 && w.dim() == 3 && rows.size(1) == width, "grouped ", what,
              ": expected rows [N, ", width, "] and weights [experts, out, in]; got ", rows.sizes(), " and ", w.sizes());
}

// The per-expert problems, with `make(e, start, count)` filling in each.
template <typename Make>
std::vector<MatmulProblem> problems_for(const at::Tensor& counts, bool skip_empty, const Make& make) {
  std::vector<MatmulProblem> out;
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t e = 0, start = 0; e < counts.size(0); start += count[e], ++e) {
    TORCH_CHECK(count[e] >= 0, "grouped matmul: expert ", e, " has a negative row count ", count[e]);
    if (skip_empty && count[e] == 0) continue;
    out.push_back(make(e, start, count[e]));
  }
  return out;
}

int64_t element_bytes(const at::Tensor& t) { return static_cast<int64_t>(t.element_size()); }

}  // namespace

namespace {

// TITAN_CPU_GROUPED_MM: -1 unset, 0 the per-expert loop, 1 titan's kernels for float32 too, 2 LibTorch's.
int cpu_grouped_mm_setting() {
  static const int setting = [] {
    const char* env = std::getenv("TITAN_CPU_GROUPED_MM");
    if (!env || !*env) return -1;
    if (std::strcmp(env, "0") == 0) return 0;
    if (std::strcmp(env, "1") == 0) return 1;
    if (std::strcmp(env, "libtorch") == 0) return 2;
    fail("TITAN_CPU_GROUPED_MM = ", quote(env), ": expected 0 (the per-expert loop), 1 (titan's grouped kernels for ",
         "float32 too) or libtorch (LibTorch's at::_grouped_mm); unset uses titan's kernels for bf16");
  }();
  return setting;
}

std::atomic<bool> g_libtorch_failed{false};

at::Tensor offsets_for(const at::Tensor& counts, const at::Device& device) {
  return counts.cumsum(0).to(at::kInt).to(device);
}

}  // namespace

bool grouped_mm_enabled(at::ScalarType dtype) {
  const int setting = cpu_grouped_mm_setting();
  if (setting >= 0) return setting == 1;
  return dtype == at::kBFloat16;
}

bool libtorch_grouped_mm_applies(const at::Tensor& x, const at::Tensor& w) {
  if (g_libtorch_failed.load() || x.scalar_type() != w.scalar_type() || x.device() != w.device()) return false;
  if (x.is_cpu()) return cpu_grouped_mm_setting() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
#ifdef TITAN_WITH_CUDA
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16 && w.size(1) % 8 == 0 && w.size(2) % 8 == 0)
    return at::cuda::getDeviceProperties(x.device().index())->major >= 9;
#endif
  return false;
}

at::Tensor libtorch_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  return at::_grouped_mm(x.contiguous(), w.transpose(1, 2), offsets_for(counts, x.device()));
}

at::Tensor libtorch_grouped_linear_input_grad(const at::Tensor& grad, const at::Tensor& w, const at::Tensor& counts) {
  return at::_grouped_mm(grad.contiguous(), w, offsets_for(counts, grad.device()));
}

at::Tensor libtorch_grouped_linear_weight_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& counts) {
  // [experts, out, in]: the groups split the rows, the shared dimension of grad^T and x (zeros for empty groups).
  return at::_grouped_mm(grad.contiguous().t(), x.contiguous(), offsets_for(counts, grad.device()));
}

void libtorch_grouped_mm_failed(const std::string& error) {
  if (!g_libtorch_failed.exchange(true))
    log::warn("LibTorch's grouped matmul (at::_grouped_mm) failed: ", error.substr(0, error.find('\n')),
              "; the experts run one matmul per expert for the rest of this run");
}

bool grouped_mm_uses_amx() {
  const int forced = g_amx_forced.load();
  if (forced >= 0) return forced == 1;
  return cpu_isa() == Isa::avx512bf16 && amx_allowed_by_environment() && amx_available();
}

void set_grouped_mm_amx(std::optional<bool> use) {
  if (use && *use && !(cpu_isa() == Isa::avx512bf16 && amx_available()))
    fail("bf16 grouped products on AMX cannot run here: ",
         cpu_isa() != Isa::avx512bf16 ? "the avx512bf16 kernels are not the ones chosen"
                                      : "this CPU has no AMX with bf16, or Linux refused titan its tile registers");
  g_amx_forced = use ? (*use ? 1 : 0) : -1;
}

namespace {

// out[rows of e] = rows[rows of e] W_e for every expert e, with W_e = w[e]^T (`transposed`, the forward) or w[e]
// (the input gradient); w [experts, out, in].
at::Tensor rows_times_expert_weights(const char* what, const at::Tensor& rows_in, const at::Tensor& w_in,
                                     const at::Tensor& counts, bool transposed) {
  const at::Tensor rows = rows_in.contiguous(), w = w_in.contiguous();
  check_operands(what, rows, w);
  check_shapes(what, rows, w, w.dim() == 3 ? w.size(transposed ? 2 : 1) : -1);
  check_counts(what, counts, w.size(0), rows.size(0));
  const int64_t in = w.size(2), out_dim = w.size(1);
  const int64_t depth = transposed ? in : out_dim, width = transposed ? out_dim : in;
  at::Tensor out = at::empty({rows.size(0), width}, rows.options());
  const int64_t bytes = element_bytes(rows);
  auto* rp = static_cast<const uint8_t*>(rows.data_ptr());
  auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  auto* op = static_cast<uint8_t*>(out.data_ptr());
  const auto problems = problems_for(counts, true, [&](int64_t e, int64_t start, int64_t count) {
    MatmulProblem p;
    p.rows = count, p.cols = width, p.depth = depth;
    p.a = rp + start * depth * bytes, p.a_stride[0] = depth, p.a_stride[1] = 1;
    // B[t, j]: w[e, j, t] (forward: t an input, j an output) or w[e, t, j] (input gradient).
    p.b = wp + e * out_dim * in * bytes, p.b_stride[0] = transposed ? 1 : in, p.b_stride[1] = transposed ? in : 1;
    p.c = op + start * width * bytes, p.c_stride[0] = width, p.c_stride[1] = 1;
    return p;
  });
  run(problems, rows.scalar_type() == at::kBFloat16);
  return out;
}

}  // namespace

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  return rows_times_expert_weights("linear", x, w, counts, true);  // y[r, o] = sum_i x[r, i] w[e, o, i]
}

at::Tensor grouped_linear_input_grad(const at::Tensor& grad, const at::Tensor& w, const at::Tensor& counts) {
  return rows_times_expert_weights("linear input gradient", grad, w, counts, false);  // dx[r, i] = sum_o g[r, o] w[e, o, i]
}

at::Tensor grouped_linear_weight_grad(const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& counts) {
  const at::Tensor g = grad_in.contiguous(), x = x_in.contiguous();
  TORCH_CHECK(g.dim() == 2 && x.dim() == 2 && g.size(0) == x.size(0),
              "grouped linear weight gradient: expected gradient [N, out] and input [N, in]; got ", g.sizes(), " and ", x.sizes());
  const int64_t in = x.size(1), out_dim = g.size(1), experts = counts.dim() == 1 ? counts.size(0) : -1;
  check_operands("linear weight gradient", g, x);
  check_counts("linear weight gradient", counts, experts, g.size(0));
  // Empty experts get zeros: depth 0 writes a zero tile, so every expert is a problem.
  at::Tensor dw = at::empty({experts, out_dim, in}, g.options());
  const int64_t bytes = element_bytes(g);
  auto* gp = static_cast<const uint8_t*>(g.data_ptr());
  auto* xp = static_cast<const uint8_t*>(x.data_ptr());
  auto* dp = static_cast<uint8_t*>(dw.data_ptr());
  // dw[e, o, i] = sum_r g[r, o] x[r, i]
  const auto problems = problems_for(counts, false, [&](int64_t e, int64_t start, int64_t count) {
    MatmulProblem p;
    p.rows = out_dim, p.cols = in, p.depth = count;
    p.a = gp + start * out_dim * bytes, p.a_stride[0] = 1, p.a_stride[1] = out_dim;
    p.b = xp + start * in * bytes, p.b_stride[0] = in, p.b_stride[1] = 1;
    p.c = dp + e * out_dim * in * bytes, p.c_stride[0] = in, p.c_stride[1] = 1;
    return p;
  });
  run(problems, g.scalar_type() == at::kBFloat16);
  return dw;
}

}  // namespace titan::kernels
