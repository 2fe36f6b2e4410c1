#include "titan/kernels/fused_ops.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/kernels/cpu_isa.h"
#include "titan/kernels/isa/kernels.h"
#include "titan/kernels/grouped_mm.h"
#include "titan/kernels/isa_call.h"

#ifdef TITAN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "titan/kernels/cuda/kernels.h"
#endif

namespace titan::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<bool> g_fused{true};

// A tensor's data as the kernels see it: float, or bf16 bits.
template <typename T>
T* data(const at::Tensor& t) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) return t.data_ptr<float>();
  else return reinterpret_cast<T*>(t.data_ptr<at::BFloat16>());
}

// Runs body.template operator()<T>() with T = float or uint16_t (bf16) after `dtype`.
template <typename Body>
void with_dtype(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kFloat) body.template operator()<float>();
  else body.template operator()<uint16_t>();
}

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Element strides of a (batch, heads, seq, head_dim) tensor in the kernels' (batch, seq, head) order.
void strides_bsh(const at::Tensor& t, int64_t* out) {
  out[0] = t.stride(0);
  out[1] = t.stride(2);
  out[2] = t.stride(1);
}

// (batch, heads, seq, head_dim) view of a new (batch, seq, heads, head_dim) tensor.
at::Tensor new_bhsd(const at::Tensor& like, int64_t heads) {
  return at::empty({like.size(0), like.size(2), heads, like.size(3)}, like.options()).transpose(1, 2);
}

#ifdef TITAN_WITH_CUDA
cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check_launch(cudaError_t error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "titan's CUDA kernel for ", what, " failed to launch: ", cudaGetErrorString(error));
}
#endif

// Splits [0, n) over the threads at multiples of 16 elements, so that which elements take a kernel's vector path
// (and its scalar tail) does not depend on the thread count.
template <typename F>
void for_each_vector_span(int64_t n, const F& f) {
  constexpr int64_t kSpan = 16;
  at::parallel_for(0, (n + kSpan - 1) / kSpan, 256, [&](int64_t begin, int64_t end) {
    f(begin * kSpan, std::min(end * kSpan, n));
  });
}

class Attention : public torch::autograd::Function<Attention> {
 public:
  // The output and the float32 log-sum-exp of every query row, without autograd.
  static std::pair<at::Tensor, at::Tensor> compute(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& documents) {
    isa::AttentionShape s = shape(q, k, v, documents);
    at::Tensor out = new_bhsd(q, s.heads);
    at::Tensor lse = at::empty({s.batch, s.heads, s.seq}, q.options().dtype(at::kFloat));
    strides_bsh(out, s.out_stride);
    const int64_t blocks = (s.seq + isa::kAttentionBlock - 1) / isa::kAttentionBlock;
    with_dtype(q.scalar_type(), [&]<typename T>() {
      const T *qp = data<const T>(q), *kp = data<const T>(k), *vp = data<const T>(v);
      T* op = data<T>(out);
      float* lp = lse.data_ptr<float>();
      at::parallel_for(0, s.batch * s.heads * blocks, 1, [&](int64_t begin, int64_t end) {
        TITAN_ISA_CALL(attention_forward, s, qp, kp, vp, op, lp, begin, end);
      });
    });
    return {out, lse};
  }

