#include "titan/cli/gguf_export.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <unistd.h>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/gguf.h"
#include "titan/components/tokenizer/regex_splitter.h"
#include "titan/models/common/decoder_args.h"

namespace titan::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// llama.cpp's token types.
constexpr int32_t kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5;
// Qwen2's (and Qwen3's) split pattern: Llama 3's with single digits.
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// llama.cpp's tensor name for a titan parameter: a dense decoder's, the routers and grouped experts (titan's
// [experts, out, in] layout is llama.cpp's ffn_*_exps as they are), and with `latent` DeepSeek-V3's latent attention,
// shared experts and routing biases (llama.cpp's deepseek2; wkv_b is split apart by the caller).
std::string gguf_name(const std::string& name, bool latent = false) {
  static const std::map<std::string, std::string> top = {
      {"tok_embeddings.weight", "token_embd.weight"}, {"norm.weight", "output_norm.weight"}, {"output.weight", "output.weight"}};
  if (auto it = top.find(name); it != top.end()) return it->second;
  static const std::map<std::string, std::string> block = {
      {"attention_norm.weight", "attn_norm.weight"},   {"attention.wq.weight", "attn_q.weight"},
      {"attention.wk.weight", "attn_k.weight"},        {"attention.wv.weight", "attn_v.weight"},
      {"attention.wo.weight", "attn_output.weight"},   {"attention.q_norm.weight", "attn_q_norm.weight"},
      {"attention.k_norm.weight", "attn_k_norm.weight"}, {"ffn_norm.weight", "ffn_norm.weight"},
      {"feed_forward.w1.weight", "ffn_gate.weight"},   {"feed_forward.w3.weight", "ffn_up.weight"},
      {"feed_forward.w2.weight", "ffn_down.weight"},   {"moe.router.gate.weight", "ffn_gate_inp.weight"},
      {"moe.experts.w1", "ffn_gate_exps.weight"},      {"moe.experts.w3", "ffn_up_exps.weight"},
      {"moe.experts.w2", "ffn_down_exps.weight"}};
  static const std::map<std::string, std::string> latent_block = {
      {"attention.wq_a.weight", "attn_q_a.weight"},      {"attention.q_norm.weight", "attn_q_a_norm.weight"},
      {"attention.wq_b.weight", "attn_q_b.weight"},      {"attention.wkv_a.weight", "attn_kv_a_mqa.weight"},
      {"attention.kv_norm.weight", "attn_kv_a_norm.weight"}, {"moe.expert_bias", "exp_probs_b.bias"},
      {"moe.shared_experts.w1.weight", "ffn_gate_shexp.weight"}, {"moe.shared_experts.w3.weight", "ffn_up_shexp.weight"},
      {"moe.shared_experts.w2.weight", "ffn_down_shexp.weight"}};
  const size_t dot = name.find('.', 7);
  if (starts_with(name, "layers.") && dot != std::string::npos) {
    if (latent)
      if (auto it = latent_block.find(name.substr(dot + 1)); it != latent_block.end())
        return "blk." + name.substr(7, dot - 7) + "." + it->second;
    if (auto it = block.find(name.substr(dot + 1)); it != block.end())
      return "blk." + name.substr(7, dot - 7) + "." + it->second;
  }
  fail("internal: no llama.cpp name for ", quote(name));
}

// Llama 3.1's RoPE scaling as llama.cpp applies it: each frequency divided by a factor (rope_freqs.weight).
at::Tensor rope_factors(const models::DecoderArgs& a) {
  const auto& r = a.rope_scaling;
  const int64_t pairs = a.head_dim() / 2;
  at::Tensor out = at::ones({pairs}, at::kFloat);
  const double low_wavelen = r.original_max_position_embeddings / r.low_freq_factor;
  const double high_wavelen = r.original_max_position_embeddings / r.high_freq_factor;
  for (int64_t i = 0; i < pairs; ++i) {
    const double freq = 1.0 / std::pow(a.rope_theta, 2.0 * static_cast<double>(i) / static_cast<double>(a.head_dim()));
    const double wavelen = 2 * M_PI / freq;
    double factor = 1.0;
    if (wavelen > low_wavelen) {
      factor = r.factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      factor = 1.0 / ((1 - smooth) / r.factor + smooth);
    }
    out[i] = factor;
  }
  return out;
}

