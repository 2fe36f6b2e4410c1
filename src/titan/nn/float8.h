// Float8 linear layers with torchao's dynamic scaling (the library torchtitan's float8 converter uses): each operand
// of each of a linear's three matmuls (the output, the input gradient, the weight gradient) is cast as its recipe
// says -- per tensor or per row along the matmul's contraction dimension, to E4M3 or E5M2, or left in high
// precision -- with scale = max_of_format / max(amax, 1e-12) computed in float64 and kept in float32 (rounded down
// to a power of two for the rowwise recipes) and a saturating cast; the product gets the reciprocal scales.
//
// Where the matmul runs: LibTorch's at::_scaled_mm on CUDA devices with float8 tensor cores (compute capability 8.9
// and newer); everywhere else, and whenever `emulate` is set, the emulation torchao uses for its own tests: the
// float8 values dequantised to float32 and multiplied in float32. LibTorch 2.15 also has a CPU at::_scaled_mm, but it
// is a reference loop (measured on 2026-11-27 below 0.1 GFLOP/s at 1024^3, against about 50 for the emulation on
// the same 2 cores), so the CPU emulates. See docs/float8.md.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace titan::nn::float8 {

// The name of the wrapper the float8 converter gives the linear units it converts (nn/unit.h).
inline constexpr const char* kWrapperName = "float8";

// How one operand is cast (torchao's CastConfig).
enum class Scaling { high_precision, tensorwise, axiswise };
struct Cast {
  Scaling scaling = Scaling::tensorwise;
  at::ScalarType dtype = at::kFloat8_e4m3fn;
};

// torchao's recipes: the casts of every operand of the three matmuls.
struct Recipe {
  std::string name;
  Cast input, weight, grad_output;                                               // output and input gradient
  Cast input_for_grad_weight, weight_for_grad_input, grad_output_for_grad_weight;
  bool power_of_two_scales = false;
};
// "tensorwise", "rowwise" or "rowwise_with_gw_hp"; UserError naming the others.
Recipe recipe(const std::string& name);
const std::vector<std::string>& recipe_names();

// A cast operand: `data` (float8, or the high-precision tensor itself) and the scale that multiplied it (float32: a
// scalar, or keepdim-shaped along the reduced dimension); data / scale approximates the original.
struct Operand {
  at::Tensor data, scale;
  bool quantized() const { return scale.defined(); }
  Operand t() const { return {data.t(), scale.defined() && scale.dim() == 2 ? scale.t() : scale}; }
};

// `x` times `scale`, saturated to the format's largest finite value and cast to `dtype` (a float8 format).
// With `column_major` a 2-D result is laid out column-major (its transpose contiguous), as at::_scaled_mm wants its
// second operand. On NVIDIA GPUs one fused kernel does the cast (checked bit for bit against the ATen composition on
// its first call per input dtype, format, layout and kind of scale; training.fused_kernels = false turns it off).
at::Tensor scaled_cast(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype, bool column_major = false);
// The fused cast's first-call checks so far in this process, one line each; empty on the CPU.
std::vector<std::string> fused_cast_checks();
// Tensor parallelism: a linear whose weight and activations are split over ranks takes each per-tensor scale from
// the amax of the whole tensor, and each per-row scale from the amax of the whole row, as torchao's casts of DTensors
// do; `all_reduce_max` reduces a rank's amax over the ranks. A row is split only along the weight's split dimension
// (`sharded_weight_dim`: 0, the output features, for a column-parallel linear, whose input gradient's matmul contracts
// over them; 1, the input features, for a row-parallel one, whose output's matmul does), so only the casts of that
// matmul reduce their per-row amaxes. TP's wrappers set one around a linear's call (AmaxReductionScope); the float8
// linear keeps it for backward.
struct AmaxReduction : torch::CustomClassHolder {
  AmaxReduction(std::function<void(at::Tensor&)> f, int64_t sharded_dim) : all_reduce_max(std::move(f)), sharded_weight_dim(sharded_dim) {}
  std::function<void(at::Tensor&)> all_reduce_max;
  int64_t sharded_weight_dim;
};
class AmaxReductionScope {
 public:
  explicit AmaxReductionScope(c10::intrusive_ptr<AmaxReduction> reduction);
  ~AmaxReductionScope();
  AmaxReductionScope(const AmaxReductionScope&) = delete;
  AmaxReductionScope& operator=(const AmaxReductionScope&) = delete;
  // The innermost scope's reduction on this thread, or null.
  static c10::intrusive_ptr<AmaxReduction> current();

