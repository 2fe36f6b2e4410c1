#include "titan/models/common/moe.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/common/test_faults.h"
#include "titan/kernels/fused_ops.h"
#include "titan/kernels/grouped_mm.h"
#include "titan/nn/autocast.h"
#include "titan/nn/matmul.h"

namespace titan::models {

namespace {

// The float32 parts of routing and combining stay float32 under autocast (as in torchtitan, which has none there).
using nn::NoAutocast;

// y = x W[e]^T for each expert's contiguous rows of x (counts per expert), W [experts, out, in]: titan's grouped
// kernels on the CPU for bf16, LibTorch's grouped matmul on CUDA GPUs that have it (kernels/grouped_mm.h),
// otherwise (float32 on the CPU, other GPUs, training.fused_kernels = false) one product per expert that received
// tokens. Backward writes each expert's weight gradient into its row of one gradient tensor
// (autograd of per-expert slices would add a zero-filled full-size gradient per expert).
// Runs `libtorch()` where LibTorch's grouped product applies, falling back to `loop()` if it throws (a GPU or build
// without it); otherwise `loop()`.
template <typename LibTorch, typename Loop>
at::Tensor with_libtorch_or_loop(const at::Tensor& x, const at::Tensor& w, const LibTorch& libtorch, const Loop& loop) {
  if (kernels::libtorch_grouped_mm_applies(x, w)) {
    try {
      return libtorch();
    } catch (const c10::Error& error) {
      kernels::libtorch_grouped_mm_failed(error.what());
    }
  }
  return loop();
}

struct GroupedLinear : torch::autograd::Function<GroupedLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
    ctx->save_for_backward({x, w, counts});
    return product(x, w, counts);
  }

  static at::Tensor product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
    if (kernels::fused_kernel_applies(kernels::Op::grouped_mm, {x, w})) return kernels::grouped_linear(x, w, counts);
    return with_libtorch_or_loop(x, w, [&] { return kernels::libtorch_grouped_linear(x, w, counts); }, [&] { return loop(x, w, counts); });
  }

  static at::Tensor loop(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
    at::Tensor out = at::empty({x.size(0), w.size(1)}, x.options());
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < w.size(0); start += count[e], ++e) {
      if (count[e] == 0) continue;
      at::Tensor rows = out.narrow(0, start, count[e]);
      nn::mm_out(rows, x.narrow(0, start, count[e]), w[e].t());
    }
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = gradients(grads[0], saved[0], saved[1], saved[2], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor()};
  }

  // The input's gradient (when `input`) and the weight's (when `weight`) of y = x W[e]^T, given y's gradient.
  static std::pair<at::Tensor, at::Tensor> gradients(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& counts, bool input, bool weight) {
    const at::Tensor g = grad.contiguous();
    if (kernels::fused_kernel_applies(kernels::Op::grouped_mm, {g, w, x})) {
      return {input ? kernels::grouped_linear_input_grad(g, w, counts) : at::Tensor(),
              weight ? kernels::grouped_linear_weight_grad(g, x, counts) : at::Tensor()};
    }
    if (kernels::libtorch_grouped_mm_applies(g, w)) {
      try {
        return {input ? kernels::libtorch_grouped_linear_input_grad(g, w, counts) : at::Tensor(),
                weight ? kernels::libtorch_grouped_linear_weight_grad(g, x, counts) : at::Tensor()};
      } catch (const c10::Error& error) {
        kernels::libtorch_grouped_mm_failed(error.what());
      }
    }
    at::Tensor dx, dw;
    if (input) dx = at::empty_like(x);
    if (weight) dw = at::zeros_like(w);  // experts without tokens keep a zero gradient
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < w.size(0); start += count[e], ++e) {
      if (count[e] == 0) continue;
      const at::Tensor ge = g.narrow(0, start, count[e]);
      if (dx.defined()) {
        at::Tensor rows = dx.narrow(0, start, count[e]);
        nn::mm_out(rows, ge, w[e]);
      }
      if (dw.defined()) {
        at::Tensor slice = dw[e];
        nn::mm_out(slice, ge.t(), x.narrow(0, start, count[e]));
      }
    }
    return {dx, dw};
  }
};