  // With `kept_out` and `kept_lse` non-empty (compute()'s results for these inputs, kept by op-level selective
  // checkpointing) the forward reuses them instead of computing again.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& documents, const at::Tensor& kept_out, const at::Tensor& kept_lse) {
    const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
    at::Tensor out, lse;
    if (kept_out.numel() > 0) {
      TORCH_CHECK(kept_out.sizes() == q.sizes() && kept_out.scalar_type() == q.scalar_type() &&
                      kept_lse.sizes() == q.sizes().slice(0, 3),
                  "attention: the kept output ", kept_out.sizes(), " does not belong to queries ", q.sizes());
      out = kept_out, lse = kept_lse;
    } else {
      std::tie(out, lse) = compute(q, k, v, documents);
    }
    ctx->save_for_backward({q, k, v, out, lse, documents});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_q, grad_k, grad_v] = gradients(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], grads[0]);
    return {grad_q, grad_k, grad_v, at::Tensor(), at::Tensor(), at::Tensor()};
  }

  // The gradients of q, k and v given the output and log-sum-exp of every query row (those compute() gave, or, for
  // context parallelism's chunk pairs, those combined over every key chunk): exp(score - lse) is the softmax.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> gradients(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  const at::Tensor& documents, const at::Tensor& grad) {
    const at::Tensor grad_out = last_dim_contiguous(grad.to(q.scalar_type()));
    isa::AttentionShape s = shape(q, k, v, documents);
    strides_bsh(out, s.out_stride);
    strides_bsh(grad_out, s.grad_out_stride);
    at::Tensor grad_q = new_bhsd(q, s.heads), grad_k = new_bhsd(k, s.kv_heads), grad_v = new_bhsd(v, s.kv_heads);
    strides_bsh(grad_q, s.grad_q_stride);
    strides_bsh(grad_k, s.grad_k_stride);
    strides_bsh(grad_v, s.grad_v_stride);
    with_dtype(q.scalar_type(), [&]<typename T>() {
      const T *qp = data<const T>(q), *kp = data<const T>(k), *vp = data<const T>(v), *op = data<const T>(out),
              *gp = data<const T>(grad_out);
      T *gq = data<T>(grad_q), *gk = data<T>(grad_k), *gv = data<T>(grad_v);
      const float* lp = lse.data_ptr<float>();
      at::parallel_for(0, s.batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
        TITAN_ISA_CALL(attention_backward, s, qp, kp, vp, op, gp, lp, gq, gk, gv, begin, end);
      });
    });
    return {grad_q, grad_k, grad_v};
  }

 private:
  static isa::AttentionShape shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents) {
    isa::AttentionShape s;
    s.batch = q.size(0);
    s.heads = q.size(1);
    s.kv_heads = k.size(1);
    s.seq = q.size(2);
    s.head_dim = q.size(3);
    s.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
    strides_bsh(q, s.q_stride);
    strides_bsh(k, s.k_stride);
    strides_bsh(v, s.v_stride);
    s.documents = documents.numel() > 0 ? documents.data_ptr<int32_t>() : nullptr;
    return s;
  }
};

class RmsNorm : public torch::autograd::Function<RmsNorm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
    const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
    const isa::RowsShape s{x.numel() / x.size(-1), x.size(-1)};
    at::Tensor y = at::empty_like(x);
    at::Tensor inv_rms = at::empty({s.rows}, x.options().dtype(at::kFloat));
    with_dtype(x.scalar_type(), [&]<typename T>() {
      const T *xp = data<const T>(x), *wp = data<const T>(weight);
      T* yp = data<T>(y);
      float* ip = inv_rms.data_ptr<float>();
      at::parallel_for(0, s.rows, 16, [&](int64_t begin, int64_t end) {
        TITAN_ISA_CALL(rms_norm_forward, s, xp, wp, static_cast<float>(eps), yp, ip, begin, end);
      });
    });
    ctx->save_for_backward({x, weight, inv_rms});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &inv_rms = saved[2];
    const at::Tensor grad_y = grads[0].to(x.scalar_type()).contiguous();
    const isa::RowsShape s{x.numel() / x.size(-1), x.size(-1)};
    at::Tensor grad_x = at::empty_like(x);
    // Each thread sums its rows' weight gradients into its own row; the rows are added at the end.
    at::Tensor partial = at::zeros({at::get_num_threads(), s.dim}, x.options().dtype(at::kFloat));
    with_dtype(x.scalar_type(), [&]<typename T>() {
      const T *xp = data<const T>(x), *wp = data<const T>(weight), *gp = data<const T>(grad_y);
      T* dx = data<T>(grad_x);
      const float* ip = inv_rms.data_ptr<float>();
      float* pp = partial.data_ptr<float>();
      const int64_t threads = partial.size(0);
      at::parallel_for(0, s.rows, 16, [&](int64_t begin, int64_t end) {
        const int64_t thread = at::get_thread_num();
        TORCH_CHECK(thread < threads, "fused RMSNorm backward: thread ", thread, " of ", threads);
        float* mine = pp + thread * s.dim;
        TITAN_ISA_CALL(rms_norm_backward, s, xp, wp, ip, gp, dx, mine, begin, end);
      });
    });
    return {grad_x, partial.sum(0).to(weight.scalar_type()), at::Tensor()};
  }
};