 private:
  c10::intrusive_ptr<AmaxReduction> outer_;
};

// Casts a 2-D `x` as `cast` says; axiswise scales reduce over dimension `dim` (the contraction dimension of the
// matmul the operand is for). A per-tensor amax goes through `reduction` when given, a per-row one when
// `contraction_split` too (dimension `dim` is split over the reduction's ranks).
Operand cast(const at::Tensor& x, const Cast& cast, int64_t dim, bool power_of_two_scales, const AmaxReduction* reduction = nullptr,
             bool contraction_split = false, bool column_major = false);
// The scale of a tensor whose absolute maximum (per tensor, or keepdim along a dimension) is `amax`.
at::Tensor amax_to_scale(const at::Tensor& amax, at::ScalarType float8_dtype, bool power_of_two);

// a [M, K] @ b [K, N] in `out_dtype`: both quantized (scaled matmul or its emulation) or both high precision.
at::Tensor mm(const Operand& a, const Operand& b, at::ScalarType out_dtype, bool emulate, bool fast_accumulation);

// A converted linear's weight cast to float8 before it reached the linear: FSDP's float8 all-gather casts each
// rank's shard with the scale of the whole weight and gathers the float8 bytes (distributed/fsdp.h). While the
// weight is gathered, `weight` holds the full [out, in] E4M3 tensor and its per-tensor scale; otherwise it is empty.
struct PrecastWeight : torch::CustomClassHolder {
  Operand weight;
};

// Activations cast before a collective (torchao's float8 tensor-parallel styles, distributed/functional_collectives.h):
// the high-precision tensor a collective returned, and the tensorwise cast it was made from (E4M3 for an input,
// E5M2 for an output gradient). A float8 linear that meets `hp` as its input (forward) or its output gradient
// (backward) uses `cast` instead of casting it again; a backward entry is removed when used, a forward one by
// unregister_precast. Per thread.
void register_precast(const at::Tensor& hp, Operand cast);
void unregister_precast(const at::Tensor& hp);
std::optional<Operand> find_precast(const at::Tensor& hp, bool remove);

// x [..., K] @ weight [N, K]^T with the recipe's casts, differentiable in x and weight. The output (and the input
// gradient) is in x's dtype, the weight gradient in the weight's. Saves x and weight for backward (as torchao).
// When `precast` holds a weight (recipe tensorwise only), the forward and the input gradient use it instead of
// casting `weight`, whose values are then never read (FSDP leaves it without storage): backward reads `precast`
// again, which FSDP has re-gathered by then.
// `kept`: under op-level activation checkpointing, the output the forward kept (nn/kept_ops.h), returned by the
// recomputation instead of computed again; its backward is the same.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const Recipe& recipe, bool emulate,
                  const c10::intrusive_ptr<PrecastWeight>& precast = {}, const at::Tensor& kept = {});

// MXFP8 (the OCP microscaling format torchao's MX linears use): blocks of 32 consecutive elements along a row, each
// with a power-of-two scale kept as its biased 8-bit exponent (E8M0), the elements in E4M3.
enum class MxScaleRounding {
  floor,  // torchao's FLOOR: the block amax's power of two minus E4M3's (8), so large values may saturate
  rceil,  // torchao's RCEIL (cuBLAS's): the smallest power of two with amax / 448 <= it
};
// "mxfp8_cublas" (floor), "mxfp8_cublas_rceil" (rceil) or "mxfp8_emulated" (floor); UserError naming the others.
MxScaleRounding mx_recipe(const std::string& name);
const std::vector<std::string>& mx_recipe_names();

struct MxOperand {
  at::Tensor data;      // E4M3, [rows, cols]
  at::Tensor exponent;  // uint8 biased exponents, [rows, cols / 32]; 255 marks a block with a NaN
};
// Casts a 2-D `x` (cols a multiple of 32) in blocks of 32 along each row, as torchao's to_mx.
MxOperand mx_cast(const at::Tensor& x, MxScaleRounding rounding);
// The values an MX operand stands for, in `dtype` (multiplied there, as torchao dequantizes).
at::Tensor mx_dequantize(const MxOperand& a, at::ScalarType dtype);