// The gate and up products x W1^T and x W3^T from one copy of x in the compute dtype `dtype`, where x is `source`,
// or with `gather` the rows `rows` of `source` (the tokens sorted by expert, gathered from the block's input).
// Kept for backward: that one copy in the compute dtype -- of `source` when gathering, so each token is kept once
// rather than top_k times, and the sorted copy is gathered again in backward. Autocast would convert x for each
// product and keep both copies. The two input gradients are converted to source's dtype, summed, and added into the
// source's rows as index_select's backward does: the results are bitwise those of the composition they replace. The
// weights are converted for each call, as grouped_linear does.
struct GroupedGateUp : torch::autograd::Function<GroupedGateUp> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& source, const at::Tensor& rows,
                                                const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& counts,
                                                at::ScalarType dtype, bool gather) {
    const at::Tensor kept = source.to(dtype), w1c = w1.to(dtype), w3c = w3.to(dtype);
    const at::Tensor xc = gather ? kept.index_select(0, rows) : kept;
    ctx->save_for_backward({kept, rows, w1c, w3c, counts});
    ctx->saved_data["gather"] = gather;
    ctx->saved_data["source"] = static_cast<int64_t>(source.scalar_type());
    ctx->saved_data["w1"] = static_cast<int64_t>(w1.scalar_type());
    ctx->saved_data["w3"] = static_cast<int64_t>(w3.scalar_type());
    return {GroupedLinear::product(xc, w1c, counts), GroupedLinear::product(xc, w3c, counts)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &kept = saved[0], &rows = saved[1], &w1c = saved[2], &w3c = saved[3], &counts = saved[4];
    const bool gather = ctx->saved_data["gather"].toBool();
    const at::Tensor xc = gather ? kept.index_select(0, rows) : kept;
    const auto dtype = [&](const char* name) { return static_cast<at::ScalarType>(ctx->saved_data[name].toInt()); };
    const bool input = ctx->needs_input_grad(0);
    auto [dx1, dx1_w] = GroupedLinear::gradients(grads[0], xc, w1c, counts, input, ctx->needs_input_grad(2));
    auto [dx3, dx3_w] = GroupedLinear::gradients(grads[1], xc, w3c, counts, input, ctx->needs_input_grad(3));
    at::Tensor d_source;
    if (input) {
      d_source = dx1.to(dtype("source")) + dx3.to(dtype("source"));
      if (gather) d_source = at::zeros(kept.sizes(), d_source.options()).index_add_(0, rows, d_source);
    }
    return {d_source, at::Tensor(), dx1_w.defined() ? dx1_w.to(dtype("w1")) : dx1_w,
            dx3_w.defined() ? dx3_w.to(dtype("w3")) : dx3_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The grouped product in the compute dtype: under autocast, x and W in the autocast dtype first (as a linear).
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  const auto device = x.device().type();
  if (at::autocast::is_autocast_enabled(device) && at::isFloatingType(x.scalar_type())) {
    const auto dtype = at::autocast::get_autocast_dtype(device);
    NoAutocast no_autocast;
    return GroupedLinear::apply(x.to(dtype), w.to(dtype), counts);
  }
  return GroupedLinear::apply(x, w.to(x.scalar_type()), counts);
}

// out[t] = sum over k of scores[t, k] * expert_out[t, k], in float32: the product at::bmm(scores [t, 1, k],
// expert_out [t, k, d] in float32) that autograd would record, with the same products in backward, but keeping
// expert_out in its own dtype (bf16 under autocast or FSDP) rather than the float32 copy bmm would keep: 2 bytes
// instead of 4 per element of each of a token's top_k copies. Converting bf16 to float32 is exact, so forward and
// backward are bitwise those of the bmm.
struct WeightedSum : torch::autograd::Function<WeightedSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& scores, const at::Tensor& expert_out) {
    ctx->save_for_backward({scores, expert_out});
    return at::bmm(scores.unsqueeze(1), expert_out.to(at::kFloat)).squeeze(1);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor scores = saved[0].unsqueeze(1), expert_out = saved[1].to(at::kFloat), g = grads[0].unsqueeze(1);
    at::Tensor d_scores, d_out;
    if (ctx->needs_input_grad(0)) d_scores = g.bmm(expert_out.transpose(1, 2)).squeeze(1);
    if (ctx->needs_input_grad(1)) d_out = scores.transpose(1, 2).bmm(g).to(saved[1].scalar_type());
    return {d_scores, d_out};
  }
};

}  // namespace