class SwiGlu : public torch::autograd::Function<SwiGlu> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_in, const at::Tensor& up_in) {
    const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
    at::Tensor out = at::empty_like(gate);
    with_dtype(gate.scalar_type(), [&]<typename T>() {
      const T *gp = data<const T>(gate), *up_p = data<const T>(up);
      T* op = data<T>(out);
#ifdef TITAN_WITH_CUDA
      if (gate.is_cuda()) {
        const c10::cuda::CUDAGuard guard(gate.device());
        return check_launch(cuda::swiglu_forward(gp, up_p, op, gate.numel(), stream()), "SwiGLU forward");
      }
#endif
      for_each_vector_span(gate.numel(), [&](int64_t begin, int64_t end) {
        TITAN_ISA_CALL(swiglu_forward, gp, up_p, op, begin, end);
      });
    });
    ctx->save_for_backward({gate, up});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const at::Tensor grad = grads[0].to(gate.scalar_type()).contiguous();
    at::Tensor grad_gate = at::empty_like(gate), grad_up = at::empty_like(up);
    with_dtype(gate.scalar_type(), [&]<typename T>() {
      const T *gp = data<const T>(gate), *up_p = data<const T>(up), *dp = data<const T>(grad);
      T *dg = data<T>(grad_gate), *du = data<T>(grad_up);
#ifdef TITAN_WITH_CUDA
      if (gate.is_cuda()) {
        const c10::cuda::CUDAGuard guard(gate.device());
        return check_launch(cuda::swiglu_backward(gp, up_p, dp, dg, du, gate.numel(), stream()), "SwiGLU backward");
      }
#endif
      for_each_vector_span(gate.numel(), [&](int64_t begin, int64_t end) {
        TITAN_ISA_CALL(swiglu_backward, gp, up_p, dp, dg, du, begin, end);
      });
    });
    return {grad_gate, grad_up};
  }
};

// Rotates q or k (batch, seq, heads, head_dim) by the table's angles, or back (inverse) for the gradient.
at::Tensor rotate(const at::Tensor& x_in, const at::Tensor& table, const at::Tensor& rows, bool inverse) {
  const at::Tensor x = last_dim_contiguous(x_in);
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2), x.size(3)}, x.options());
  isa::RopeShape s;
  s.batch = x.size(0);
  s.seq = x.size(1);
  s.heads = x.size(2);
  s.head_dim = x.size(3);
  for (int i = 0; i < 3; ++i) s.in_stride[i] = x.stride(i), s.out_stride[i] = out.stride(i);
  s.inverse = inverse;
  const float* tp = table.data_ptr<float>();
  const int64_t* rp = rows.numel() > 0 ? rows.data_ptr<int64_t>() : nullptr;
  with_dtype(x.scalar_type(), [&]<typename T>() {
    const T* xp = data<const T>(x);
    T* op = data<T>(out);
#ifdef TITAN_WITH_CUDA
    if (x.is_cuda()) {
      const c10::cuda::CUDAGuard guard(x.device());
      return check_launch(cuda::rope(s, table.size(0), tp, rp, xp, op, stream()), "RoPE");
    }
#endif
    at::parallel_for(0, s.batch * s.seq * s.heads, 64, [&](int64_t begin, int64_t end) {
      TITAN_ISA_CALL(rope, s, tp, rp, xp, op, begin, end);
    });
  });
  return out;
}

