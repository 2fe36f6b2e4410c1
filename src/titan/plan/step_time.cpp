#include "titan/plan/step_time.h"

#include "titan/config/dtypes.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/quantization/float8.h"
#include "titan/distributed/pipeline/schedule.h"
#include "titan/models/common/decoder_memory.h"

namespace titan::plan {

namespace {

// The calibration constants, shared by every layout and profile (docs/plan.md says where each comes from).
// Flash attention's share of the matmul rate: its inner products run in tiles with a softmax between them.
constexpr double kAttentionEfficiency = 0.55;
// Share of the memory bandwidth that elementwise kernels and the optimizer reach.
constexpr double kBandwidthEfficiency = 0.8;
// Share of a link's bandwidth that NCCL/RCCL collectives reach on large messages (bus bandwidth).
constexpr double kLinkEfficiency = 0.8;
// float8 linear layers (torchao's dynamic tensor-wise scaling): each cast of an operand reads it in bf16 twice
// (its absolute maximum, then the scaled copy) and writes one byte per element.
constexpr double kFloat8CastBytesPerElement = 5;
// Fitted, not derived (ClusterProfile::calibration): torch.compile's share of the memory-bound bytes, float8 GEMMs'
// efficiency against bf16's, ring attention's loss per further context-parallel rank (smaller chunk pairs, the merges
// of partial results, the shifts' synchronisation).

// Rowwise float8's forward product (CUTLASS's rowwise-scaled kernel, fast accumulation) against cuBLAS's tensorwise
// one on H100: "most shapes within 90-100%" (pytorch/pytorch#147971, 2025-02); its backward products run as
// tensorwise GEMMs (below).
constexpr double kRowwiseForwardGemmRelative = 0.95;

// Counted, not fitted: flash attention's backward runs five tile matmuls to forward's two.
constexpr double kAttentionBackwardRatio = 2.5;
// AdamW over float32 state: reads parameter, gradient and both moments, writes parameter and moments; clipping
// reads the gradient once more.
constexpr double kOptimizerBytesPerParameter = 32;

// Bytes the loss moves per logit in eager LibTorch: the output in the compute dtype, its float32 copy, the
// log-softmax and, in backward, its gradient in float32 and back in the compute dtype.
double loss_bytes_per_logit(double c) { return c + (c + 4) + 8 + 4 + 12 + (4 + c); }

// torchtitan's loss: float32 logits, their log-softmax, its gradient and the bf16 gradient.
constexpr double kTorchtitanLossBytesPerLogit = 2 + 4 + 8 + 4 + 12 + 4 + 2;

std::string gbs(double bytes_per_second) { return strprintf("%.0f GB/s", bytes_per_second / 1e9); }

// The output tiles a GEMM library picks from (rows x columns of the output per multiprocessor at a time), and the
// fixed cost of each tile (its prologue and epilogue) in units of the contraction length. Chosen on OpenXLA's
// published bf16 GEMM rates (H100, MI300X) as docs/plan.md says.
constexpr double kGemmTiles[][2] = {{128, 256}, {256, 128}, {128, 128}};
constexpr double kGemmTileOverheadK = 192;

// The share of the device's large-GEMM rate a product reaches: the best tile's useful share of its waves (the last
// wave of a small product leaves multiprocessors idle; a partial tile computes padding), times k / (k + overhead).
double gemm_occupancy(double batch, double m, double n, double k, double multiprocessors) {
  double best = 0;
  for (const auto& tile : kGemmTiles) {
    const double tiles = batch * std::ceil(m / tile[0]) * std::ceil(n / tile[1]);
    const double waves = std::ceil(tiles / multiprocessors);
    best = std::max(best, batch * m * n / (waves * multiprocessors * tile[0] * tile[1]));
  }
  return best * k / (k + kGemmTileOverheadK);
}

}  // namespace

double matmul_shape_factor(double batch, double m, double n, double k, int64_t multiprocessors, double launch_flops) {
  if (multiprocessors <= 0 || batch <= 0 || m <= 0 || n <= 0 || k <= 0) return 1.0;
  const double sms = static_cast<double>(multiprocessors);
  // A launch of F FLOPs at occupancy o takes F / (R o) + t at the tiles' full rate R (the 8192-cubed product's
  // rate over its occupancy); launch_flops = t x the 8192-cubed rate.
  const double reference = gemm_occupancy(1, 8192, 8192, 8192, sms);
  const auto rate = [&](double b, double mm, double nn, double kk) {
    const double o = gemm_occupancy(b, mm, nn, kk, sms), flops = 2 * b * mm * nn * kk;
    return o * flops / (flops + launch_flops / reference * o);
  };
  return rate(batch, m, n, k) / rate(1, 8192, 8192, 8192);
}

Speedups speedups_of(const config::JobConfig& c) {
  Speedups s;
  s.compile = c.compile.enable;
  for (const auto& converter : c.model.converters)
    if (converter == "float8" || converter == "quantize.linear.float8") s.float8 = true;
  s.float8_all_gather = s.float8 && c.quantize.linear.float8.enable_fsdp_float8_all_gather;
  if (c.quantize.linear.float8.recipe_name) s.float8_recipe = *c.quantize.linear.float8.recipe_name;
  return s;
}

StepTime estimate_step_time(const models::DecoderArgs& a, const config::JobConfig& config,
                            const distributed::ParallelDims& dims, const ClusterProfile& cluster,
                            protocols::Execution execution) {
  const bool torchtitan = execution == protocols::Execution::torchtitan;
  const auto& training = config.training;
  const auto& parallelism = config.parallelism;
  const auto& ac = config.activation_checkpoint;
  const Speedups speed = speedups_of(config);
  const double tp = static_cast<double>(dims.tp), cp = static_cast<double>(dims.cp);
  const double d = static_cast<double>(a.dim), vocab = static_cast<double>(a.vocab_size);
  // Attention's widths: the query width of all heads, the key/value width the attention core sees (latent
  // attention's keys expanded per head and its values padded to the query width), and the width RoPE turns (latent
  // attention: each query head's rope columns and the one shared rotary key).
  const double d_attn = static_cast<double>(a.n_heads * a.head_dim()), d_kv = static_cast<double>(a.kv_heads() * a.head_dim());
  const double d_rope = a.mla ? static_cast<double>((a.n_heads + 1) * a.mla->qk_rope_head_dim) : d_attn + d_kv;
  // The feed-forward width a token passes through, over the blocks: a dense block's SwiGLU; a MoE block's top_k
  // routed experts and its shared ones (DeepSeek-V3's dense blocks come first).
  const double moe_share = static_cast<double>(a.moe_layers()) / static_cast<double>(std::max<int64_t>(1, a.n_layers));
  const double moe_hidden = a.moe ? static_cast<double>((a.moe->top_k + a.moe->num_shared_experts) * a.moe->hidden_dim) : 0;
  const double hidden = moe_share * moe_hidden + (1 - moe_share) * static_cast<double>(a.ffn_hidden_dim());
  const double seq = static_cast<double>(training.seq_len);
  const double c = protocols::compute_dtype_bytes(config, dims);
  const double p_bytes = titan::config::dtype_bytes(training.dtype);

  // A block's weights, averaged over the model's blocks (they differ where DeepSeek-V3's dense blocks come first).
  const double n_blocks = static_cast<double>(std::max<int64_t>(1, a.n_layers));
  std::vector<protocols::ParameterShape> dense_block, moe_block;
  if (a.moe_layers() < a.n_layers) dense_block = a.layer_parameter_shapes(0);
  if (a.moe_layers() > 0) moe_block = a.layer_parameter_shapes(a.n_layers - 1);
  const double dense_count = static_cast<double>(a.n_layers - a.moe_layers()), moe_count = static_cast<double>(a.moe_layers());
  // Sums `value(p)` over each kind's parameters, weighted by how many blocks are of that kind, per block.
  const auto per_block = [&](const auto& value) {
    double total = 0;
    for (const auto& p : dense_block) total += dense_count * value(p);
    for (const auto& p : moe_block) total += moe_count * value(p);
    return total / n_blocks;
  };
  const double layer_params = per_block([](const protocols::ParameterShape& p) { return p.shape.size() == 2 ? static_cast<double>(p.numel()) : 0.0; });
  // Whether the float8 converter converts the linear whose weight `p` is: its own selection (filter_fqns, the sizes).
  const auto float8_converted = [&](const protocols::ParameterShape& p) {
    const std::string suffix = ".weight";
    if (p.shape.size() != 2 || p.name.size() <= suffix.size() || !ends_with(p.name, suffix)) return false;
    return quantization::float8_converts(p.name.substr(0, p.name.size() - suffix.size()), p.shape[0], p.shape[1],
                                         config.quantize.linear.float8);
  };
  // The block's linear weights the float8 converter converts.
  const double float8_params = !speed.float8 ? 0.0 : per_block([&](const protocols::ParameterShape& p) {
    return float8_converted(p) ? static_cast<double>(p.numel()) : 0.0;
  });
  const double float8_share = layer_params > 0 ? float8_params / layer_params : 0;
  // Mixture of Experts: the routed experts' 3-D weights (the block's other weights, 2-D, are counted above). A token
  // runs through top_k of them. Under expert parallelism a rank holds E / EP experts (split over TP too when ETP is
  // TP) and computes the rows routed to them, on average its own tokens' top_k copies (split over TP either way).
  const double expert_params = per_block([](const protocols::ParameterShape& p) {
    return p.name.find(".moe.experts.") != std::string::npos ? static_cast<double>(p.numel()) : 0.0;
  });
  const double top_k = a.moe ? static_cast<double>(a.moe->top_k) : 0;
  const double active_expert_params = a.moe ? expert_params * top_k / static_cast<double>(a.moe->num_experts) : 0;
  const double ep = static_cast<double>(dims.ep);
  const double expert_split = ep * (dims.ep > 1 && dims.etp == 1 ? 1.0 : static_cast<double>(dims.tp));
  const bool pipelined = dims.pp > 1;
  int64_t stages_per_rank = 1;
  double bubble = 0;
  int64_t microbatches = 1;
  if (pipelined) {
    const auto traits = distributed::pipeline::schedule_traits(parallelism.pipeline_parallel_schedule);
    stages_per_rank = traits.single_stage ? 1 : 2;
    microbatches = std::max<int64_t>(1, training.local_batch_size / std::max<int64_t>(1, parallelism.pipeline_parallel_microbatch_size));
    // Simulated once per (schedule, ranks, micro-batches): the search asks for the same ones many times.
    static std::map<std::tuple<std::string, int64_t, int64_t>, double> bubbles;
    const auto key = std::make_tuple(traits.name, dims.pp, microbatches);
    auto it = bubbles.find(key);
    if (it == bubbles.end()) {
      auto schedule = distributed::pipeline::Schedule::make(traits.name, static_cast<int>(dims.pp),
                                                            static_cast<int>(dims.pp * stages_per_rank), static_cast<int>(microbatches));
      it = bubbles.emplace(key, schedule.simulate().bubble).first;
    }
    bubble = it->second;
  }
  // Layers on this rank: under pipeline parallelism torchtitan's split (embedding and output count as a layer
  // each); the step is paced by the busiest rank, so its share is used.
  const double units = static_cast<double>(a.n_layers + 2);
  const double stages = static_cast<double>(dims.pp * stages_per_rank);
  const double per_stage = std::ceil(units / stages);
  // Busiest rank's share of the model's layers (balanced split, rounded up to whole layers).
  const double layer_share = pipelined ? std::min(1.0, per_stage * static_cast<double>(stages_per_rank) / units) : 1.0;
  const double layers = static_cast<double>(a.n_layers) * layer_share;
  const double output_share = pipelined ? layer_share : 1.0;  // the output projection, one unit of the split

  // Tokens this rank computes per step (a context-parallel rank holds seq_len / cp of each sequence).
  const double tokens = static_cast<double>(training.local_batch_size) * seq / cp;

  // Recomputation in backward, as a share of the layers' forward: full AC recomputes every block; selective layer
  // AC every N-th; op-level AC (torchtitan's policy, titan's too: nn/kept_ops.h) every block but attention and
  // every other linear (wq, wv, w1, w2 kept; wk, wo, w3 and the router recomputed, and the routed experts' grouped
  // products; float8 and MX linears count as the others).
  double recompute_layers = 0;
  if (ac.mode == "full") recompute_layers = 1;
  else if (ac.mode == "selective" && ac.selective_ac_option != "op")
    recompute_layers = std::floor(static_cast<double>(a.n_layers) / std::max(1.0, std::atof(ac.selective_ac_option.c_str()))) /
                       static_cast<double>(a.n_layers);
  const double op_recompute = ac.mode == "selective" && ac.selective_ac_option == "op" ? 1.0 : 0.0;
  double op_recomputed_params = 0;  // of the block's 2-D weights
  if (op_recompute > 0) {
    // The 2nd, 4th, ... linears in forward order (models::block_linears), averaged over the blocks, and the router.
    const auto recomputed = [&](bool moe_kind) {
      const auto linears = models::block_linears(a, moe_kind);
      double params = 0;
      for (size_t i = 1; i < linears.size(); i += 2) params += linears[i].in * linears[i].out;
      return params;
    };
    const double router = a.moe ? moe_share * d * static_cast<double>(a.moe->num_experts) : 0;
    op_recomputed_params = (dense_count > 0 ? dense_count * recomputed(false) : 0.0) + (moe_count > 0 ? moe_count * recomputed(true) : 0.0);
    op_recomputed_params = op_recomputed_params / n_blocks + router;
  }

  const double peak = cluster.peak_bf16_flops * cluster.matmul_efficiency;
  // The ranks FSDP shards the dense weights over.
  const double shard_group = static_cast<double>(dims.dp_shard * dims.cp);
  const double linear_flops = tokens * layers * 2 / tp * (layer_params * (3 + recompute_layers) + op_recomputed_params);
  const double expert_flops = tokens * layers * 2 / tp * active_expert_params * (3 + recompute_layers + op_recompute);
  const double output_flops = tokens * output_share * 2 * vocab * d / tp * 3;
  // Each product's shape (matmul_shape_factor): per linear of the block, forward (tokens x in -> out, again when
  // recomputed), input gradient (tokens x out -> in) and weight gradient (out x tokens -> in), with TP's split;
  // the factors are averaged weighted by FLOPs (harmonically: the time is what adds up).
  // Products run per micro-batch (under pipeline parallelism a step's tokens come in `microbatches` of them), and
  // each launch pays the profile's fixed time.
  const int64_t sms = cluster.multiprocessors;
  const double launch_flops = cluster.gemm_launch_seconds * peak;
  // float8: the converted linear layers at the fp8 peak (the output projection and the experts stay in bf16), plus
  // the casts; a float8 product's launch time is worth more FLOPs at that rate.
  const double layer_rate = speed.float8 && cluster.peak_fp8_flops > 0 ? cluster.peak_fp8_flops * cluster.matmul_efficiency * cluster.calibration.float8_relative_efficiency : peak;
  const double launch_flops_float8 = cluster.gemm_launch_seconds * layer_rate;
  const double product_tokens = tokens / static_cast<double>(microbatches);
  using Split = models::BlockLinear::Split;
  double linear_weight = 0, linear_time = 0, linear_time_float8 = 0;
  for (const bool moe_kind : {false, true}) {
    const double count = moe_kind ? moe_count : dense_count;
    if (count <= 0) continue;
    for (const auto& l : models::block_linears(a, moe_kind)) {
      const double in = l.split == Split::row ? l.in / tp : l.in, out = l.split == Split::column ? l.out / tp : l.out;
      const double products[3][4] = {{1 + recompute_layers, product_tokens, out, in}, {1, product_tokens, in, out}, {1, out, in, product_tokens}};
      for (const auto& p : products) {
        linear_weight += count * p[0] * in * out;
        linear_time += count * p[0] * in * out / matmul_shape_factor(1, p[1], p[2], p[3], sms, launch_flops);
        linear_time_float8 += count * p[0] * in * out / matmul_shape_factor(1, p[1], p[2], p[3], sms, launch_flops_float8);
      }
    }
  }
  const double linear_shape = linear_weight > 0 ? linear_weight / linear_time : 1.0;
  const double linear_shape_float8 = linear_weight > 0 ? linear_weight / linear_time_float8 : 1.0;
  // The routed experts: one grouped product over the rank's experts, each with its share of the routed rows (under
  // EP a rank's E / EP experts take the rows every EP rank routes to them; with ETP 1 each TP rank its 1 / tp).
  double expert_shape = 1.0;
  if (a.moe && expert_flops > 0) {
    const double local_experts = static_cast<double>(a.moe->num_experts) / ep;
    const double rows = product_tokens * top_k / (dims.ep > 1 && dims.etp == 1 ? tp : 1.0);
    const double per_expert = rows / local_experts;
    const double width = static_cast<double>(a.moe->hidden_dim) / (dims.ep > 1 && dims.etp == 1 ? 1.0 : tp);
    double weight = 0, time = 0;
    for (const auto& [in, out] : {std::pair{d, width}, std::pair{d, width}, std::pair{width, d}}) {  // w1, w3, w2
      const double products[3][4] = {{1 + recompute_layers + op_recompute, per_expert, out, in}, {1, per_expert, in, out}, {1, out, in, per_expert}};
      for (const auto& p : products) {
        weight += p[0];
        time += p[0] / matmul_shape_factor(local_experts, p[1], p[2], p[3], sms, launch_flops);
      }
    }
    expert_shape = weight / time;
  }
  const double output_width = vocab / tp;
  // Its three products have the same FLOPs: their factors averaged harmonically.
  const double output_shape = 3 / (1 / matmul_shape_factor(1, product_tokens, output_width, d, sms, launch_flops) +
                                   1 / matmul_shape_factor(1, product_tokens, d, output_width, sms, launch_flops) +
                                   1 / matmul_shape_factor(1, output_width, d, product_tokens, sms, launch_flops));
  // rowwise_with_gw_hp computes the weight gradient (one of each linear's 3 + R products) in bf16.
  const bool rowwise = speed.float8_recipe != "tensorwise", weight_gradient_high = speed.float8_recipe == "rowwise_with_gw_hp";
  const double float8_flops_share = layer_rate > peak ? float8_share * (weight_gradient_high ? (2 + recompute_layers) / (3 + recompute_layers) : 1.0) : 0.0;
  // Rowwise: the forward products (1 + R of the linear's 3 + R) at kRowwiseForwardGemmRelative of the float8 rate.
  const double float8_seconds_per_flop =
      !rowwise ? 1 / layer_rate
               : ((1 + recompute_layers) / kRowwiseForwardGemmRelative + (weight_gradient_high ? 1.0 : 2.0)) /
                     ((1 + recompute_layers) + (weight_gradient_high ? 1.0 : 2.0)) / layer_rate;
  const double matmul_seconds = linear_flops * (float8_flops_share * float8_seconds_per_flop / linear_shape_float8 + (1 - float8_flops_share) / peak / linear_shape) +
                                expert_flops / (peak * expert_shape) + output_flops / (peak * output_shape);
  double cast_bytes = 0;
  if (speed.float8 && cluster.peak_fp8_flops > 0) {
    // Per linear, each recipe's casts (torchao's): an operand's cast reads it twice in bf16 (its maximum, then the
    // scaled copy) and writes a byte per element. Activations: the input and, in backward, the output gradient;
    // column-parallel layers see the whole d input, row-parallel ones a 1/tp slice. Tensorwise casts each of them
    // twice (as is, and transposed for the weight gradient), the input again in each recomputed forward; rowwise
    // scales each product's operands along that product's contraction, so each operand is cast once per product it
    // takes part in (twice, the weight too), and with the weight gradient in bf16 the input and the output
    // gradient once each. Weights: once per step (tensorwise; on the FSDP shard when float8 all-gathers precompute
    // the scales) or twice (rowwise: forward and input gradient). Rowwise backward products run as tensorwise
    // GEMMs with the row scales applied afterwards (torchao's route around CUTLASS's slow rowwise kernel without fast
    // accumulation): one more read and write of the input gradient in the compute dtype.
    const double inputs = 3 * d + d_attn / tp + 2 * d + hidden / tp;
    const double outputs = (d_attn + 2 * d_kv) / tp + d + 2 * hidden / tp + d;
    const double per_operand = weight_gradient_high ? 1 : 2;
    double per_token = per_operand * (inputs + outputs) + recompute_layers * inputs;
    double elements = tokens * layers * per_token * float8_share;
    const double weights = layers * float8_params / tp;
    elements += rowwise ? 2 * weights : weights / (speed.float8_all_gather ? shard_group : 1.0);
    cast_bytes = elements * kFloat8CastBytesPerElement;
    if (rowwise) cast_bytes += tokens * layers * inputs * float8_share * 2 * c;
  }
  // Causal attention: each query meets seq_len / 2 keys on average, 2 FLOPs per multiply-add, QK^T and PV.
  const double attention_forward = tokens * layers * 2 * seq * d_attn / tp;
  const double attention_seconds = attention_forward * (1 + kAttentionBackwardRatio + recompute_layers) *
                                   (1 + cluster.calibration.ring_attention_overhead_per_rank * (cp - 1)) / (peak * kAttentionEfficiency);

  // Memory-bound kernels of one block per token, forward, counted from titan's eager block: two RMSNorms (about six
  // float32 passes each), RoPE on q and k (four float32 passes), the attention output's transposes, SwiGLU (read
  // two, write one, plus SiLU) and the two residual adds. Backward moves about twice that.
  const double r = p_bytes;
  // A MoE block also routes: the top_k copies of each token sorted by expert and back (read and write each way),
  // the float32 router scores and the weighted sum in float32.
  const double routing_bytes = moe_share * top_k * d * (4 * c + 8);
  const double block_forward_bytes = 2 * 6 * d * 4 + 4 * d_rope * 4 + 2 * d * c + 5 * hidden * c + 2 * 3 * d * r + routing_bytes;
  double memory_bytes = tokens * layers * block_forward_bytes / tp * (3 + recompute_layers + 0.5 * op_recompute) + cast_bytes;
  const double logits = tokens * output_share * (parallelism.disable_loss_parallel ? vocab : vocab / tp);
  memory_bytes += logits * (torchtitan ? kTorchtitanLossBytesPerLogit : loss_bytes_per_logit(c));
  if (speed.compile) memory_bytes *= cluster.calibration.compile_memory_share;
  const double bandwidth = cluster.memory_bandwidth * kBandwidthEfficiency;

  // This rank's parameters (its pipeline share, divided by TP), and what FSDP/HSDP/DDP hold of them.
  // The routed experts: with EP, FSDP shards this rank's E / EP over efsdp; without it they are like the rest.
  double rank_params = (layers * (layer_params + 2 * d) + output_share * (2 * vocab * d + d)) / tp;
  const double rank_experts = layers * expert_params / expert_split;
  const double efsdp = dims.ep > 1 ? static_cast<double>(dims.efsdp()) : 1.0;
  if (dims.ep == 1) rank_params += rank_experts;
  const double local_experts = dims.ep > 1 ? rank_experts / efsdp : 0.0;
  const double local_params = rank_params / shard_group + local_experts;
  const double optimizer_seconds = local_params * kOptimizerBytesPerParameter / bandwidth;

  StepTime out;
  const double compute = matmul_seconds + attention_seconds + memory_bytes / bandwidth + optimizer_seconds;
  // The shapes' factor over all products, weighted by FLOPs as the time weighs them (without float8's rate).
  const double all_flops = linear_flops + expert_flops + output_flops;
  const double shape = all_flops / (linear_flops / linear_shape + expert_flops / expert_shape + output_flops / output_shape);
  out.terms.push_back({"matmuls", matmul_seconds, matmul_seconds,
                       strprintf("%.3g TFLOP at %.0f TFLOP/s%s%s", all_flops / 1e12, peak / 1e12,
                                 sms > 0 ? strprintf(" x %.2f for their shapes", shape).c_str() : "",
                                 layer_rate > peak ? cat(", blocks in float8 at ", static_cast<int64_t>(layer_rate / 1e12), " TFLOP/s").c_str() : "")});
  out.terms.push_back({"attention", attention_seconds, attention_seconds, strprintf("%.3g TFLOP", attention_forward * (1 + kAttentionBackwardRatio + recompute_layers) / 1e12)});
  out.terms.push_back({"memory-bound kernels", memory_bytes / bandwidth, memory_bytes / bandwidth,
                       strprintf("%.3g GB at %s%s", memory_bytes / 1e9, gbs(bandwidth).c_str(), speed.compile ? ", compiled" : "")});
  out.terms.push_back({"optimizer", optimizer_seconds, optimizer_seconds, strprintf("%.0f M parameters", local_params / 1e6)});

  // Links: a group whose ranks fit in one node (tp innermost, then cp, dp_shard, dp_replicate, pp) uses the
  // intra-node link, otherwise each GPU's share of the inter-node network.
  const double per_node = static_cast<double>(cluster.gpus_per_node);
  auto link = [&](double span) {
    return (span <= per_node ? cluster.intra_node_bandwidth : cluster.inter_node_bandwidth) * kLinkEfficiency;
  };
  auto where = [&](double span) { return cat(span <= per_node ? "intra-node " : "inter-node ", gbs(link(span))); };

  // FSDP: all-gather the compute-dtype weights in forward and again in backward (once per step when they stay
  // gathered under pipeline parallelism), reduce-scatter the gradients in mixed_precision_reduce. They overlap the
  // compute except the first gather and the last reduce-scatter.
  double data_parallel = 0, data_parallel_exposed = 0;
  std::string dp_detail;
  if (shard_group > 1) {
    const double span = shard_group * tp;
    const bool reshard = parallelism.fsdp_reshard_after_forward == "always" ||
                         (parallelism.fsdp_reshard_after_forward == "default" && !pipelined);
    // Float8 all-gathers move the converted weights at one byte per element, the rest in the compute dtype.
    const double float8_gathered = speed.float8_all_gather ? layers * float8_params / tp : 0.0;
    const double gathered_bytes = float8_gathered + (rank_params - float8_gathered) * c;
    const double reduce_bytes = titan::config::dtype_bytes(training.mixed_precision_reduce);
    const double fraction = (shard_group - 1) / shard_group;
    const double bytes = fraction * (gathered_bytes * (reshard ? 2 : 1) + rank_params * reduce_bytes);
    data_parallel = bytes / link(span);
    dp_detail = cat("FSDP over ", static_cast<int64_t>(shard_group), " ranks, ", strprintf("%.3g GB", bytes / 1e9), ", ", where(span));
  }
  if (dims.ep > 1 && efsdp > 1) {  // the experts' own FSDP over the efsdp ranks (strided by EP)
    const bool reshard = parallelism.fsdp_reshard_after_forward == "always" ||
                         (parallelism.fsdp_reshard_after_forward == "default" && !pipelined);
    const double span = static_cast<double>(dims.ep_borrowed()) * (dims.etp == 1 ? 1.0 : tp);
    const double bytes = (efsdp - 1) / efsdp *
                         (rank_experts * c * (reshard ? 2 : 1) + rank_experts * titan::config::dtype_bytes(training.mixed_precision_reduce));
    data_parallel += bytes / link(span);
    dp_detail += cat(dp_detail.empty() ? "" : "; ", "experts' FSDP over ", static_cast<int64_t>(efsdp), " ranks, ",
                     strprintf("%.3g GB", bytes / 1e9), ", ", where(span));
  }
  if (dims.dp_replicate > 1) {
    const double rep = static_cast<double>(dims.dp_replicate);
    const double span = rep * shard_group * tp;
    // HSDP all-reduces the reduce-scattered shards in mixed_precision_reduce; DDP the whole gradients in their dtype.
    const double bytes_per_value = shard_group > 1 ? titan::config::dtype_bytes(training.mixed_precision_reduce) : p_bytes;
    const double bytes = 2 * (rep - 1) / rep * local_params * bytes_per_value;
    data_parallel += bytes / link(span);
    dp_detail += cat(dp_detail.empty() ? "" : "; ", shard_group > 1 ? "HSDP" : "DDP", " all-reduce over ",
                     dims.dp_replicate, " replicas, ", strprintf("%.3g GB", bytes / 1e9), ", ", where(span));
  }
  if (data_parallel > 0) {
    const double unexposed_units = units * (pipelined ? layer_share : 1.0);
    data_parallel_exposed = std::max(0.0, data_parallel - compute) + data_parallel / std::max(1.0, unexposed_units);
    out.terms.push_back({"data parallel", data_parallel_exposed, data_parallel, dp_detail});
  }

  // Tensor (+ sequence) parallelism: per block two all-gathers and two reduce-scatters of the activations in
  // forward, as many in backward and in each recomputed forward; nothing hides them, except that async TP overlaps
  // the forward ones with the matmuls.
  if (dims.tp > 1) {
    // Bytes per element of the four collectives of a block in forward and in backward. titan's float8 TP styles
    // (recipe tensorwise, without async TP; torchtitan v0.2.2 never applies its own) move a region's input
    // all-gather in E4M3 when every linear reading it is converted (wq, wk, wv; a dense block's w1, w3), and the
    // backward all-gather of wo's and a dense w2's output gradient in E5M2 when that linear is.
    double forward_bytes = 4 * c, backward_bytes = 4 * c;
    if (!torchtitan && speed.float8 && speed.float8_recipe == "tensorwise" && !parallelism.enable_async_tensor_parallel) {
      const auto converted = [&](const std::vector<protocols::ParameterShape>& block, const std::string& module) {
        for (const auto& p : block)
          if (ends_with(p.name, module + ".weight")) return float8_converted(p);
        return false;
      };
      const auto block_bytes = [&](const std::vector<protocols::ParameterShape>& block, bool moe, bool backward) {
        const double attention = backward ? (converted(block, ".attention.wo") ? 1 : c)
                                          : (converted(block, ".attention.wq") && converted(block, ".attention.wk") &&
                                             converted(block, ".attention.wv") ? 1 : c);
        const double ffn = moe ? c : backward ? (converted(block, ".feed_forward.w2") ? 1 : c)
                                              : (converted(block, ".feed_forward.w1") && converted(block, ".feed_forward.w3") ? 1 : c);
        return 2 * c + attention + ffn;
      };
      // Averaged over the blocks, as per_block does (a kind with no blocks has no shapes and counts 0).
      const auto averaged = [&](bool backward) {
        return (dense_count * block_bytes(dense_block, false, backward) + moe_count * block_bytes(moe_block, true, backward)) / n_blocks;
      };
      forward_bytes = averaged(false);
      backward_bytes = averaged(true);
    }
    const double per_pass = (tp - 1) / tp * tokens * d * layers;
    const double forward = forward_bytes * per_pass * (1 + recompute_layers), backward = backward_bytes * per_pass;
    const double bw = link(tp);
    const double total = (forward + backward) / bw;
    const double exposed = parallelism.enable_async_tensor_parallel ? backward / bw : total;
    out.terms.push_back({"tensor parallel", exposed, total, cat(strprintf("%.3g GB, ", (forward + backward) / 1e9), where(tp),
                                                               parallelism.enable_async_tensor_parallel ? ", forward overlapped (async TP)" : "")});
  }

  // Expert parallelism: per MoE block and pass (forward, backward, and a recomputed forward), an all-to-all sends
  // this rank's routed rows to the experts' ranks and one brings the outputs back; (EP - 1) / EP of them leave the
  // rank. Under TP with ETP 1 each TP rank sends its 1 / TP of the rows. Nothing overlaps them (titan waits).
  if (dims.ep > 1) {
    const double rows = tokens * top_k / (dims.etp == 1 ? tp : 1.0);
    const double per_pass = 2 * rows * d * c * (ep - 1) / ep * layers;
    const double bytes = per_pass * (2 + recompute_layers);
    const double span = ep * (dims.etp == 1 ? 1.0 : tp);
    const double seconds = bytes / link(span);
    out.terms.push_back({"expert parallel", seconds, seconds,
                         cat("all-to-all over ", dims.ep, " ranks, ", strprintf("%.3g GB", bytes / 1e9), ", ", where(span),
                             strprintf("; %.0f M expert parameters on this rank", rank_experts / 1e6))});
  }

  // Context parallelism: the ring passes keys and values cp - 1 times per block in forward (and in recomputation),
  // keys, values and their gradients in backward; each shift overlaps the attention of the chunk in hand.
  if (dims.cp > 1) {
    const double kv = tokens * 2 * d_kv / tp * c * layers * (cp - 1);
    const double bytes = kv * (1 + recompute_layers) + 2 * kv;
    const double bw = link(cp * tp);
    const double total = bytes / bw;
    out.terms.push_back({"context parallel", std::max(0.0, total - attention_seconds), total,
                         cat(strprintf("%.3g GB, ", bytes / 1e9), where(cp * tp))});
  }

  // Pipeline: each micro-batch's activations cross every stage boundary forward and their gradients backward;
  // pp is the outermost mesh dimension, so a boundary crosses nodes unless the job fits in one.
  double p2p = 0;
  if (pipelined) {
    const double message = static_cast<double>(parallelism.pipeline_parallel_microbatch_size) * seq / cp * d * c / tp;
    // Some stage boundary crosses nodes unless the whole job fits in one.
    const double span = static_cast<double>(dims.world_size);
    const double sends = 2 * static_cast<double>(microbatches * stages_per_rank);
    p2p = sends * message / link(span);
    out.terms.push_back({"pipeline p2p", p2p, p2p, cat(strprintf("%.0f messages of %.3g MB, ", sends, message / 1e6), where(span))});
  }

  double busy = 0;
  for (const auto& t : out.terms) busy += t.seconds;
  out.bubble_fraction = bubble;
  out.step_seconds = busy / (1 - bubble);
  if (bubble > 0) out.terms.push_back({"pipeline bubble", out.step_seconds - busy, out.step_seconds - busy,
                                       strprintf("%.1f%% idle (%s, %lld micro-batches)", bubble * 100,
                                                 parallelism.pipeline_parallel_schedule.c_str(), static_cast<long long>(microbatches))});
  double largest = -1;
  for (const auto& t : out.terms)
    if (t.seconds > largest) largest = t.seconds, out.bound = t.name;
  const double tokens_per_rank = static_cast<double>(training.local_batch_size) * seq / (tp * cp * static_cast<double>(dims.pp));
  out.tokens_per_second_per_device = tokens_per_rank / out.step_seconds;
  out.tokens_per_second_low = out.tokens_per_second_per_device / kHeldOutSpeedRatioP90;
  out.tokens_per_second_high = out.tokens_per_second_per_device / kHeldOutSpeedRatioP10;
  out.mfu = out.tokens_per_second_per_device * a.flops_per_token(training.seq_len) / cluster.peak_bf16_flops;
  return out;
}

}  // namespace titan::plan