void MoEArgs::check() const {
  if (num_experts <= 0) fail("moe num_experts must be positive, got ", num_experts);
  if (top_k <= 0 || top_k > num_experts)
    fail("moe top_k = ", top_k, " must be between 1 and num_experts = ", num_experts);
  if (num_shared_experts < 0) fail("moe num_shared_experts must be 0 or more, got ", num_shared_experts);
  if (hidden_dim <= 0) fail("moe hidden_dim (moe_inter_dim) must be positive, got ", hidden_dim);
  if (score_func != "softmax" && score_func != "sigmoid")
    fail("moe score_func = ", quote(score_func), "; expected \"softmax\" or \"sigmoid\"");
  if (!(route_scale > 0)) fail("moe route_scale must be positive, got ", route_scale);
  if (gate_bias) fail("moe gate_bias = true (a bias on the router's linear) is not supported yet");
  if (load_balance_coeff && !(*load_balance_coeff > 0))
    fail("moe load_balance_coeff must be positive when set, got ", *load_balance_coeff);
  if (num_expert_groups.has_value() != num_limited_groups.has_value())
    fail("moe num_expert_groups and num_limited_groups go together (node-limited routing); got ",
         num_expert_groups ? cat("num_expert_groups = ", *num_expert_groups) : std::string("no num_expert_groups"), " and ",
         num_limited_groups ? cat("num_limited_groups = ", *num_limited_groups) : std::string("no num_limited_groups"));
  if (num_expert_groups) {
    const int64_t groups = *num_expert_groups, limited = *num_limited_groups;
    if (groups <= 0 || num_experts % groups != 0)
      fail("moe num_expert_groups = ", groups, " must divide num_experts = ", num_experts);
    if (num_experts / groups < 2)
      fail("moe num_expert_groups = ", groups, " leaves ", num_experts / groups,
           " expert(s) per group; a group's score is the sum of its two best experts' scores, so each needs at least 2");
    if (limited <= 0 || limited > groups)
      fail("moe num_limited_groups = ", limited, " must be between 1 and num_expert_groups = ", groups);
    if (limited * (num_experts / groups) < top_k)
      fail("moe num_limited_groups = ", limited, " groups of ", num_experts / groups, " experts hold fewer than top_k = ", top_k,
           " experts");
  }
}

std::vector<std::string> MoEArgs::differences(const MoEArgs& o) const {
  std::vector<std::string> out;
  auto compare = [&](const char* name, auto x, auto y) {
    if (x != y) out.push_back(cat(name, ": ", x, " vs ", y));
  };
  auto optional = [](const std::optional<int64_t>& v) { return v ? std::to_string(*v) : std::string("none"); };
  compare("moe num_experts", num_experts, o.num_experts);
  compare("moe top_k (num_experts_per_tok)", top_k, o.top_k);
  compare("moe hidden_dim (moe_intermediate_size)", hidden_dim, o.hidden_dim);
  compare("moe num_shared_experts", num_shared_experts, o.num_shared_experts);
  compare("moe score_func", score_func, o.score_func);
  compare("moe route_norm (norm_topk_prob)", route_norm ? "true" : "false", o.route_norm ? "true" : "false");
  compare("moe route_scale", route_scale, o.route_scale);
  compare("moe score_before_experts", score_before_experts ? "true" : "false", o.score_before_experts ? "true" : "false");
  compare("moe num_expert_groups", optional(num_expert_groups), optional(o.num_expert_groups));
  compare("moe num_limited_groups", optional(num_limited_groups), optional(o.num_limited_groups));
  return out;
}

Router::Router(int64_t dim, const MoEArgs& args, const nn::ParameterOptions& options) : args_(args) {
  gate = register_module("gate", std::make_shared<nn::Linear>(dim, args.num_experts, options));
}

at::Tensor Router::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor logits = (*gate)(inputs[0], context);
  NoAutocast no_autocast;
  const at::Tensor x = logits.to(at::kFloat);
  return args_.score_func == "softmax" ? at::softmax(x, 1) : at::sigmoid(x);
}