class Rope : public torch::autograd::Function<Rope> {
 public:
  // table: float (positions, head_dim / 2, 2); rows: int64 (batch, seq) table rows, or empty.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                               const at::Tensor& rows) {
    ctx->save_for_backward({table, rows});
    return {rotate(q, table, rows, false), rotate(k, table, rows, false)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {rotate(grads[0], saved[0], saved[1], true), rotate(grads[1], saved[0], saved[1], true), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

bool fused_kernels_enabled() { return g_fused.load(); }
void set_fused_kernels_enabled(bool enabled) { g_fused = enabled; }

namespace {

// The ATen compositions of the cross-entropy row passes (every device; the reference of the fused kernels).
CrossEntropyRowStats row_stats_aten(const at::Tensor& logits, const at::Tensor& local_label) {
  // One float32 temporary of the chunk, worked on in place.
  const at::Tensor here = local_label.ge(0);
  const at::Tensor column = at::where(here, local_label, at::zeros_like(local_label)).unsqueeze(1);
  const at::Tensor gathered = logits.gather(1, column).squeeze(1).to(at::kFloat);
  const at::Tensor target = at::where(here, gathered, at::zeros_like(gathered));
  at::Tensor max = std::get<0>(logits.max(1)).to(at::kFloat);
  max = at::where(max.isneginf(), at::zeros_like(max), max);  // a row of -inf sums to 0 without NaN
  const at::Tensor sum_exp = logits.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).sub_(max.unsqueeze(1)).exp_().sum(1);
  return {max.contiguous(), sum_exp.contiguous(), target.contiguous()};
}

void row_grad_aten_(const at::Tensor& logits, const at::Tensor& local_label, const at::Tensor& lse, const at::Tensor& scale) {
  at::Tensor grad = logits.to(at::kFloat).sub_(lse.unsqueeze(1)).exp_();  // float32 logits: in place
  const at::Tensor here = local_label.ge(0);
  grad.scatter_add_(1, at::where(here, local_label, at::zeros_like(local_label)).unsqueeze(1), here.to(at::kFloat).neg().unsqueeze(1));
  grad.mul_(scale.unsqueeze(1));
  logits.copy_(grad);
}

// The fused row passes on the CPU (kernels/isa) or a CUDA GPU (kernels/cuda).
CrossEntropyRowStats row_stats_fused(const at::Tensor& logits, const at::Tensor& local_label) {
  const at::Tensor x = logits.contiguous(), labels = local_label.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto f32 = x.options().dtype(at::kFloat);
  CrossEntropyRowStats out{at::empty({rows}, f32), at::empty({rows}, f32), at::empty({rows}, f32)};
  with_dtype(x.scalar_type(), [&]<typename T>() {
    const T* xp = data<const T>(x);
    const int64_t* lp = labels.data_ptr<int64_t>();
    float *mp = out.max.data_ptr<float>(), *sp = out.sum_exp.data_ptr<float>(), *tp = out.target.data_ptr<float>();
#ifdef TITAN_WITH_CUDA
    if (x.is_cuda()) {
      const c10::cuda::CUDAGuard guard(x.device());
      return check_launch(cuda::cross_entropy_stats(rows, vocab, xp, lp, mp, sp, tp, stream()), "cross-entropy row statistics");
    }
#endif
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      TITAN_ISA_CALL(cross_entropy_stats, vocab, xp, lp, mp, sp, tp, begin, end);
    });
  });
  return out;
}

// `logits` contiguous.
void row_grad_fused_(const at::Tensor& logits, const at::Tensor& local_label, const at::Tensor& lse, const at::Tensor& scale) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::Tensor labels = local_label.contiguous(), l = lse.contiguous(), sc = scale.contiguous();
  with_dtype(logits.scalar_type(), [&]<typename T>() {
    T* xp = data<T>(logits);
    const int64_t* lp = labels.data_ptr<int64_t>();
    const float *lsep = l.data_ptr<float>(), *scp = sc.data_ptr<float>();
#ifdef TITAN_WITH_CUDA
    if (logits.is_cuda()) {
      const c10::cuda::CUDAGuard guard(logits.device());
      return check_launch(cuda::cross_entropy_grad(rows, vocab, xp, lp, lsep, scp, stream()), "cross-entropy row gradient");
    }
#endif
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      TITAN_ISA_CALL(cross_entropy_grad, vocab, xp, lp, lsep, scp, begin, end);
    });
  });
}

// rope()'s arguments as Rope::apply takes them: the table as float (positions, head_dim / 2, 2) pairs, and each
// (batch, seq) row's table row (int64 on q's device), empty for the sequence index.
std::pair<at::Tensor, at::Tensor> rope_arguments(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                                                 const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(3) % 2 == 0 && q.size(3) == k.size(3) && q.sizes().slice(0, 2) == k.sizes().slice(0, 2),
              "fused RoPE: q ", q.sizes(), " and k ", k.sizes(), " do not fit");
  TORCH_CHECK(table.dim() == 2 && table.size(1) * 2 == q.size(3) && table.scalar_type() == at::kComplexFloat &&
                  table.device() == q.device(),
              "fused RoPE: table ", table.sizes(), " on ", table.device(), " for head_dim ", q.size(3), " on ", q.device());
  const at::Tensor pairs = at::view_as_real(table.is_contiguous() ? table : table.contiguous());
  at::Tensor rows = at::empty({0}, q.options().dtype(at::kLong));  // autograd functions take no undefined tensors
  if (positions.defined()) {
    rows = positions.to(q.device(), at::kLong).expand({q.size(0), q.size(1)}).contiguous();
    if (!q.is_cuda()) {  // on a GPU the kernel clamps instead: reading the range back would stall every layer
      const auto [lo, hi] = at::aminmax(rows);
      TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < table.size(0), "fused RoPE: positions outside 0..",
                  table.size(0) - 1);
    }
  } else {
    TORCH_CHECK(q.size(1) <= table.size(0), "fused RoPE: sequence length ", q.size(1), " exceeds the table's ", table.size(0));
  }
  return {pairs, rows};
}

