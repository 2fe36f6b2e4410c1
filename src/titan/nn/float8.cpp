#include "titan/nn/float8.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/_scaled_mm.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef TITAN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "titan/kernels/cuda/kernels.h"
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/kernels/fused_ops.h"
#include "titan/nn/autocast.h"
#include "titan/nn/matmul.h"
#include "titan/nn/weight_gradients.h"

namespace titan::nn::float8 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kAmaxFloor = 1e-12;  // torchao's EPS

double format_max(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat8_e4m3fn: return 448.0;
    case at::kFloat8_e5m2: return 57344.0;
    default: fail("float8: ", c10::toString(dtype), " is not a float8 format titan casts to (float8_e4m3fn, float8_e5m2)");
  }
}

Cast high_precision() { return {Scaling::high_precision, at::kFloat8_e4m3fn}; }
Cast tensorwise(at::ScalarType dtype) { return {Scaling::tensorwise, dtype}; }
Cast axiswise() { return {Scaling::axiswise, at::kFloat8_e4m3fn}; }

// at::_scaled_mm wants scales of one granularity: a per-tensor scale beside a per-row one is repeated along the rows.
at::Tensor matching_scale(const at::Tensor& scale, const at::Tensor& other, int64_t rows, bool is_a) {
  if (scale.dim() == 2 || other.dim() != 2) return scale;
  return is_a ? scale.reshape({1, 1}).expand({rows, 1}).contiguous() : scale.reshape({1, 1}).expand({1, rows}).contiguous();
}

}  // namespace

const std::vector<std::string>& recipe_names() {
  static const std::vector<std::string> names = {"tensorwise", "rowwise", "rowwise_with_gw_hp"};
  return names;
}

Recipe recipe(const std::string& name) {
  Recipe r;
  r.name = name;
  if (name == "tensorwise") {
    // Inputs and weights in E4M3, gradients in E5M2, one scale per tensor, every matmul in float8.
    r.input = r.weight = r.input_for_grad_weight = r.weight_for_grad_input = tensorwise(at::kFloat8_e4m3fn);
    r.grad_output = r.grad_output_for_grad_weight = tensorwise(at::kFloat8_e5m2);
  } else if (name == "rowwise") {
    // E4M3 everywhere, a power-of-two scale per row along each matmul's contraction dimension.
    r.input = r.weight = r.grad_output = r.input_for_grad_weight = r.weight_for_grad_input = r.grad_output_for_grad_weight = axiswise();
    r.power_of_two_scales = true;
  } else if (name == "rowwise_with_gw_hp") {
    // As rowwise for the output and the input gradient (the weight there per tensor); the weight gradient in high
    // precision.
    r.input = r.weight = r.grad_output = axiswise();
    r.weight_for_grad_input = tensorwise(at::kFloat8_e4m3fn);
    r.input_for_grad_weight = r.grad_output_for_grad_weight = high_precision();
    r.power_of_two_scales = true;
  } else {
    fail("quantize.linear.float8.recipe_name = ", quote(name), " is not a float8 recipe; expected one of ",
         join(recipe_names(), ", "));
  }
  return r;
}

at::Tensor amax_to_scale(const at::Tensor& amax, at::ScalarType float8_dtype, bool power_of_two) {
  at::Tensor scale = (format_max(float8_dtype) / amax.to(at::kDouble).clamp_min(kAmaxFloor)).to(at::kFloat);
  if (power_of_two) scale = at::exp2(at::floor(at::log2(scale)));
  return scale;
}

namespace {
thread_local c10::intrusive_ptr<AmaxReduction> current_reduction;
}  // namespace

AmaxReductionScope::AmaxReductionScope(c10::intrusive_ptr<AmaxReduction> reduction) : outer_(current_reduction) {
  current_reduction = std::move(reduction);
}
AmaxReductionScope::~AmaxReductionScope() { current_reduction = outer_; }
c10::intrusive_ptr<AmaxReduction> AmaxReductionScope::current() { return current_reduction; }

Operand cast(const at::Tensor& x, const Cast& c, int64_t dim, bool power_of_two_scales, const AmaxReduction* reduction,
             bool contraction_split, bool column_major) {
  if (c.scaling == Scaling::high_precision) return {x, at::Tensor()};
  NoAutocast no_autocast;
  at::NoGradGuard no_grad;
  // The largest magnitude in one reduction (the infinity norm), without a tensor of absolute values.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  at::Tensor amax = c.scaling == Scaling::tensorwise ? at::linalg_vector_norm(x, kInf)
                                                     : at::linalg_vector_norm(x, kInf, at::IntArrayRef{dim}, /*keepdim=*/true);
  if (reduction && (c.scaling == Scaling::tensorwise || contraction_split)) {
    // Every rank's amax of the same rows (or of the whole tensor): the maximum is exact in any dtype.
    at::Tensor whole = amax.to(at::kFloat).contiguous();
    reduction->all_reduce_max(whole);
    amax = whole.to(amax.scalar_type());
  }
  const at::Tensor scale = amax_to_scale(amax, c.dtype, power_of_two_scales);
  return {scaled_cast(x, scale, c.dtype, column_major), scale};
}