// The tokenizer as llama.cpp's BPE ("gpt2") vocabulary, from the tokenizer.json transformers would load.
void add_tokenizer(gguf::Writer& w, const tokenizer::Tokenizer& tok, int64_t vocab_size) {
  const fs::path scratch = fs::temp_directory_path() / cat("titan-gguf-tokenizer-", ::getpid());
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  tok.save_hf_files(scratch.string());
  json hf;
  if (fs::exists(scratch / "tokenizer.json")) hf = json::parse(std::ifstream(scratch / "tokenizer.json"));
  fs::remove_all(scratch);
  if (!hf.is_object() || !hf.contains("model") || hf["model"].value("type", "") != "BPE")
    fail("the tokenizer ", tok.source_path(), " is not a byte-level BPE (", tok.description(),
         "); titan's GGUF export embeds BPE tokenizers (Llama 3's, Qwen's, titan's built-in) only");
  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  std::vector<int32_t> types(static_cast<size_t>(vocab_size), kUnused);
  std::vector<bool> known(static_cast<size_t>(vocab_size), false);
  auto place = [&](int64_t id, const std::string& text, int32_t type) {
    if (id < 0 || id >= vocab_size) fail("the tokenizer ", tok.source_path(), " has id ", id, " beyond the model's vocabulary of ", vocab_size);
    tokens[static_cast<size_t>(id)] = text;
    types[static_cast<size_t>(id)] = type;
    known[static_cast<size_t>(id)] = true;
  };
  for (const auto& [text, id] : hf["model"]["vocab"].items()) place(id.get<int64_t>(), text, kNormal);
  for (const auto& added : hf.value("added_tokens", json::array()))
    place(added.at("id").get<int64_t>(), added.at("content").get<std::string>(), added.value("special", false) ? kControl : kUserDefined);
  for (int64_t id = 0; id < vocab_size; ++id)
    if (!known[static_cast<size_t>(id)]) tokens[static_cast<size_t>(id)] = cat("[PAD", id, "]");
  std::vector<std::string> merges;
  for (const auto& m : hf["model"].value("merges", json::array()))
    merges.push_back(m.is_string() ? m.get<std::string>() : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  // llama.cpp picks its pre-tokenizer by name: the split pattern says which.
  std::string pattern;
  for (const auto& p : hf.value("pre_tokenizer", json::object()).value("pretokenizers", json::array()))
    if (p.value("type", "") == "Split" && p.contains("pattern") && p["pattern"].contains("Regex")) pattern = p["pattern"]["Regex"];
  std::string pre = "default";
  if (pattern == tokenizer::kLlama3Pattern) pre = "llama-bpe";
  else if (pattern == kQwen2Pattern) pre = "qwen2";
  else
    std::cerr << "warning: the tokenizer's split pattern is neither Llama 3's nor Qwen's; llama.cpp will split text with "
                 "its default pattern, so its tokens for a text may differ from titan's (token ids given directly are unaffected)\n";
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", pre);
  w.add_strings("tokenizer.ggml.tokens", tokens);
  w.add_int32s("tokenizer.ggml.token_type", types);
  w.add_strings("tokenizer.ggml.merges", merges);
  if (tok.bos_id()) w.add_uint32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*tok.bos_id()));
  if (tok.eos_id()) w.add_uint32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(*tok.eos_id()));
  w.add_bool("tokenizer.ggml.add_bos_token", tok.bos_id().has_value());
}