// How far `actual` lies from `expected` (computed in float32 from the same inputs), in units of what rounding
// allows: at most 1 when they agree. Each difference is held to rtol of its expected value plus 1e-6 of the largest
// finite one (cancellation next to zero). Equal values (infinities, NaN in both) agree; a non-finite value against
// anything else does not.
double tolerance_units(const at::Tensor& actual, const at::Tensor& expected, double rtol) {
  const at::Tensor a = actual.detach().to(at::kFloat), e = expected.detach().to(at::kFloat);
  if (e.numel() == 0) return 0.0;
  const at::Tensor same = a.eq(e).logical_or(a.isnan().logical_and(e.isnan()));
  const at::Tensor largest = at::where(e.isfinite(), e.abs(), at::zeros_like(e)).max();
  const at::Tensor allowed = e.abs().mul(rtol).add(largest.mul(1e-6)).clamp_min(1e-30);
  const at::Tensor units = at::where(same, at::zeros_like(a), a.sub(e).abs().div(allowed));
  return at::nan_to_num(units, INFINITY).max().item<double>();  // a NaN against a number: infinitely far
}

// bf16: a kernel rounds its float32 result once (at most 2^-8 of the value); float32: a few units in the last place
// for exp and the order of operations.
double rtol_for(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 8e-3 : 1e-5; }

// The comparisons behind the first-call checks: the fused kernels on a slice of a call's own inputs (at most
// kCheckRows rows, kCheckElements elements), forward and backward through the same autograd functions as
// training, against autograd through the ATen composition in float32.
constexpr int64_t kCheckRows = 64, kCheckElements = int64_t{1} << 16;

double compare_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t n = std::min(gate.numel(), kCheckElements);
  const at::Tensor g = gate.detach().reshape(-1).narrow(0, 0, n).clone().requires_grad_();
  const at::Tensor u = up.detach().reshape(-1).narrow(0, 0, n).clone().requires_grad_();
  const at::Tensor d = u.detach().flip(0);  // any gradient of the output's shape
  const at::Tensor out = SwiGlu::apply(g, u);
  const auto grads = torch::autograd::grad({out}, {g, u}, {d});
  const at::Tensor gf = g.detach().to(at::kFloat).requires_grad_(), uf = u.detach().to(at::kFloat).requires_grad_();
  const at::Tensor ref = swiglu_reference(gf, uf);
  const auto ref_grads = torch::autograd::grad({ref}, {gf, uf}, {d.to(at::kFloat)});
  const double rtol = rtol_for(gate.scalar_type());
  return std::max({tolerance_units(out, ref, rtol), tolerance_units(grads[0], ref_grads[0], rtol),
                   tolerance_units(grads[1], ref_grads[1], rtol)});
}

// q and k as given to rope() (strided views stay strided).
double compare_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table, const at::Tensor& positions) {
  const auto [pairs, rows] = rope_arguments(q, k, table, positions);
  const int64_t t = std::min(q.size(1), kCheckRows);
  at::Tensor qs = q.detach().narrow(0, 0, 1).narrow(1, 0, t), ks = k.detach().narrow(0, 0, 1).narrow(1, 0, t);
  qs.requires_grad_();
  ks.requires_grad_();
  const at::Tensor rs = rows.numel() > 0 ? rows.narrow(0, 0, 1).narrow(1, 0, t).contiguous() : rows;
  // Gradients in the layout the attention's backward hands RoPE: (batch, heads, seq, head_dim) memory.
  auto strided_like_training = [](const at::Tensor& x) { return x.flip(1).transpose(1, 2).contiguous().transpose(1, 2); };
  const at::Tensor dq = strided_like_training(qs.detach()), dk = strided_like_training(ks.detach());
  const auto out = Rope::apply(qs, ks, pairs, rs);
  const auto grads = torch::autograd::grad({out[0], out[1]}, {qs, ks}, {dq, dk});
  const at::Tensor qf = qs.detach().to(at::kFloat).requires_grad_(), kf = ks.detach().to(at::kFloat).requires_grad_();
  const at::Tensor slice_positions = rows.numel() > 0 ? rs : at::Tensor();
  const at::Tensor rq = rope_reference(qf, table, slice_positions), rk = rope_reference(kf, table, slice_positions);
  const auto ref_grads = torch::autograd::grad({rq, rk}, {qf, kf}, {dq.to(at::kFloat), dk.to(at::kFloat)});
  const double rtol = rtol_for(q.scalar_type());
  return std::max({tolerance_units(out[0], rq, rtol), tolerance_units(out[1], rk, rtol),
                   tolerance_units(grads[0], ref_grads[0], rtol), tolerance_units(grads[1], ref_grads[1], rtol)});
}