namespace {

at::Tensor aten_scaled_cast(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  const double limit = format_max(dtype);
  // Saturating: values beyond the format's largest finite one become it.
  return (x.to(at::kFloat) * scale).clamp(-limit, limit).to(dtype);
}

#ifdef TITAN_WITH_CUDA
// The fused cast's first-call checks, per input dtype (float32, bf16), format (E4M3, E5M2), layout (as read,
// transposed) and scale (per tensor, per row, per column of the matrix the kernel reads): the kernel's bytes against
// the ATen composition's on that call's whole tensor.
enum FusedCastState : int { kUnchecked = 0, kChecking = 1, kAgreed = 2, kDisagreed = 3 };
std::atomic<int> g_fused_cast[2][2][2][3];
std::mutex g_fused_cast_lines_mutex;
std::vector<std::string> g_fused_cast_lines;  // guarded by the mutex

// One pass over a float32 or bf16 matrix on an NVIDIA GPU (kernels/cuda), the scale read on the device; undefined
// where the kernel does not take these tensors (then the ATen composition runs).
at::Tensor fused_scaled_cast(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype, bool column_major) {
  if (!x.is_cuda() || x.dim() != 2 || x.numel() == 0 || !kernels::fused_kernels_enabled()) return {};
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) return {};
  if (dtype != at::kFloat8_e4m3fn && dtype != at::kFloat8_e5m2) return {};
  if (!scale.defined() || scale.scalar_type() != at::kFloat || scale.device() != x.device() || scale.dim() > 2) return {};
  const int64_t rows = x.size(0), cols = x.size(1);
  // The scale's steps along x's rows and columns: one per tensor, per row (rows x 1) or per column (1 x cols).
  int64_t row_step = 0, col_step = 0;
  if (scale.numel() != 1) {
    if (scale.dim() != 2 || !scale.is_contiguous()) return {};
    if (scale.size(0) == rows && scale.size(1) == 1) row_step = 1;
    else if (scale.size(0) == 1 && scale.size(1) == cols) col_step = 1;
    else return {};
  }
  // The kernel reads a row-major matrix: x itself, or the contiguous matrix x is the transpose of.
  const bool flip = !x.is_contiguous();
  if (flip && !x.t().is_contiguous()) return {};
  const at::Tensor base = flip ? x.t() : x;
  kernels::cuda::Float8Cast c;
  c.rows = base.size(0);
  c.cols = base.size(1);
  c.scale_row_stride = flip ? col_step : row_step;
  c.scale_col_stride = flip ? row_step : col_step;
  c.e4m3 = dtype == at::kFloat8_e4m3fn;
  // Physically row-major in x's shape when !column_major, else in its transpose's.
  c.transpose = flip != column_major;
  const int scale_kind = c.scale_row_stride ? 1 : c.scale_col_stride ? 2 : 0;
  std::atomic<int>& state = g_fused_cast[x.scalar_type() == at::kBFloat16][c.e4m3][c.transpose][scale_kind];
  int now = state.load();
  if (now == kDisagreed || now == kChecking) return {};
  if (now == kUnchecked && !state.compare_exchange_strong(now, kChecking)) return {};
  // A check cut short by an error (out of memory, a failed launch) is taken again by a later call.
  struct Unclaim {
    std::atomic<int>& state;
    bool armed;
    ~Unclaim() {
      if (armed) state = kUnchecked;
    }
  } unclaim{state, now == kUnchecked};
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(c.transpose ? std::vector<int64_t>{c.cols, c.rows} : std::vector<int64_t>{c.rows, c.cols},
                             x.options().dtype(dtype));
  const float* scale_ptr = scale.data_ptr<float>();
  auto* out_ptr = static_cast<uint8_t*>(out.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t error =
      x.scalar_type() == at::kFloat
          ? kernels::cuda::scaled_cast_float8(c, base.data_ptr<float>(), scale_ptr, out_ptr, stream)
          : kernels::cuda::scaled_cast_float8(c, reinterpret_cast<const uint16_t*>(base.data_ptr()), scale_ptr, out_ptr, stream);
  TORCH_CHECK(error == cudaSuccess, "titan's CUDA kernel for the float8 cast failed to launch: ", cudaGetErrorString(error));
  // In x's shape: the output is x-shaped as laid out exactly when it was not transposed relative to x's own rows.
  if (c.transpose != flip) out = out.t();
  if (now == kUnchecked) {
    at::Tensor expected = aten_scaled_cast(x, scale, dtype);
    const bool agreed = at::equal(out.view(at::kByte), expected.view(at::kByte));
    const char* scale_name[] = {"", ", per-row scales", ", per-column scales"};
    const std::string line = cat("CUDA kernel float8 cast (", x.scalar_type() == at::kBFloat16 ? "bf16" : "float32", " to ",
                                 c.e4m3 ? "E4M3" : "E5M2", c.transpose ? ", transposed" : "", scale_name[scale_kind], "): ",
                                 agreed ? "equals" : "DIFFERS from", " the ATen composition bit for bit on its first call");
    {
      const std::lock_guard lock(g_fused_cast_lines_mutex);
      g_fused_cast_lines.push_back(line);
    }
    state = agreed ? kAgreed : kDisagreed;
    unclaim.armed = false;
    if (agreed) {
      log::info(line);
    } else {
      TORCH_CHECK(!kernels::cuda_checks_strict(), line, " (strict checks: no fallback)");
      log::warn(line, "; titan casts through ATen instead for the rest of this run. Please report this with the GPU and ",
                "the CUDA version.");
      if (column_major && !expected.t().is_contiguous()) expected = expected.t().contiguous().t();
      return expected;
    }
  }
  return out;
}
#endif

}  // namespace