Routing Router::route(const at::Tensor& x, const at::Tensor& bias, const nn::Context& context) {
  const at::Tensor scores = call({x}, context);
  const int64_t tokens = scores.size(0), experts = args_.num_experts;
  at::Tensor selected;
  {
    at::NoGradGuard no_grad;
    at::Tensor choice = scores.detach();
    if (bias.defined()) choice = choice + bias;
    if (args_.num_expert_groups) {
      // Node-limited routing: keep the groups whose two best (biased) scores sum highest.
      const int64_t groups = *args_.num_expert_groups;
      const at::Tensor grouped = choice.view({tokens, groups, experts / groups});
      const at::Tensor group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);
      const at::Tensor kept = std::get<1>(group_scores.topk(*args_.num_limited_groups, -1));
      const at::Tensor dropped = at::ones({tokens, groups}, choice.options().dtype(at::kBool)).scatter(1, kept, false);
      choice = grouped.masked_fill(dropped.unsqueeze(-1), -std::numeric_limits<float>::infinity()).view({tokens, experts});
    }
    selected = std::get<1>(choice.topk(args_.top_k, -1));
    if (test_faults::moe_collapse())
      selected = at::arange(args_.top_k, selected.options()).expand({tokens, args_.top_k}).contiguous();
    if (args_.force_load_balance)
      selected = at::remainder(at::arange(tokens * args_.top_k, selected.options()), experts).view({tokens, args_.top_k});
  }
  Routing r;
  r.experts = selected;
  NoAutocast no_autocast;
  at::Tensor top = scores.gather(1, selected);
  if (args_.route_norm) top = top / (top.sum(-1, /*keepdim=*/true) + 1e-20);
  r.scores = top * args_.route_scale;
  r.counts = at::bincount(selected.flatten(), /*weights=*/{}, experts);
  return r;
}

GroupedExperts::GroupedExperts(int64_t dim, int64_t hidden_dim, int64_t num_experts, const nn::ParameterOptions& options) {
  w1 = register_parameter("w1", nn::new_parameter({num_experts, hidden_dim, dim}, options));
  w2 = register_parameter("w2", nn::new_parameter({num_experts, dim, hidden_dim}, options));
  w3 = register_parameter("w3", nn::new_parameter({num_experts, hidden_dim, dim}, options));
}

at::Tensor GroupedExperts::forward(const Inputs& inputs, const nn::Context&) {
  // {x, counts}, or {source, counts, rows} where x is source's rows `rows` (MoE::forward, experts run here): the gate
  // and up products then gather x themselves and keep source instead.
  const bool gather = inputs.size() == 3;
  const at::Tensor& x = inputs[0];
  const at::Tensor counts = inputs[1].to(at::kCPU).to(at::kLong).contiguous();
  const int64_t experts = w1.size(0);
  TORCH_CHECK(counts.numel() == experts, "internal: ", counts.numel(), " token counts for ", experts, " experts");
  const int64_t routed = counts.sum().item<int64_t>(), rows = gather ? inputs[2].numel() : x.size(0);
  TORCH_CHECK(routed == rows, "internal: the token counts sum to ", routed, ", not the ", rows, " routed rows");
  // silu(x W1^T) * (x W3^T): titan's fused SwiGLU where it applies (it keeps no SiLU output for backward).
  at::Tensor gate, up;
  const auto device = x.device().type();
  const bool autocast = at::autocast::is_autocast_enabled(device) && at::isFloatingType(x.scalar_type());
  const auto swiglu = [](const at::Tensor& g, const at::Tensor& u) {
    return kernels::fused_kernel_applies(kernels::Op::swiglu, {g, u}) ? kernels::swiglu(g, u) : kernels::swiglu_reference(g, u);
  };
  if (low_precision) {
    // MXFP8 or float8 grouped matmuls (quantize.grouped_mm.mx / .float8), as torchtitan's grouped-matmul experts run
    // them: the sorted tokens and the products in bf16 (what torchao's low-precision grouped matmuls return), SiLU
    // and the gate product in bf16, the output in the input's dtype.
    // Each product converts the tokens itself, so their two bf16 gradients meet in the input's dtype.
    NoAutocast no_autocast;
    const at::Tensor sorted = gather ? x.index_select(0, inputs[2]) : x;
    const auto cast = *low_precision;
    const at::Tensor h = at::silu(nn::float8::grouped_linear(sorted.to(at::kBFloat16), w1, counts, cast, gate_up_amax)) *
                         nn::float8::grouped_linear(sorted.to(at::kBFloat16), w3, counts, cast, gate_up_amax);
    return nn::float8::grouped_linear(h, w2, counts, cast, down_amax).to(x.scalar_type());
  }
  if (gather) {
    NoAutocast no_autocast;
    const auto both = GroupedGateUp::apply(x, inputs[2], w1, w3, counts,
                                           autocast ? at::autocast::get_autocast_dtype(device) : x.scalar_type(), true);
    gate = both[0], up = both[1];
  } else if (autocast && x.scalar_type() != at::autocast::get_autocast_dtype(device)) {
    const auto dtype = at::autocast::get_autocast_dtype(device);
    NoAutocast no_autocast;
    // No rows to gather: `counts` stands in for them (this LibTorch refuses an undefined tensor as a custom
    // function's input).
    const auto both = GroupedGateUp::apply(x, counts, w1, w3, counts, dtype, false);
    gate = both[0], up = both[1];
  } else {
    gate = grouped_linear(x, w1, counts), up = grouped_linear(x, w3, counts);
  }
  return grouped_linear(swiglu(gate, up), w2, counts);
}