double compare_cross_entropy(const at::Tensor& logits, const at::Tensor& local_label) {
  const int64_t r = std::min(logits.size(0), kCheckRows);
  const at::Tensor x = logits.detach().narrow(0, 0, r).contiguous(), labels = local_label.narrow(0, 0, r).contiguous();
  const CrossEntropyRowStats mine = row_stats_fused(x, labels), ref = row_stats_aten(x, labels);
  const at::Tensor lse = ref.max + ref.sum_exp.log();
  const at::Tensor scale = at::ones({r}, lse.options());
  const at::Tensor grad = x.clone(), ref_grad = x.to(at::kFloat, false, /*copy=*/true);
  row_grad_fused_(grad, labels, lse, scale);
  row_grad_aten_(ref_grad, labels, lse, scale);
  // The statistics are float32 whatever the logits' dtype: the maximum and the label's logit exact, the sum of
  // exponentials rounded along a sum of `vocab` terms in another order than ATen's.
  const double sum_rtol = 1e-5 * std::max(1.0, std::sqrt(static_cast<double>(logits.size(1)) / 1000.0));
  return std::max({tolerance_units(mine.max, ref.max, rtol_for(at::kFloat)), tolerance_units(mine.sum_exp, ref.sum_exp, sum_rtol),
                   tolerance_units(mine.target, ref.target, rtol_for(at::kFloat)),
                   tolerance_units(grad, ref_grad, rtol_for(logits.scalar_type()))});
}

#ifdef TITAN_WITH_CUDA
// The CUDA kernels' first-call checks: a state per operation and dtype (float32, bf16).
enum CheckState : int { kUnchecked = 0, kChecking = 1, kAgreed = 2, kDisagreed = 3 };
constexpr int kOps = static_cast<int>(Op::cross_entropy) + 1;
std::atomic<int> g_check[kOps][2];
std::atomic<bool> g_strict{false};
std::mutex g_lines_mutex;
std::vector<std::string> g_check_lines;  // guarded by g_lines_mutex

int dtype_slot(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 1 : 0; }

const char* op_name(Op op) {
  switch (op) {
    case Op::attention: return "attention";
    case Op::rms_norm: return "RMSNorm";
    case Op::swiglu: return "SwiGLU";
    case Op::rope: return "RoPE";
    case Op::cross_entropy: return "cross-entropy rows";
    case Op::grouped_mm: return "grouped matmul";
  }
  return "?";
}

// Whether `op`'s kernel may run on `dtype` now. The first caller compares it with ATen on `inputs()` (no lock held
// meanwhile: other threads take the ATen path until the verdict is in); the verdict holds for the process. A
// comparison that fails to run counts as a disagreement. Under inference mode, where nothing can be
// differentiated, the check waits for a later call.
template <typename Inputs>
bool cuda_kernel_trusted(Op op, at::ScalarType dtype, Inputs&& inputs) {
  std::atomic<int>& state = g_check[static_cast<int>(op)][dtype_slot(dtype)];
  int now = state.load();
  if (now == kAgreed) return true;
  if (now != kUnchecked || c10::InferenceMode::is_enabled()) return false;
  if (!state.compare_exchange_strong(now, kChecking)) return now == kAgreed;
  double worst = 0;
  std::string failure;
  try {
    worst = compare_with_aten(op, inputs());
  } catch (const std::exception& error) {
    failure = error.what();
    failure = failure.substr(0, failure.find('\n'));
  }
  const bool agreed = failure.empty() && worst <= 1.0;  // false for NaN
  const std::string line =
      cat(op_name(op), " (", dtype == at::kBFloat16 ? "bf16" : "float32", "): ",
          !failure.empty() ? cat("the comparison with the ATen composition failed to run (", failure, ")")
                           : cat(agreed ? "agrees with" : "DISAGREES with", " the ATen composition on its first call, worst difference ",
                                 strprintf("%.3g", worst), " of the tolerance"));
  {
    const std::lock_guard lock(g_lines_mutex);
    g_check_lines.push_back(line);
  }
  state = agreed ? kAgreed : kDisagreed;
  if (agreed) {
    log::info("CUDA kernel ", line);
  } else {
    TORCH_CHECK(!g_strict.load(), "CUDA kernel ", line, " (strict checks: no fallback)");
    log::warn("CUDA kernel ", line, "; titan uses the ATen composition instead for the rest of this run. Please report ",
              "this with the GPU, the CUDA version and the model configuration.");
  }
  return agreed;
}
#endif

}  // namespace