std::vector<std::string> fused_cast_checks() {
#ifdef TITAN_WITH_CUDA
  const std::lock_guard lock(g_fused_cast_lines_mutex);
  return g_fused_cast_lines;
#else
  return {};
#endif
}

at::Tensor scaled_cast(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype, bool column_major) {
  NoAutocast no_autocast;
  at::NoGradGuard no_grad;
#ifdef TITAN_WITH_CUDA
  if (at::Tensor fused = fused_scaled_cast(x, scale, dtype, column_major); fused.defined()) return fused;
#endif
  at::Tensor out = aten_scaled_cast(x, scale, dtype);
  if (column_major && out.dim() == 2 && !out.t().is_contiguous()) out = out.t().contiguous().t();
  return out;
}

at::Tensor mm(const Operand& a, const Operand& b, at::ScalarType out_dtype, bool emulate, bool fast_accumulation) {
  TORCH_CHECK(a.quantized() == b.quantized(), "float8::mm: one operand quantized and the other not");
  NoAutocast no_autocast;
  if (!a.quantized()) return nn::mm(a.data, b.data).to(out_dtype);
  if (emulate || !a.data.is_cuda()) {
    // Dequantised to float32 and multiplied there (torchao's emulation, operation for operation).
    return at::mm(a.data.to(at::kFloat) / a.scale, b.data.to(at::kFloat) / b.scale).to(out_dtype);
  }
  // at::_scaled_mm: a row-major, b column-major, and the reciprocal scales.
  at::Tensor a_data = a.data.is_contiguous() ? a.data : a.data.contiguous();
  at::Tensor b_data = b.data.t().is_contiguous() ? b.data : b.data.t().contiguous().t();
  const at::Tensor a_scale = matching_scale(a.scale, b.scale, a_data.size(0), true).reciprocal();
  at::Tensor b_scale = matching_scale(b.scale, a.scale, b_data.size(1), false).reciprocal();
  // The GPU kernels need the contraction (K) and the output's columns (N) in multiples of 16: a token count such as
  // a weight gradient's 999 is padded with zeros, which add nothing, and the padded columns are dropped. The padding
  // is done on the bytes (a float8 zero is all zero bits).
  const int64_t k = a_data.size(1), n = b_data.size(1), k16 = (k + 15) / 16 * 16, n16 = (n + 15) / 16 * 16;
  if (k16 != k || n16 != n) {
    a_data = at::constant_pad_nd(a_data.view(at::kByte), {0, k16 - k}).view(a_data.scalar_type());
    b_data = at::constant_pad_nd(b_data.t().view(at::kByte), {0, k16 - k, 0, n16 - n}).view(b_data.scalar_type()).t();
    if (b_scale.dim() == 2 && n16 != n) b_scale = at::constant_pad_nd(b_scale, {0, n16 - n}, 1.0);
  }
  const at::Tensor out = at::_scaled_mm(a_data, b_data, a_scale, b_scale, std::nullopt, std::nullopt, out_dtype, fast_accumulation);
  return n16 != n ? out.narrow(1, 0, n).contiguous() : out;
}

namespace {

thread_local std::vector<std::pair<at::Tensor, Operand>> precast_activations;

// The recipe casts an input (or output gradient) per tensor to `dtype` for both matmuls that take it.
bool both_tensorwise(const Cast& a, const Cast& b, at::ScalarType dtype) {
  return a.scaling == Scaling::tensorwise && b.scaling == Scaling::tensorwise && a.dtype == dtype && b.dtype == dtype;
}

}  // namespace

void register_precast(const at::Tensor& hp, Operand cast) {
  // A backward entry whose linear never came (nothing reads it) must not hold memory for ever.
  if (precast_activations.size() >= 64) precast_activations.erase(precast_activations.begin());
  precast_activations.emplace_back(hp, std::move(cast));
}

void unregister_precast(const at::Tensor& hp) {
  auto& v = precast_activations;
  v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& e) { return e.first.is_same(hp); }), v.end());
}

std::optional<Operand> find_precast(const at::Tensor& hp, bool remove) {
  auto& v = precast_activations;
  for (auto it = v.begin(); it != v.end(); ++it)
    if (it->first.is_same(hp)) {
      Operand found = it->second;
      if (remove) v.erase(it);
      return found;
    }
  return std::nullopt;
}