// What llama.cpp's qwen3moe computes in every block: softmax over all experts' router logits, the top-k renormalised
// to sum to one, the experts' SwiGLU outputs weighted by them; no shared expert, no groups, no bias. Anything else
// would load and silently compute another model, so it is refused by name.
void check_qwen3moe(const models::DecoderArgs& a, const std::string& source) {
  const models::MoEArgs& m = *a.moe;
  std::string why;
  if (m.score_func != "softmax") why = cat("its router scores are ", m.score_func, " (llama.cpp's qwen3moe takes a softmax)");
  else if (!m.route_norm) why = "its top-k weights are not renormalised (Hugging Face's norm_topk_prob = false; llama.cpp's qwen3moe always renormalises them)";
  else if (m.route_scale != 1.0) why = cat("its top-k weights are scaled by ", m.route_scale, " (llama.cpp's qwen3moe does not scale them)");
  else if (m.num_shared_experts > 0) why = cat("it has ", m.num_shared_experts, " shared expert(s) (llama.cpp's qwen3moe has none)");
  else if (m.num_expert_groups) why = "it routes over expert groups (llama.cpp's qwen3moe does not)";
  else if (m.score_before_experts) why = "it scales the experts' inputs by the scores (llama.cpp's qwen3moe scales their outputs)";
  else if (a.n_dense_layers > 0) why = cat("its first ", a.n_dense_layers, " block(s) are dense (llama.cpp's qwen3moe routes in every block)");
  if (!why.empty()) fail("--format gguf: ", source, " is a Qwen3-MoE model that llama.cpp's qwen3moe cannot run as trained: ", why);
}

// What llama.cpp's deepseek2 computes: latent attention (queries whole or through a normed low-rank projection; keys
// and values from the normed latent, expanded per head, and one shared rotary key), YaRN RoPE on the rotary columns,
// dense leading blocks, then routed experts (softmax or sigmoid scores, a selection-only bias, optionally expert
// groups, the top-k optionally renormalised and scaled) weighting the experts' outputs, beside shared experts.
void check_deepseek2(const models::DecoderArgs& a, const std::string& source) {
  const models::MoEArgs& m = *a.moe;
  std::string why;
  if (m.score_before_experts) why = "it scales the experts' inputs by the scores (llama.cpp's deepseek2 scales their outputs)";
  else if (a.mla->norm_eps && *a.mla->norm_eps != a.norm_eps)
    why = cat("its latent norms' epsilon (", *a.mla->norm_eps, ") differs from the other norms' (", a.norm_eps,
              "); llama.cpp's deepseek2 has one epsilon for every norm");
  if (!why.empty()) fail("--format gguf: ", source, " is a DeepSeek-V3 model that llama.cpp's deepseek2 cannot run as trained: ", why);
}

}  // namespace