double compare_with_aten(Op op, const std::vector<at::Tensor>& inputs) {
  const at::AutoGradMode grad(true);  // also inside activation checkpointing's no-grad forward
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  switch (op) {
    case Op::swiglu:
      TORCH_CHECK(inputs.size() == 2, "compare_with_aten(SwiGLU): expected gate and up");
      return compare_swiglu(inputs[0], inputs[1]);
    case Op::rope:
      TORCH_CHECK(inputs.size() == 4, "compare_with_aten(RoPE): expected q, k, table and positions");
      return compare_rope(inputs[0], inputs[1], inputs[2], inputs[3]);
    case Op::cross_entropy:
      TORCH_CHECK(inputs.size() == 2, "compare_with_aten(cross-entropy rows): expected logits and labels");
      return compare_cross_entropy(inputs[0], inputs[1]);
    case Op::attention:
    case Op::rms_norm:
    case Op::grouped_mm: break;
  }
  TORCH_CHECK(false, "compare_with_aten: no comparison for attention, RMSNorm or the grouped products (they have no CUDA ",
              "kernel of titan's)");
}

bool fused_kernel_applies(Op op, std::initializer_list<at::Tensor> tensors) {
  if (!fused_kernels_enabled() || tensors.size() == 0 || !tensors.begin()->defined()) return false;
  const at::ScalarType dtype = tensors.begin()->scalar_type();
  const at::Device device = tensors.begin()->device();
  if (dtype != at::kFloat && dtype != at::kBFloat16) return false;
  for (const auto& t : tensors)
    if (!t.defined() || t.device() != device || t.scalar_type() != dtype || t.numel() == 0) return false;
  if (device.is_cpu()) return op != Op::grouped_mm || grouped_mm_enabled(dtype);
#ifdef TITAN_WITH_CUDA
  if (device.is_cuda() && (op == Op::swiglu || op == Op::rope || op == Op::cross_entropy))
    return g_check[static_cast<int>(op)][dtype_slot(dtype)].load() != kDisagreed;
#endif
  return false;
}

int kernel_threads() {
  std::vector<std::atomic<bool>> seen(static_cast<size_t>(std::max(at::get_num_threads(), 1)));
  at::parallel_for(0, static_cast<int64_t>(seen.size()), 1, [&](int64_t, int64_t) {
    seen[static_cast<size_t>(std::min<int64_t>(at::get_thread_num(), static_cast<int64_t>(seen.size()) - 1))] = true;
  });
  return static_cast<int>(std::count_if(seen.begin(), seen.end(), [](const std::atomic<bool>& b) { return b.load(); }));
}

bool cuda_kernels_built() {
#ifdef TITAN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void set_cuda_checks_strict(bool strict) {
#ifdef TITAN_WITH_CUDA
  g_strict = strict;
#else
  (void)strict;
#endif
}

bool cuda_checks_strict() {
#ifdef TITAN_WITH_CUDA
  return g_strict.load();
#else
  return false;
#endif
}

double difference_in_tolerances(const at::Tensor& actual, const at::Tensor& expected) {
  return tolerance_units(actual, expected, rtol_for(actual.scalar_type()));
}

std::vector<std::string> cuda_kernel_checks() {
#ifdef TITAN_WITH_CUDA
  const std::lock_guard lock(g_lines_mutex);
  return g_check_lines;
#else
  return {};
#endif
}

namespace {

// Checks attention's shapes; the documents as the autograd function takes them ("none" is an empty tensor, as
// autograd functions take no undefined tensors).
at::Tensor attention_documents(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "fused attention: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not fit");
  if (!documents.defined()) return at::empty({0}, at::kInt);
  TORCH_CHECK(documents.dim() == 2 && documents.size(0) == q.size(0) && documents.size(1) == q.size(2),
              "fused attention: documents ", documents.sizes(), " for q ", q.sizes());
  return documents.to(at::kInt).contiguous();
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents) {
  const at::Tensor none = at::empty({0}, q.options());
  return Attention::apply(q, k, v, attention_documents(q, k, v, documents), none, none);
}

std::pair<at::Tensor, at::Tensor> attention_outputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& documents) {
  const at::Tensor docs = attention_documents(q, k, v, documents);
  at::NoGradGuard no_grad;
  return Attention::compute(last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v), docs);
}

at::Tensor attention_with_outputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents,
                                  const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK(out.defined() && out.numel() > 0 && lse.defined(), "attention_with_outputs: no kept output");
  return Attention::apply(q, k, v, attention_documents(q, k, v, documents), out, lse);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_gradients(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, const at::Tensor& documents,
                                                                   const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && lse.sizes() == q.sizes().slice(0, 3) &&
                  lse.scalar_type() == at::kFloat && grad_out.sizes() == q.sizes(),
              "attention_gradients: output ", out.sizes(), ", log-sum-exp ", lse.sizes(), " and output gradient ", grad_out.sizes(),
              " do not belong to queries ", q.sizes());
  at::NoGradGuard no_grad;
  return Attention::gradients(last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v), last_dim_contiguous(out),
                              lse.contiguous(), attention_documents(q, k, v, documents), grad_out);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "fused RMSNorm: weight ", weight.sizes(), " for input ",
              x.sizes());
  return RmsNorm::apply(x, weight, eps);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.device() == up.device() && gate.scalar_type() == up.scalar_type(),
              "fused SwiGLU: gate ", gate.sizes(), " ", gate.scalar_type(), " on ", gate.device(), " and up ", up.sizes(),
              " ", up.scalar_type(), " on ", up.device(), " differ");