namespace {

struct PrecastInput : torch::CustomClassHolder {
  Operand input;
};

struct Float8Linear : torch::autograd::Function<Float8Linear> {
  // `kept`: the output op-level checkpointing kept from the forward (nn/kept_ops.h), returned instead of computed, with
  // backward as for a computed one; empty otherwise.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const Recipe& recipe,
                            bool emulate, const c10::intrusive_ptr<PrecastWeight>& precast,
                            const c10::intrusive_ptr<PrecastInput>& precast_input, const at::Tensor& kept) {
    const bool use_precast = precast && precast->weight.data.defined();
    // With the input cast before its all-gather, backward reads that cast, not the high-precision input.
    ctx->save_for_backward({precast_input ? at::Tensor() : x, weight});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    if (precast_input) {
      ctx->saved_data["x8"] = precast_input->input.data;
      ctx->saved_data["x8_scale"] = precast_input->input.scale;
    }
    ctx->saved_data["emulate"] = emulate;
    ctx->saved_data["recipe"] = recipe.name;
    if (use_precast) ctx->saved_data["precast"] = at::IValue::make_capsule(precast);
    const auto reduction = AmaxReductionScope::current();
    if (reduction) ctx->saved_data["amax_reduction"] = at::IValue::make_capsule(reduction);
    if (kept.numel() > 0) {
      check_kept_output("float8 linear", kept, x, weight.size(0), x.scalar_type());
      return kept;
    }
    const Recipe* r = &recipe;
    const int64_t k = x.size(-1);
    const at::Tensor x2 = x.reshape({-1, k});
    // Output = x W^T: contraction over K, the input per row (dim 1), W^T per column (dim 0). K is split over the
    // ranks of a row-parallel linear.
    const bool k_split = reduction && reduction->sharded_weight_dim == 1;
    const Operand xq = precast_input ? Operand{precast_input->input.data.reshape({-1, k}), precast_input->input.scale}
                                     : cast(x2, r->input, 1, r->power_of_two_scales, reduction.get(), k_split);
    const Operand wq = use_precast ? precast->weight.t()
                                   : cast(weight.t(), r->weight, 0, r->power_of_two_scales, reduction.get(), k_split, /*column_major=*/true);
    auto out_shape = x.sizes().vec();
    out_shape.back() = weight.size(0);
    return mm(xq, wq, x.scalar_type(), emulate, /*fast_accumulation=*/true).reshape(out_shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const bool emulate = ctx->saved_data["emulate"].toBool();
    const Recipe r = recipe(ctx->saved_data["recipe"].toStringRef());
    // An output gradient cast before its all-gather (the backward of a float8 reduce-scatter) serves both matmuls.
    std::optional<Operand> g_pre;
    if (both_tensorwise(r.grad_output, r.grad_output_for_grad_weight, at::kFloat8_e5m2)) g_pre = find_precast(grads[0], /*remove=*/true);
    c10::intrusive_ptr<AmaxReduction> reduction;
    if (ctx->saved_data.count("amax_reduction"))
      reduction = c10::static_intrusive_pointer_cast<AmaxReduction>(ctx->saved_data["amax_reduction"].toCapsule());
    const AmaxReduction* reduce = reduction.get();
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor g = grads[0].reshape({-1, n});
    at::Tensor dx, dw;
    Operand g_for_dx;
    if (ctx->needs_input_grad(0)) {
      // dx = g W: contraction over N, g per row, W (kept as W^T, cast per row of W^T) per column. N is split over the
      // ranks of a column-parallel linear.
      const bool n_split = reduce && reduce->sharded_weight_dim == 0;
      const Operand gq = g_pre ? Operand{g_pre->data.reshape({-1, n}), g_pre->scale} : cast(g, r.grad_output, 1, r.power_of_two_scales, reduce, n_split);
      Operand wq;
      if (ctx->saved_data.count("precast")) {
        // The tensorwise cast of W the forward used: the same scale and values as casting W^T per tensor here.
        auto precast = c10::static_intrusive_pointer_cast<PrecastWeight>(ctx->saved_data["precast"].toCapsule());
        if (!precast->weight.data.defined())
          fail("float8: a linear's float8 weight (FSDP's float8 all-gather) was released before its backward");
        wq = precast->weight;
      } else {
        wq = cast(weight.t(), r.weight_for_grad_input, 1, r.power_of_two_scales, reduce, n_split).t();
      }
      dx = mm(gq, wq, grads[0].scalar_type(), emulate, false).reshape(x_sizes);
      g_for_dx = gq;
    }
    if (ctx->needs_input_grad(1)) {
      // dW = g^T x: contraction over the tokens, g and x per column. Every rank holds all the tokens (sequence
      // parallelism gathers them before the matmuls), so no per-column amax is reduced.
      // Both operands column-major as cast (g^T then reads row-major): at::_scaled_mm takes them without a copy. A
      // per-tensor cast of g that equals the one dx's matmul made reuses its scale (one amax, two layouts). Under a
      // zero-bubble schedule's input-gradient step it runs later, in the weight step (nn/weight_gradients.h), from
      // what it reads here.
      const Cast& gc = r.grad_output_for_grad_weight;
      const bool same_g_cast = g_for_dx.quantized() && gc.scaling == Scaling::tensorwise &&
                               r.grad_output.scaling == gc.scaling && r.grad_output.dtype == gc.dtype;
      std::optional<Operand> x8;
      if (ctx->saved_data.count("x8")) x8 = Operand{ctx->saved_data["x8"].toTensor().reshape({-1, k}), ctx->saved_data["x8_scale"].toTensor()};
      const at::Tensor g_scale = same_g_cast ? g_for_dx.scale : at::Tensor();
      // What it reads, and nothing more (a deferred one holds it until the weight step): the output gradient's
      // float8 cast when one came with it, else the gradient; the input's float8 cast when one was saved, else the input.
      const at::Tensor g_high = g_pre ? at::Tensor() : g, x_high = x8 ? at::Tensor() : x;
      const at::ScalarType out_dtype = grads[0].scalar_type(), weight_dtype = weight.scalar_type();
      const auto weight_gradient = [=] {
        Operand gq;
        if (g_pre) {
          gq = Operand{g_pre->data.reshape({-1, n}), g_pre->scale};
        } else if (same_g_cast) {
          gq = Operand{scaled_cast(g_high, g_scale, gc.dtype, /*column_major=*/true), g_scale};
        } else {
          gq = cast(g_high, gc, 0, r.power_of_two_scales, reduction.get(), false, /*column_major=*/true);
        }
        gq = gq.t();
        const Operand xq = x8 ? *x8
                              : cast(x_high.reshape({-1, k}), r.input_for_grad_weight, 0, r.power_of_two_scales, reduction.get(),
                                     false, /*column_major=*/true);
        return mm(gq, xq, out_dtype, emulate, false).to(weight_dtype);
      };
      if (!defer_weight_gradient(weight, weight_gradient)) dw = weight_gradient();
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const Recipe& recipe, bool emulate,
                  const c10::intrusive_ptr<PrecastWeight>& precast, const at::Tensor& kept) {
  if (precast && precast->weight.data.defined() && recipe.name != "tensorwise")
    fail("float8: a weight cast before its linear (FSDP's float8 all-gather) needs recipe \"tensorwise\", not ", quote(recipe.name));
  // Under autocast the input is first cast to the autocast dtype, as torchao's Float8Linear does; the weight is
  // cast to float8 from whatever dtype it has (the float32 master, or FSDP's gathered bf16 copy).
  c10::intrusive_ptr<PrecastInput> precast_input;
  if (both_tensorwise(recipe.input, recipe.input_for_grad_weight, at::kFloat8_e4m3fn))
    if (auto found = find_precast(x, /*remove=*/false)) {
      precast_input = c10::make_intrusive<PrecastInput>();
      precast_input->input = *found;
    }
  const auto device = x.device().type();
  const at::Tensor none = kept.defined() ? kept : at::empty({0}, x.options());
  if (at::autocast::is_autocast_enabled(device) && at::isFloatingType(x.scalar_type()))
    return Float8Linear::apply(x.to(at::autocast::get_autocast_dtype(device)), weight, recipe, emulate, precast, precast_input, none);
  return Float8Linear::apply(x, weight, recipe, emulate, precast, precast_input, none);
}

const std::vector<std::string>& mx_recipe_names() {
  static const std::vector<std::string> names = {"mxfp8_cublas", "mxfp8_cublas_rceil", "mxfp8_emulated"};
  return names;
}

MxScaleRounding mx_recipe(const std::string& name) {
  if (name == "mxfp8_cublas" || name == "mxfp8_emulated") return MxScaleRounding::floor;
  if (name == "mxfp8_cublas_rceil") return MxScaleRounding::rceil;
  fail("quantize.linear.mx.recipe_name = ", quote(name), " is not an MX recipe titan runs; expected one of ", join(mx_recipe_names(), ", "));
}

namespace {

constexpr int64_t kMxBlock = 32;
constexpr int64_t kE8M0Bias = 127;
constexpr int64_t kE8M0Nan = 255;

}  // namespace

MxOperand mx_cast(const at::Tensor& x, MxScaleRounding rounding) {
  NoAutocast no_autocast;
  at::NoGradGuard no_grad;
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kMxBlock == 0, "mx_cast: expected a 2-D tensor whose rows divide into blocks of 32, got ",
              x.sizes());
  const int64_t rows = x.size(0), cols = x.size(1);
  const at::Tensor blocks = x.contiguous().view({rows, cols / kMxBlock, kMxBlock});
  const at::Tensor amax = blocks.abs().amax({-1}, /*keepdim=*/true).to(at::kFloat);
  const at::Tensor values = blocks.to(at::kFloat);
  const double limit = format_max(at::kFloat8_e4m3fn);
  at::Tensor exponent, scaled;
  if (rounding == MxScaleRounding::floor) {
    // The amax's own power of two (its float32 exponent field), less E4M3's largest (2^8), within E8M0's range.
    const at::Tensor power = at::bitwise_and(at::bitwise_right_shift(amax.view(at::kInt), 23), 0xFF) - kE8M0Bias;
    at::Tensor biased = ((power - 8).clamp(-kE8M0Bias, kE8M0Bias + 1) + kE8M0Bias).to(at::kByte);
    biased = at::where(at::isnan(amax), at::scalar_tensor(kE8M0Nan, biased.options()), biased);
    // The scale as a float32 with that exponent field, at least the smallest normal float32.
    const at::Tensor scale = at::bitwise_left_shift(biased.to(at::kInt), 23).view(at::kFloat).clamp_min(std::ldexp(1.0, -126));
    exponent = biased;
    scaled = values / scale;
  } else {
    // The smallest power of two at least amax / 448 (cuBLAS's rounding of the scale), as its reciprocal.
    const at::Tensor descale = amax / limit;
    const at::Tensor normal = (at::ceil(at::log2(descale)).clamp(-kE8M0Bias, kE8M0Bias) + kE8M0Bias).to(at::kByte);
    exponent = at::where(at::isnan(descale), at::scalar_tensor(kE8M0Nan, normal.options()),
                         at::where(at::isinf(descale), at::scalar_tensor(254, normal.options()), normal));
    const at::Tensor reciprocal =
        at::where(exponent == kE8M0Nan, descale,
                  at::where(exponent == 254, at::scalar_tensor(std::ldexp(1.0, -127), descale.options()),
                            at::where(exponent == 0, at::scalar_tensor(1.0, descale.options()),
                                      at::exp2(kE8M0Bias - exponent.to(at::kFloat)))));
    scaled = values * reciprocal;
  }
  const at::Tensor data = scaled.clamp(-limit, limit).to(at::kFloat8_e4m3fn).view({rows, cols});
  return {data, exponent.view({rows, cols / kMxBlock})};
}

at::Tensor mx_dequantize(const MxOperand& a, at::ScalarType dtype) {
  NoAutocast no_autocast;
  at::NoGradGuard no_grad;
  const int64_t rows = a.data.size(0), cols = a.data.size(1);
  at::Tensor scale = at::pow(at::full_like(a.exponent, 2.0, a.exponent.options().dtype(at::kFloat)), a.exponent.to(at::kShort) - kE8M0Bias);
  scale = at::where(a.exponent != kE8M0Nan, scale, at::scalar_tensor(std::numeric_limits<float>::quiet_NaN(), scale.options()));
  return (a.data.to(dtype).view({rows, cols / kMxBlock, kMxBlock}) * scale.to(dtype).unsqueeze(-1)).view({rows, cols});
}

at::Tensor mx_blocked_scales(const at::Tensor& exponent) {
  at::NoGradGuard no_grad;
  const int64_t rows = exponent.size(0), cols = exponent.size(1);
  const int64_t row_tiles = (rows + 127) / 128, col_tiles = (cols + 3) / 4;
  at::Tensor padded = at::zeros({row_tiles * 128, col_tiles * 4}, exponent.options().dtype(at::kByte));
  padded.narrow(0, 0, rows).narrow(1, 0, cols).copy_(exponent);
  // [tile row, 128, tile column, 4] -> tiles in order, each [4 groups of 32 rows, 32, 4] -> [32, 4 groups, 4].
  const at::Tensor tiles = padded.view({row_tiles, 128, col_tiles, 4}).permute({0, 2, 1, 3}).reshape({-1, 4, 32, 4});
  return tiles.transpose(1, 2).contiguous().view({-1}).view(at::kFloat8_e8m0fnu);
}

namespace {

// a [M, K] (blocks along K) @ b^T where b is [N, K] (blocks along K), in `dtype`: torchao's emulated MX matmul
// (dequantised, multiplied in `dtype`), or LibTorch's blockwise-scaled one (a row-major, b column-major, the block
// exponents in cuBLAS's layout).
at::Tensor mx_mm_nt(const MxOperand& a, const MxOperand& b, at::ScalarType dtype, bool emulate) {
  NoAutocast no_autocast;
  if (emulate || !a.data.is_cuda()) return at::mm(mx_dequantize(a, dtype), mx_dequantize(b, dtype).t());
  return at::_scaled_mm(a.data, b.data.t(), mx_blocked_scales(a.exponent), mx_blocked_scales(b.exponent), std::nullopt,
                        std::nullopt, dtype, /*use_fast_accum=*/false);
}

struct MxLinear : torch::autograd::Function<MxLinear> {
  // `kept`: as Float8Linear's.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, int64_t rounding, bool emulate,
                            const at::Tensor& kept) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["rounding"] = rounding;
    ctx->saved_data["emulate"] = emulate;
    if (kept.numel() > 0) {
      check_kept_output("MXFP8 linear", kept, x, weight.size(0), x.scalar_type());
      return kept;
    }
    const auto r = static_cast<MxScaleRounding>(rounding);
    const int64_t k = x.size(-1);
    auto out_shape = x.sizes().vec();
    out_shape.back() = weight.size(0);
    // Output = x W^T: both along K.
    return mx_mm_nt(mx_cast(x.reshape({-1, k}), r), mx_cast(weight, r), x.scalar_type(), emulate).reshape(out_shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const auto r = static_cast<MxScaleRounding>(ctx->saved_data["rounding"].toInt());
    const bool emulate = ctx->saved_data["emulate"].toBool();
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor g = grads[0].contiguous().reshape({-1, n});
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0))  // dx = g W: g along N, W^T along N
      dx = mx_mm_nt(mx_cast(g, r), mx_cast(weight.t().contiguous(), r), g.scalar_type(), emulate).reshape(x.sizes());
    if (ctx->needs_input_grad(1)) {  // dW = g^T x: both along the tokens (later, under a zero-bubble input-gradient step)
      const at::Tensor x2 = x.reshape({-1, k});
      if (x2.size(0) % kMxBlock != 0)
        fail("MXFP8 linears need a multiple of 32 tokens per matmul (the weight gradient's blocks run along the tokens); "
             "this one has ", x2.size(0), ": choose training.seq_len and training.local_batch_size so that each rank's "
             "micro-batch holds a multiple of 32 tokens");
      const auto weight_gradient = [g, x2, r, emulate, dtype = weight.scalar_type()] {
        return mx_mm_nt(mx_cast(g.t().contiguous(), r), mx_cast(x2.t().contiguous(), r), g.scalar_type(), emulate).to(dtype);
      };
      if (!defer_weight_gradient(weight, weight_gradient)) dw = weight_gradient();
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

namespace {

// An MX operand's values: `x` [rows, cols] cast in blocks of 32 along its rows and dequantised into `dtype`.
at::Tensor mx_values(const at::Tensor& x, MxScaleRounding r, at::ScalarType dtype) { return mx_dequantize(mx_cast(x, r), dtype); }

// `x` [rows, cols] cast along its rows as `cast` says (in blocks of 32, or one scale per row), dequantised into `dtype`.
// `row_split`: float8's rows are pieces of rows split over `reduction`'s ranks (each scale from the whole row's amax).
at::Tensor cast_values(const at::Tensor& x, GroupedCast cast, at::ScalarType dtype, const AmaxReduction* reduction = nullptr,
                       bool row_split = false) {
  if (cast == GroupedCast::float8_rowwise) {
    const Operand o = float8::cast(x, Cast{Scaling::axiswise, at::kFloat8_e4m3fn}, 1, /*power_of_two_scales=*/true,
                                   row_split ? reduction : nullptr, row_split);
    return (o.data.to(at::kFloat) / o.scale).to(dtype);  // a power-of-two scale: exact
  }
  return mx_values(x, cast == GroupedCast::mx_rceil ? MxScaleRounding::rceil : MxScaleRounding::floor, dtype);
}

// The rows [start, start + count) of `x` [M, D] transposed ([D, count]) and cast along the tokens. MXFP8's blocks of
// 32 start at the group's first row and the last one is filled with zeros (torchao pads each expert's tokens to a
// multiple of 32 with zero rows, which change no block's amax), and the zeros stay: the weight gradient's product
// then runs over the same padded length as torchao's, whose accumulation order some CPU kernels choose by that
// length (oneDNN's AMX ones; on AVX-512 BF16 without AMX the unpadded product was bitwise the same). float8's
// scales are over the group's tokens.
at::Tensor group_along_tokens(const at::Tensor& x, int64_t start, int64_t count, GroupedCast cast, at::ScalarType dtype) {
  if (cast == GroupedCast::float8_rowwise) return cast_values(x.narrow(0, start, count).t().contiguous(), cast, dtype);
  const int64_t padded = (count + kMxBlock - 1) / kMxBlock * kMxBlock;
  at::Tensor t = at::zeros({x.size(1), padded}, x.options());
  t.narrow(1, 0, count).copy_(x.narrow(0, start, count).t());
  return cast_values(t, cast, dtype);
}

// MXFP8 multiplies the dequantised values in x's dtype (torchao's emulation), float8 in float32 (a scaled matmul's
// accumulation), the result rounded to x's dtype.
at::ScalarType product_dtype(GroupedCast cast, at::ScalarType x_dtype) {
  return cast == GroupedCast::float8_rowwise ? at::kFloat : x_dtype;
}

// `out` [tokens, n] in x's dtype: rows of each expert = a's rows times b[e]^T (a [tokens, k], b [experts, n, k]).
void per_expert_nt(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const int64_t* count, int64_t experts) {
  for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
    if (count[e] == 0) continue;
    at::Tensor rows = out.narrow(0, start, count[e]);
    rows.copy_(at::mm(a.narrow(0, start, count[e]), b[e].t()));
  }
}

struct LowPrecisionGroupedLinear : torch::autograd::Function<LowPrecisionGroupedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, int64_t cast_id,
                            const c10::intrusive_ptr<AmaxReduction>& reduction) {
    ctx->save_for_backward({x, w, counts});
    ctx->saved_data["cast"] = cast_id;
    if (reduction) ctx->saved_data["amax_reduction"] = at::IValue::make_capsule(reduction);
    NoAutocast no_autocast;
    const auto cast = static_cast<GroupedCast>(cast_id);
    const auto dtype = product_dtype(cast, x.scalar_type());
    const int64_t experts = w.size(0), n = w.size(1), k = w.size(2);
    const bool k_split = reduction && reduction->sharded_weight_dim == 1;
    const at::Tensor xq = cast_values(x, cast, dtype, reduction.get(), k_split);  // along K
    const at::Tensor wq = cast_values(w.reshape({experts * n, k}), cast, dtype, reduction.get(), k_split).view({experts, n, k});
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    per_expert_nt(out, xq, wq, counts.data_ptr<int64_t>(), experts);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &counts = saved[2];
    const auto cast = static_cast<GroupedCast>(ctx->saved_data["cast"].toInt());
    c10::intrusive_ptr<AmaxReduction> reduction;
    if (ctx->saved_data.count("amax_reduction"))
      reduction = c10::static_intrusive_pointer_cast<AmaxReduction>(ctx->saved_data["amax_reduction"].toCapsule());
    NoAutocast no_autocast;
    const int64_t experts = w.size(0), n = w.size(1), k = w.size(2);
    const at::Tensor g = grads[0].contiguous();
    const auto dtype = product_dtype(cast, g.scalar_type());
    const int64_t* count = counts.data_ptr<int64_t>();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {  // dx = g W[e]: g along N, W[e] along N (its columns)
      const bool n_split = reduction && reduction->sharded_weight_dim == 0;
      const at::Tensor gq = cast_values(g, cast, dtype, reduction.get(), n_split);
      const at::Tensor wq = cast_values(w.transpose(1, 2).contiguous().view({experts * k, n}), cast, dtype, reduction.get(), n_split)
                                .view({experts, k, n});
      dx = at::empty({g.size(0), k}, g.options());
      per_expert_nt(dx, gq, wq, count, experts);
      dx = dx.to(x.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {  // dW[e] = g_e^T x_e: both along the expert's tokens
      dw = at::zeros({experts, n, k}, g.options());  // experts without tokens keep a zero gradient
      const at::Tensor xg = x.to(g.scalar_type());
      for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
        if (count[e] == 0) continue;
        dw[e].copy_(at::mm(group_along_tokens(g, start, count[e], cast, dtype), group_along_tokens(xg, start, count[e], cast, dtype).t()));
      }
      dw = dw.to(w.scalar_type());
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, GroupedCast cast,
                          const c10::intrusive_ptr<AmaxReduction>& reduction) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), "grouped_linear: expected x [tokens, K] and w [experts, N, K], got ",
              x.sizes(), " and ", w.sizes());
  const bool mx = cast != GroupedCast::float8_rowwise;
  const int64_t unit = mx ? kMxBlock : 16;
  if (w.size(1) % unit != 0 || w.size(2) % unit != 0)
    fail(mx ? "MXFP8" : "float8", " grouped matmuls need expert weights whose two dimensions divide by ", unit, mx ? " (MX blocks)" : "",
         "; this one is ", w.size(1), " x ", w.size(2), " (per rank): remove its MoE layer from quantize.grouped_mm.",
         mx ? "mx" : "float8", ".fqns or choose widths that divide by ", unit);
  const at::Tensor c = counts.to(at::kCPU).to(at::kLong).contiguous();
  TORCH_CHECK(c.numel() == w.size(0), "grouped_linear: ", c.numel(), " token counts for ", w.size(0), " experts");
  return LowPrecisionGroupedLinear::apply(x, w.to(x.scalar_type()), c, static_cast<int64_t>(cast), reduction);
}

at::Tensor mx_linear(const at::Tensor& x, const at::Tensor& weight, MxScaleRounding rounding, bool emulate, const at::Tensor& kept) {
  // Under autocast the input is cast to the autocast dtype first; the weight's values are cast to the input's dtype
  // after dequantising (exactly: E4M3 values times powers of two fit bf16).
  const auto device = x.device().type();
  const at::Tensor input = at::autocast::is_autocast_enabled(device) && at::isFloatingType(x.scalar_type())
                               ? x.to(at::autocast::get_autocast_dtype(device))
                               : x;
  return MxLinear::apply(input, weight, static_cast<int64_t>(rounding), emulate, kept.defined() ? kept : at::empty({0}, x.options()));
}

bool has_mx_matmul(const at::Device& device, std::string* why) {
  if (device.is_cuda()) {
#ifdef TITAN_WITH_CUDA
    const auto* properties = at::cuda::getDeviceProperties(device.index());
    if (properties->major >= 10) return true;
    if (why) *why = cat(properties->name, " (compute capability ", properties->major, ".", properties->minor,
                        ") has no blockwise-scaled MX matmul; it starts at 10.0 (Blackwell)");
    return false;
#else
    if (why) *why = "this build of titan has no CUDA";
    return false;
#endif
  }
  if (why) *why = cat("the ", device.str(), " has no blockwise-scaled MX matmul (LibTorch's needs NVIDIA compute capability 10.0 or newer)");
  return false;
}

bool has_float8_matmul(const at::Device& device, std::string* why) {
  if (device.is_cuda()) {
#ifdef TITAN_WITH_CUDA
    const auto* properties = at::cuda::getDeviceProperties(device.index());
    if (properties->major > 8 || (properties->major == 8 && properties->minor >= 9)) return true;
    if (why) *why = cat(properties->name, " (compute capability ", properties->major, ".", properties->minor,
                        ") has no float8 tensor cores; they start at 8.9 (Ada, Hopper and newer)");
    return false;
#else
    if (why) *why = "this build of titan has no CUDA";
    return false;
#endif
  }
  if (why) *why = cat("the ", device.str(), " has no float8 matmul titan uses (LibTorch's CPU at::_scaled_mm is a reference loop)");
  return false;
}

}  // namespace titan::nn::float8