MoE::MoE(int64_t dim, const MoEArgs& args, const nn::ParameterOptions& options) : args_(args) {
  router = register_module("router", std::make_shared<Router>(dim, args, options));
  experts = register_module("experts", std::make_shared<GroupedExperts>(dim, args.hidden_dim, args.num_experts, options));
  if (args.num_shared_experts > 0)
    shared_experts = register_module("shared_experts",
                                     std::make_shared<FeedForward>(dim, args.hidden_dim * args.num_shared_experts, options));
  tokens_per_expert = register_buffer("tokens_per_expert", at::zeros({args.num_experts}, at::kFloat));
  if (args.load_balance_coeff) expert_bias = register_buffer("expert_bias", at::zeros({args.num_experts}, at::kFloat));
}

void MoE::move_buffers(const at::Device& device) {
  at::NoGradGuard no_grad;
  for (at::Tensor* t : {&expert_bias, &tokens_per_expert})
    if (t->defined()) t->set_data(t->to(device));
}

namespace {
constexpr double kNoBias = -1e300;  // the bias entries of parts without balancing (below any real value)
struct Health {
  std::vector<int64_t> block;
  std::vector<double> max_load, min_load;
  bool has_bias = false;
  double bias_min = 0, bias_max = 0;
};
Health read_health(const at::Tensor& figures) {
  const at::Tensor f = figures.to(at::kCPU, at::kDouble).contiguous();
  const double* v = f.data_ptr<double>();
  const int64_t layers = (f.numel() - 2) / 2;
  Health h;
  for (int64_t i = 0; i < layers; ++i) {
    if (v[i] <= 0) continue;  // a dense block (none held it)
    h.block.push_back(i);
    h.max_load.push_back(v[i]);
    h.min_load.push_back(1 - v[layers + i]);
  }
  h.has_bias = v[2 * layers + 1] > kNoBias / 2;
  if (h.has_bias) h.bias_min = -v[2 * layers], h.bias_max = v[2 * layers + 1];
  return h;
}
}  // namespace

std::vector<std::pair<std::string, double>> routing_health_scalars(const at::Tensor& figures) {
  const Health h = read_health(figures);
  std::vector<std::pair<std::string, double>> out;
  if (h.max_load.empty()) return out;
  out.emplace_back("moe/max_load_ratio", *std::max_element(h.max_load.begin(), h.max_load.end()));
  out.emplace_back("moe/min_load_ratio", *std::min_element(h.min_load.begin(), h.min_load.end()));
  for (size_t i = 0; i < h.max_load.size(); ++i) out.emplace_back(cat("moe/layer_", h.block[i], "/max_load_ratio"), h.max_load[i]);
  if (h.has_bias) {
    out.emplace_back("moe/expert_bias_min", h.bias_min);
    out.emplace_back("moe/expert_bias_max", h.bias_max);
  }
  return out;
}

std::string routing_health_summary(const at::Tensor& figures) {
  const Health h = read_health(figures);
  if (h.max_load.empty()) return {};
  return strprintf("experts: max %.2fx min %.2fx", *std::max_element(h.max_load.begin(), h.max_load.end()),
                   *std::min_element(h.min_load.begin(), h.min_load.end())) +
         (h.has_bias ? strprintf(", bias [%.3g, %.3g]", h.bias_min, h.bias_max) : std::string());
}

