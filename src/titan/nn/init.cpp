#include "titan/nn/init.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "titan/common/error.h"

namespace titan::nn {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// SplitMix64's output function: a strong 64-bit mix of a counter.
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// FNV-1a of the parameter name: different parameters get unrelated streams.
uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

}  // namespace

double normal_quantile(double p) {
  // Acklam's rational approximations (relative error below 1.2e-9), refined by one Halley step on the exact CDF.
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                             1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                             6.680131188771972e+01,  -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758276161838e+00,
                             -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00};
  constexpr double low = 0.02425, high = 1 - low;
  double x;
  if (p < low) {
    const double q = std::sqrt(-2 * std::log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p <= high) {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  } else {
    const double q = std::sqrt(-2 * std::log1p(-p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  const double e = normal_cdf(x) - p;
  const double u = e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

void fill_box(at::Tensor out, const InitSpec& spec, uint64_t seed, const std::string& name,
              const std::vector<int64_t>& global_shape, const std::vector<int64_t>& offsets) {
  at::NoGradGuard no_grad;
  const auto rank = static_cast<int64_t>(global_shape.size());
  if (out.dim() != rank || static_cast<int64_t>(offsets.size()) != rank)
    fail("init of ", name, ": a box of rank ", out.dim(), " in a tensor of rank ", rank);
  for (int64_t d = 0; d < rank; ++d)
    if (offsets[d] < 0 || offsets[d] + out.size(d) > global_shape[d]) fail("init of ", name, ": the box leaves the tensor");
  if (spec.kind == InitSpec::Kind::Ones || spec.kind == InitSpec::Kind::Zeros) {
    out.fill_(spec.kind == InitSpec::Kind::Ones ? 1.0 : 0.0);
    return;
  }
  const int64_t n = out.numel();
  if (n == 0) return;
  at::Tensor host = at::empty(out.sizes(), at::TensorOptions().dtype(at::kFloat));
  float* data = host.data_ptr<float>();
  const uint64_t key = mix(seed * kGolden ^ name_hash(name));
  double cdf_low = 0, cdf_high = 1;
  if (spec.kind == InitSpec::Kind::TruncatedNormal) {
    cdf_low = normal_cdf((spec.low - spec.mean) / spec.std);
    cdf_high = normal_cdf((spec.high - spec.mean) / spec.std);
  }
  // Global strides; the box's rows (all dimensions but the last) are contiguous runs of global indices.
  std::vector<int64_t> global_strides(rank, 1);
  for (int64_t d = rank - 2; d >= 0; --d) global_strides[d] = global_strides[d + 1] * global_shape[d + 1];
  const int64_t row_length = rank == 0 ? 1 : out.size(rank - 1);
  const int64_t rows = n / row_length;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      // This row's first global index: unravel the row number over the box's leading dimensions.
      int64_t rest = row, base = 0;
      for (int64_t d = rank - 2; d >= 0; --d) {
        const int64_t i = rest % out.size(d);
        rest /= out.size(d);
        base += (offsets[d] + i) * global_strides[d];
      }
      if (rank > 0) base += offsets[rank - 1];
      float* dst = data + row * row_length;
      for (int64_t j = 0; j < row_length; ++j) {
        const uint64_t bits = mix(key + static_cast<uint64_t>(base + j + 1) * kGolden);
        const double uniform = (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;  // in (0, 1)
        double value;
        if (spec.kind == InitSpec::Kind::Normal) {
          value = spec.mean + spec.std * normal_quantile(uniform);
        } else {
          const double p = std::clamp(cdf_low + uniform * (cdf_high - cdf_low), 0x1.0p-60, 1 - 0x1.0p-53);
          value = std::clamp(spec.mean + spec.std * normal_quantile(p), spec.low, spec.high);
        }
        dst[j] = static_cast<float>(value);
      }
    }
  });
  out.copy_(host);
}

void fill(at::Tensor out, const InitSpec& spec, uint64_t seed, const std::string& name) {
  fill_box(out, spec, seed, name, out.sizes().vec(), std::vector<int64_t>(static_cast<size_t>(out.dim()), 0));
}

}  // namespace titan::nn
