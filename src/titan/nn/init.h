// Layout-independent parameter initialisation: every element's value is a function of (seed, parameter name,
// global element index) only, so any rank can fill any box of any parameter, and a given seed gives bitwise the
// same global weights on one process, FSDP 4, TP 2 x FSDP 2 or any other layout, without materialising the model.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace titan::nn {

// The distribution of one parameter's initial values (torchtitan's init for each Llama parameter).
struct InitSpec {
  enum class Kind { Normal, TruncatedNormal, Ones, Zeros };
  Kind kind = Kind::Zeros;
  double mean = 0, std = 1;
  double low = 0, high = 0;  // TruncatedNormal: absolute bounds, as torch.nn.init.trunc_normal_'s a and b

  static InitSpec normal(double mean, double std) { return {Kind::Normal, mean, std, 0, 0}; }
  static InitSpec truncated_normal(double mean, double std, double low, double high) {
    return {Kind::TruncatedNormal, mean, std, low, high};
  }
  static InitSpec ones() { return {Kind::Ones}; }
  static InitSpec zeros() { return {Kind::Zeros}; }
};

// Fills `out` (any device and float dtype, shaped `lengths`) with the elements [offsets, offsets + lengths) of
// the global tensor `name` of shape `global_shape`. Values are drawn on the host in double precision by one scalar
// code path per element (a counter-based generator and an inverse normal CDF), then rounded to out's dtype.
void fill_box(at::Tensor out, const InitSpec& spec, uint64_t seed, const std::string& name,
              const std::vector<int64_t>& global_shape, const std::vector<int64_t>& offsets);

// The whole tensor: fill_box with offsets 0.
void fill(at::Tensor out, const InitSpec& spec, uint64_t seed, const std::string& name);

// The standard normal quantile (inverse CDF) for p in (0, 1), accurate to double rounding.
double normal_quantile(double p);

}  // namespace titan::nn