at::Tensor update_expert_biases(const std::vector<MoE*>& layers, const std::vector<int64_t>& indices, int64_t n_layers,
                                distributed::Communicator* group) {
  at::NoGradGuard no_grad;
  if (layers.size() != indices.size()) fail("internal: ", layers.size(), " MoE layers with ", indices.size(), " block indices");
  const auto device = layers.empty() ? at::Device(at::kCPU) : layers.front()->tokens_per_expert.device();
  at::Tensor figures = at::zeros({2 * n_layers + 2}, at::TensorOptions().dtype(at::kDouble).device(device));
  figures.narrow(0, 2 * n_layers, 2).fill_(kNoBias);
  if (layers.empty()) return figures;
  std::vector<at::Tensor> counts;
  for (MoE* layer : layers) counts.push_back(layer->tokens_per_expert);
  at::Tensor all = at::stack(counts);  // [layers, experts], one reduction for all of them
  if (group && group->size() > 1) {
    at::Tensor buffer = all.to(group->tensor_device()).contiguous();
    group->all_reduce(buffer, distributed::ReduceOp::Sum);
    all = buffer.to(all.device());
  }
  std::vector<at::Tensor> biases;
  for (size_t i = 0; i < layers.size(); ++i) {
    MoE& layer = *layers[i];
    const at::Tensor t = all[static_cast<int64_t>(i)];
    if (layer.expert_bias.defined()) {
      at::Tensor delta = *layer.args().load_balance_coeff * at::sign(t.mean() - t);
      delta = delta - delta.mean();
      layer.expert_bias.add_(delta);
      biases.push_back(layer.expert_bias);
    }
    layer.tokens_per_expert.zero_();
  }
  const at::Tensor mean = all.mean(1).clamp_min(1e-9);
  const at::Tensor index = at::tensor(indices, at::kLong).to(device);
  figures.index_copy_(0, index, (std::get<0>(all.max(1)) / mean).to(at::kDouble));
  figures.index_copy_(0, index + n_layers, (1 - std::get<0>(all.min(1)) / mean).to(at::kDouble));
  if (!biases.empty()) {
    const at::Tensor b = at::stack(biases);
    figures.narrow(0, 2 * n_layers, 2).copy_(at::stack({-b.min(), b.max()}).to(at::kDouble));
  }
  return figures;
}

at::Tensor MoE::forward(const Inputs& inputs, const nn::Context& context) {
  const at::Tensor& x = inputs[0];
  const int64_t dim = x.size(-1), k = args_.top_k;
  const at::Tensor flat = x.reshape({-1, dim});
  const int64_t tokens = flat.size(0);
  const Routing r = router->route(flat, expert_bias, context);
  if (at::GradMode::is_enabled()) {
    at::NoGradGuard no_grad;
    tokens_per_expert.add_(r.counts.to(tokens_per_expert.device(), at::kFloat));
  }
  // The (token, slot) pairs sorted by expert, stably (within an expert in token order), and the way back.
  at::Tensor order, inverse;
  {
    at::NoGradGuard no_grad;
    order = at::argsort(r.experts.flatten(), /*stable=*/true);
    inverse = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
  }
  const at::Tensor rows = at::floor_divide(order, k);
  // Experts that run here gather the sorted copies themselves and keep `flat` rather than its top_k copies
  // (GroupedExperts::forward); experts behind expert parallelism's dispatch get the copies, as do copies scaled
  // before the experts (new values).
  at::Tensor expert_out;
  if (!args_.score_before_experts && !experts->has_wrapper("expert_parallel")) {
    expert_out = experts->call({flat, r.counts, rows}, context);
  } else {
    at::Tensor routed = flat.index_select(0, rows);
    if (args_.score_before_experts) {
      NoAutocast no_autocast;
      routed = (routed.to(at::kFloat) * r.scores.flatten().index_select(0, order).unsqueeze(1)).to(flat.scalar_type());
    }
    expert_out = experts->call({routed, r.counts}, context);
  }
  expert_out = expert_out.index_select(0, inverse).view({tokens, k, dim});
  at::Tensor out;
  if (args_.score_before_experts) {
    out = expert_out.sum(1);
  } else {
    NoAutocast no_autocast;
    out = WeightedSum::apply(r.scores.view({tokens, k}), expert_out).to(flat.scalar_type());
  }
  if (shared_experts) out = (*shared_experts)(flat, context) + out;
  return out.view(x.sizes());
}

}  // namespace titan::models