void write_gguf(const ModelSource& source, const std::string& to, const std::string& type_name, const tokenizer::Tokenizer& tok) {
  const auto* a = dynamic_cast<const models::DecoderArgs*>(source.args.get());
  const bool moe = a && a->moe && a->family_name == "qwen3";
  const bool latent = a && a->mla && a->moe && a->family_name == "deepseek_v3";
  if (!a || (a->mla && !latent) || (a->moe && !moe && !latent) ||
      (a->family_name != "llama3" && a->family_name != "qwen3" && a->family_name != "deepseek_v3"))
    fail("--format gguf: ", source.description, " holds a ", source.spec->name,
         a && a->mla ? " latent-attention" : a && a->moe ? " Mixture-of-Experts" : "",
         " model; titan's GGUF export covers Llama 3 (llama.cpp's llama), Qwen3 (qwen3), Qwen3-MoE (qwen3moe) and "
         "DeepSeek-V3 (deepseek2) so far");
  if (moe) check_qwen3moe(*a, source.description);
  if (latent) check_deepseek2(*a, source.description);
  const gguf::TensorType type = gguf::parse_tensor_type(type_name, "--gguf-type");
  const std::string arch = a->family_name == "llama3" ? "llama" : moe ? "qwen3moe" : latent ? "deepseek2" : "qwen3";
  if (a->family_name == "qwen3" && a->rope_scaling.enabled)
    fail("--format gguf: this Qwen3 model has Llama 3.1 RoPE scaling, which llama.cpp's qwen3 does not apply");
  gguf::Writer w;
  w.add_string("general.architecture", arch);
  w.add_string("general.name", source.flavor_name.empty() ? "titan" : source.flavor_name);
  const uint32_t file_type = type == gguf::TensorType::f32 ? 0 : type == gguf::TensorType::f16 ? 1
                             : type == gguf::TensorType::q8_0 ? 7 : 32;
  w.add_uint32("general.file_type", file_type);
  if (type == gguf::TensorType::q8_0) w.add_uint32("general.quantization_version", 2);
  auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  w.add_uint32(arch + ".context_length", u32(a->max_seq_len));
  w.add_uint32(arch + ".embedding_length", u32(a->dim));
  w.add_uint32(arch + ".block_count", u32(a->n_layers));
  w.add_uint32(arch + ".feed_forward_length", u32(a->ffn_hidden_dim()));
  w.add_uint32(arch + ".attention.head_count", u32(a->n_heads));
  w.add_uint32(arch + ".attention.head_count_kv", u32(latent ? 1 : a->kv_heads()));  // deepseek2: one latent for all heads
  w.add_float32(arch + ".rope.freq_base", static_cast<float>(a->rope_theta));
  w.add_float32(arch + ".attention.layer_norm_rms_epsilon", static_cast<float>(a->norm_eps));
  if (latent) {
    // llama.cpp runs latent attention as one key/value head of the latent (and the rotary key), the per-head
    // expansion folded into the queries and the output (attn_k_b, attn_v_b).
    const models::LatentAttentionArgs& l = *a->mla;
    w.add_uint32(arch + ".attention.key_length", u32(l.kv_lora_rank + l.qk_rope_head_dim));
    w.add_uint32(arch + ".attention.value_length", u32(l.kv_lora_rank));
    w.add_uint32(arch + ".attention.key_length_mla", u32(l.qk_head_dim()));
    w.add_uint32(arch + ".attention.value_length_mla", u32(l.v_head_dim));
    w.add_uint32(arch + ".attention.kv_lora_rank", u32(l.kv_lora_rank));
    if (l.q_lora_rank > 0) w.add_uint32(arch + ".attention.q_lora_rank", u32(l.q_lora_rank));
    w.add_uint32(arch + ".rope.dimension_count", u32(l.qk_rope_head_dim));
    w.add_uint32(arch + ".leading_dense_block_count", u32(a->n_dense_layers));
    const models::MoEArgs& m = *a->moe;
    w.add_uint32(arch + ".expert_shared_count", u32(m.num_shared_experts));
    w.add_float32(arch + ".expert_weights_scale", static_cast<float>(m.route_scale));
    w.add_bool(arch + ".expert_weights_norm", m.route_norm);
    w.add_uint32(arch + ".expert_gating_func", m.score_func == "sigmoid" ? 2 : 1);  // llama.cpp: 1 softmax, 2 sigmoid
    if (m.num_expert_groups) {
      w.add_uint32(arch + ".expert_group_count", u32(*m.num_expert_groups));
      w.add_uint32(arch + ".expert_group_used_count", u32(m.num_limited_groups.value_or(*m.num_expert_groups)));
    }
    if (a->yarn && a->max_seq_len > a->yarn->original_seq_len) {
      w.add_string(arch + ".rope.scaling.type", "yarn");
      w.add_float32(arch + ".rope.scaling.factor", static_cast<float>(a->yarn->factor));
      w.add_uint32(arch + ".rope.scaling.original_context_length", u32(a->yarn->original_seq_len));
      w.add_float32(arch + ".rope.scaling.yarn_beta_fast", static_cast<float>(a->yarn->beta_fast));
      w.add_float32(arch + ".rope.scaling.yarn_beta_slow", static_cast<float>(a->yarn->beta_slow));
      // llama.cpp's deepseek2 reads 0.1 x mscale_all_dim here (the factor its converter writes).
      w.add_float32(arch + ".rope.scaling.yarn_log_multiplier", static_cast<float>(0.1 * a->yarn->mscale));
    }
  } else {
    w.add_uint32(arch + ".attention.key_length", u32(a->head_dim()));
    w.add_uint32(arch + ".attention.value_length", u32(a->head_dim()));
    w.add_uint32(arch + ".rope.dimension_count", u32(a->head_dim()));
  }
  w.add_uint32(arch + ".vocab_size", u32(a->vocab_size));
  if (moe || latent) {
    w.add_uint32(arch + ".expert_count", u32(a->moe->num_experts));
    w.add_uint32(arch + ".expert_used_count", u32(a->moe->top_k));
    w.add_uint32(arch + ".expert_feed_forward_length", u32(a->moe->hidden_dim));
  }
  add_tokenizer(w, tok, a->vocab_size);
  std::vector<std::string> dropped;  // non-zero routing biases, which qwen3moe has no tensor for
  double dropped_max = 0;
  for (const auto& [name, tensor] : source.weights) {
    if (latent && ends_with(name, ".attention.wkv_b.weight")) {
      // [heads x (nope + v), latent] as llama.cpp's attn_k_b [heads, latent, nope] (transposed) and attn_v_b
      // [heads, v, latent].
      const models::LatentAttentionArgs& l = *a->mla;
      const at::Tensor kv = tensor.view({a->n_heads, l.qk_nope_head_dim + l.v_head_dim, l.kv_lora_rank});
      const std::string prefix = "blk." + name.substr(7, name.find('.', 7) - 7) + ".";  // layers.N.attention.wkv_b.weight
      for (const auto& [suffix, part] : {std::pair{"attn_k_b.weight", kv.narrow(1, 0, l.qk_nope_head_dim).transpose(1, 2)},
                                         std::pair{"attn_v_b.weight", kv.narrow(1, l.qk_nope_head_dim, l.v_head_dim)}}) {
        gguf::TensorType t = type;
        if (t == gguf::TensorType::q8_0 && part.size(-1) % 32 != 0) t = gguf::TensorType::f16;
        w.add_tensor(prefix + suffix, part.contiguous(), t);
      }
      continue;
    }
    if (!latent && ends_with(name, ".moe.expert_bias")) {
      if (const double largest = tensor.numel() ? tensor.abs().max().item<double>() : 0.0; largest > 0) {
        dropped.push_back(name);
        dropped_max = std::max(dropped_max, largest);
      }
      continue;
    }
    // The router stays F32 as llama.cpp's own converter keeps it: near-tied experts are chosen by its logits.
    gguf::TensorType t = tensor.dim() == 1 || ends_with(name, ".moe.router.gate.weight") ? gguf::TensorType::f32 : type;
    if (t == gguf::TensorType::q8_0 && tensor.size(-1) % 32 != 0) t = gguf::TensorType::f16;
    w.add_tensor(gguf_name(name, latent), tensor, t);
  }
  if (a->family_name == "llama3" && a->rope_scaling.enabled) w.add_tensor("rope_freqs.weight", rope_factors(*a), gguf::TensorType::f32);
  if (!dropped.empty())
    std::cerr << "warning: llama.cpp's qwen3moe has no routing bias; " << dropped.size() << " non-zero bias tensor(s), from "
              << quote(dropped.front()) << " to " << quote(dropped.back()) << " (largest magnitude " << dropped_max
              << "), are left out, so near-tied expert choices may differ from the checkpoint's (train with "
                 "model.moe_load_balance_coeff = 0 for an exact export)\n";
  w.write(to);
  std::cerr << "wrote GGUF file " << to << " (llama.cpp architecture " << arch << ", " << gguf::tensor_type_name(type)
            << " matrices) from " << source.description << "\n";
}

}  // namespace titan::cli