// The exponents of an MX operand [rows, cols / 32] in the layout LibTorch's blockwise-scaled matmul reads for blocks
// of 1 x 32 (cuBLAS's block-scaling-factor layout), as E8M0: padded with zeros to 128-row x 4-column tiles, the tiles
// stored one after the other (row by row), and within a tile the exponent of (row i, column j) at i % 32 * 16 +
// i / 32 * 4 + j.
at::Tensor mx_blocked_scales(const at::Tensor& exponent);

// x [..., K] @ weight [N, K]^T with every operand of the three matmuls cast to MXFP8 along its matmul's contraction
// dimension (K, N, and the tokens: their count must be a multiple of 32). Emulated (`emulate`, or a device without
// an MX matmul): dequantised and multiplied in the operands' dtype (torchao's emulated MX matmul); else through
// at::_scaled_mm with E8M0 block scales (accumulated in float32). Differentiable in x and weight.
at::Tensor mx_linear(const at::Tensor& x, const at::Tensor& weight, MxScaleRounding rounding, bool emulate = true,
                     const at::Tensor& kept = {});  // `kept` as linear's

// How a grouped product casts its operands (torchao's MoE training configurations).
enum class GroupedCast {
  mx_rceil,        // MXFP8, RCEIL scales: MXFP8TrainingOpConfig (quantize.grouped_mm.mx)
  mx_floor,        // MXFP8, FLOOR scales
  float8_rowwise,  // E4M3 with one power-of-two scale per row of each operand: Float8TrainingOpConfig
                   // (quantize.grouped_mm.float8)
};

// y = x W[e]^T for each expert's contiguous rows of x [tokens, K] (`counts` per expert), W [experts, N, K], with every
// operand of the three products cast along its contraction dimension: K for the output; N for the input gradient;
// each expert's own tokens for its weight gradient. The products run expert by expert on the dequantised values:
// - MXFP8: blocks of 32 along that dimension. The weight gradient's blocks start at the expert's first token, and
//   its last block is filled with zeros, as torchao's 32-row token groups are. The values are multiplied in x's dtype:
//   torchao's emulated MXFP8 grouped matmul. N and K must divide by 32.
// - float8 rowwise: one scale per row along that dimension (per expert's tokens for the weight gradient). The values
//   are multiplied in float32 and the result rounded to x's dtype: what the scaled grouped matmul computes, emulated.
//   N and K must divide by 16.
// Emulated on every device. W is cast to x's dtype first; the gradients come in x's and W's dtypes. A UserError
// names widths that do not divide.
// `reduction` (tensor parallelism, W's expert matrices split along `reduction->sharded_weight_dim` of [N, K]): the
// float8 casts whose rows run along the split dimension take each per-row scale over the whole row, their amax
// all-reduced: the output's (x and W along K) when K is split, the input gradient's (the output gradient and W along
// N) when N is. Every rank holds the same tokens, so the weight gradient's casts are local. MXFP8 ignores it: its
// blocks of 32 lie within a rank's piece.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, GroupedCast cast,
                          const c10::intrusive_ptr<AmaxReduction>& reduction = {});

// A unit whose experts run grouped matmuls (models/common/moe.h's GroupedExperts): the grouped-matmul converters
// (quantize.grouped_mm.mx / .float8) set how they run.
class GroupedMatmuls {
 public:
  virtual ~GroupedMatmuls() = default;
  std::optional<GroupedCast> low_precision;  // set: low-precision grouped matmuls (grouped_linear)
  // Tensor parallelism over the experts' hidden dimension: the amax reductions of the gate and up products (their
  // weights split along N) and of the down product (split along K), handed to grouped_linear. Null without it.
  c10::intrusive_ptr<AmaxReduction> gate_up_amax, down_amax;
};

// Whether `device` has the blockwise-scaled MX matmul titan uses (CUDA compute capability 10.0 or newer); when not,
// `why` says what it lacks.
bool has_mx_matmul(const at::Device& device, std::string* why);

// Whether `device` has a float8 matmul titan uses (CUDA compute capability 8.9 or newer); when not, `why` says
// what it lacks.
bool has_float8_matmul(const at::Device& device, std::string* why);

}  // namespace titan::nn::float8