#ifdef TITAN_WITH_CUDA
  if (gate.is_cuda() &&
      !cuda_kernel_trusted(Op::swiglu, gate.scalar_type(), [&] { return std::vector<at::Tensor>{gate, up}; }))
    return swiglu_reference(gate, up);
#endif
  return SwiGlu::apply(gate, up);
}

at::Tensor swiglu_reference(const at::Tensor& gate, const at::Tensor& up) { return at::silu(gate) * up; }

std::pair<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                                       const at::Tensor& positions) {
  const auto [pairs, rows] = rope_arguments(q, k, table, positions);
#ifdef TITAN_WITH_CUDA
  if (q.is_cuda() && !cuda_kernel_trusted(Op::rope, q.scalar_type(),
                                           [&] { return std::vector<at::Tensor>{q, k, table, positions}; }))
    return {rope_reference(q, table, positions), rope_reference(k, table, positions)};
#endif
  auto out = Rope::apply(q, k, pairs, rows);
  return {out[0], out[1]};
}

at::Tensor rope_reference(const at::Tensor& x, const at::Tensor& table, const at::Tensor& positions) {
  const auto b = x.size(0), s = x.size(1), h = x.size(2), d = x.size(3);
  // Complex views need even strides: a strided float32 x is copied (the model's q and k are contiguous).
  const at::Tensor xc = at::view_as_complex(x.to(at::kFloat).contiguous().view({b, s, h, d / 2, 2}));
  const at::Tensor angles = positions.defined()
                                ? table.index_select(0, positions.reshape({-1})).view({positions.size(0), s, 1, d / 2})
                                : table.narrow(0, 0, s).view({1, s, 1, d / 2});
  return at::view_as_real(xc * angles).flatten(3).to(x.scalar_type());
}

CrossEntropyRowStats cross_entropy_row_stats(const at::Tensor& logits, const at::Tensor& local_label) {
  TORCH_CHECK(logits.dim() == 2 && local_label.dim() == 1 && local_label.size(0) == logits.size(0) &&
                  local_label.scalar_type() == at::kLong,
              "cross-entropy rows: logits ", logits.sizes(), " and labels ", local_label.sizes(), " do not fit");
  TORCH_CHECK(logits.size(1) > 0, "cross-entropy rows: no vocabulary columns");
  TORCH_CHECK(local_label.device() == logits.device(), "cross-entropy rows: labels on ", local_label.device(),
              ", logits on ", logits.device());
  if (!fused_kernel_applies(Op::cross_entropy, {logits})) return row_stats_aten(logits, local_label);
#ifdef TITAN_WITH_CUDA
  if (logits.is_cuda() && !cuda_kernel_trusted(Op::cross_entropy, logits.scalar_type(),
                                                [&] { return std::vector<at::Tensor>{logits, local_label}; }))
    return row_stats_aten(logits, local_label);
#endif
  return row_stats_fused(logits, local_label);
}

void cross_entropy_row_grad_(const at::Tensor& logits, const at::Tensor& local_label, const at::Tensor& lse,
                             const at::Tensor& scale) {
  TORCH_CHECK(logits.dim() == 2 && local_label.size(0) == logits.size(0) && lse.size(0) == logits.size(0) &&
                  scale.size(0) == logits.size(0) && lse.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat,
              "cross-entropy rows: gradient arguments do not fit logits ", logits.sizes());
  TORCH_CHECK(local_label.device() == logits.device() && lse.device() == logits.device() && scale.device() == logits.device(),
              "cross-entropy rows: labels, log-sum-exp and scale must be on the logits' device ", logits.device());
  if (!fused_kernel_applies(Op::cross_entropy, {logits}) || !logits.is_contiguous())
    return row_grad_aten_(logits, local_label, lse, scale);
#ifdef TITAN_WITH_CUDA
  if (logits.is_cuda() && !cuda_kernel_trusted(Op::cross_entropy, logits.scalar_type(),
                                                [&] { return std::vector<at::Tensor>{logits, local_label}; }))
    return row_grad_aten_(logits, local_label, lse, scale);
#endif
  row_grad_fused_(logits, local_label, lse, scale);
}

}  // namespace titan::kernels
