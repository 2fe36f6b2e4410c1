// `titan generate`: samples continuations of prompts from any checkpoint titan reads (a titan step folder, a
// Hugging Face directory, a torch DCP folder, Meta's .pth), with a KV cache: greedy, temperature, top-k, top-p, a
// seed, several prompts as one left-padded batch, stopping at the tokenizer's EOS. On one process, or under tensor
// parallelism over the ranks of an mpirun/srun launch: rank 0 reads the prompts, samples and prints; every rank
// runs its share of the model.
#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>

#include "titan/cli/arguments.h"
#include "titan/cli/commands.h"
#include "titan/cli/model_source.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/distributed/init_world.h"
#include "titan/distributed/sharded_parameter.h"
#include "titan/nn/storage.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/common/kv_cache.h"

namespace titan::cli {
namespace {

namespace fs = std::filesystem;

const char* kGenerateUsage =
    "usage: titan generate --checkpoint PATH [--prompt TEXT]... [--prompt-file FILE]... [--tokenizer PATH]\n"
    "                      [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
    "                      [--model NAME] [--flavor F] [--dtype float32|bfloat16] [--device cpu|cuda]\n"
    "                      [--config FILE] [--model.KEY VALUE]... [--context N] [--ignore-eos] [--json]\n"
    "  --checkpoint: a titan checkpoint step folder, a Hugging Face directory, a torch DCP folder (torchtitan's;\n"
    "          with --flavor), Meta's consolidated.NN.pth folder or a torch.save state dict (as `titan convert --from`).\n"
    "  --prompt: a prompt (repeat for a batch); --prompt-file: a file whose whole text is one prompt; with neither,\n"
    "          standard input is one prompt. Each is encoded as BOS + its tokens and continued.\n"
    "  --tokenizer: a tokenizer file or directory; default: the one the checkpoint records (a titan run's, an HF\n"
    "          directory's own).\n"
    "  --max-new-tokens: tokens to add to each prompt at most (default 64); a prompt stops early at EOS.\n"
    "  --temperature: 0 is greedy (the most likely token); default 1. --top-k: sample among the K most likely\n"
    "          tokens; --top-p: among the most likely tokens whose probabilities add up to P, in (0, 1].\n"
    "  --seed: the sampling seed (default: a random one, printed so that the run can be repeated).\n"
    "  --dtype: float32 (default) or bfloat16 (autocast, as training's mixed precision).\n"
    "  --device: cpu (default) or cuda. Under mpirun or srun with N ranks the model runs tensor-parallel over them\n"
    "          (each rank on its GPU where LibTorch sees GPUs, else on the CPU); rank 0 reads standard input,\n"
    "          samples and prints.\n"
    "  --context: the positions a row may take, prompt and new tokens together (default: the model's max_seq_len,\n"
    "          the training seq_len for a titan run). Past max_seq_len, RoPE continues with the model's own\n"
    "          frequencies; those positions were never trained, and a warning says so.\n"
    "  --ignore-eos: always generate --max-new-tokens (timing). --json: one JSON object per prompt on standard\n"
    "          output (prompt, prompt_ids, ids, logprobs, text, stop) instead of the text; logprobs: each new\n"
    "          token's log-probability under the model (before temperature, top-k and top-p).\n";

struct Options {
  std::string checkpoint, tokenizer, model, flavor, dtype = "float32", device = "cpu";
  std::vector<std::string> prompts, job;  // job: --config and --model.KEY arguments
  int64_t max_new_tokens = 64, top_k = 0, context = 0;  // context 0: the model's max_seq_len
  double temperature = 1.0, top_p = 1.0;
  std::optional<uint64_t> seed;
  bool ignore_eos = false, json = false, device_given = false;
};

// `read_stdin`: false on the ranks after the first of a launch (only rank 0 reads standard input; it sends the
// others the encoded prompts). `check_stdin`: whether an empty standard input is refused here (a launch of several
// ranks refuses it on rank 0 later, where the other ranks learn of it instead of waiting).
Options parse(const std::vector<std::string>& args, bool read_stdin, bool check_stdin) {
  Options o;
  bool prompt_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--ignore-eos") { o.ignore_eos = true; continue; }
    if (a == "--json") { o.json = true; continue; }
    if (take_job_argument(args, i, o.job)) continue;
    static const std::vector<std::string> with_value = {"--checkpoint", "--prompt", "--prompt-file", "--tokenizer", "--model",
                                                        "--flavor", "--dtype", "--device", "--max-new-tokens", "--top-k",
                                                        "--context", "--temperature", "--top-p", "--seed"};
    // An unknown option is named as such even at the end of the line (not as one that "expects a value").
    if (std::find(with_value.begin(), with_value.end(), a) == with_value.end())
      fail("unknown option ", quote(a), " for `titan generate`\n", kGenerateUsage);
    if (i + 1 >= args.size()) fail(a, " expects a value\n", kGenerateUsage);
    const std::string v = args[++i];
    if (a == "--checkpoint") o.checkpoint = v;
    else if (a == "--prompt") o.prompts.push_back(v), prompt_given = true;
    else if (a == "--prompt-file") {
      std::ifstream in(v, std::ios::binary);
      if (!in) fail("--prompt-file ", quote(v), ": cannot be read");
      o.prompts.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      prompt_given = true;
    } else if (a == "--tokenizer") o.tokenizer = v;
    else if (a == "--model") o.model = v;
    else if (a == "--flavor") o.flavor = v;
    else if (a == "--dtype") o.dtype = v;
    else if (a == "--device") o.device = v, o.device_given = true;
    else if (a == "--max-new-tokens") o.max_new_tokens = integer_argument(a, v);
    else if (a == "--top-k") o.top_k = integer_argument(a, v);
    else if (a == "--context") o.context = integer_argument(a, v);
    else if (a == "--temperature") o.temperature = number_argument(a, v);
    else if (a == "--top-p") o.top_p = number_argument(a, v);
    else if (a == "--seed") {
      const int64_t seed = integer_argument(a, v);
      if (seed < 0) fail("--seed must be 0 or positive, got ", seed);
      o.seed = static_cast<uint64_t>(seed);
    }
    else fail("unknown option ", quote(a), " for `titan generate`\n", kGenerateUsage);
  }
  if (o.checkpoint.empty()) fail("`titan generate` needs --checkpoint\n", kGenerateUsage);
  if (!prompt_given && read_stdin)
    o.prompts.emplace_back(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  for (size_t i = 0; i < o.prompts.size(); ++i)
    if (o.prompts[i].empty() && (prompt_given || check_stdin))
      fail("prompt ", i + 1, " is empty", prompt_given ? "" : " (nothing on standard input)", "; give the text to continue");
  if (o.max_new_tokens < 1) fail("--max-new-tokens must be at least 1, got ", o.max_new_tokens);
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) fail("--temperature must be 0 (greedy) or positive, got ", o.temperature);
  if (!(o.top_p > 0 && o.top_p <= 1)) fail("--top-p must be in (0, 1], got ", o.top_p);
  if (o.top_k < 0) fail("--top-k must be 0 (off) or positive, got ", o.top_k);
  if (o.context < 0 || (o.context == 0 && std::find(args.begin(), args.end(), "--context") != args.end()))
    fail("--context must be a positive number of positions, got ", o.context);
  if (o.dtype != "float32" && o.dtype != "bfloat16") fail("--dtype ", quote(o.dtype), ": expected float32 or bfloat16");
  if (o.device != "cpu" && o.device != "cuda" && o.device.rfind("cuda:", 0) != 0)
    fail("--device ", quote(o.device), ": expected cpu or cuda (cuda:N for one GPU of several)");
  if (o.device != "cpu" && !at::hasCUDA())
    fail("--device ", quote(o.device), ": LibTorch sees no GPU here (no NVIDIA driver, no device, or a CPU-only LibTorch); use --device cpu");
  return o;
}

// The next token of each row from its logits (float32, batch x vocab): argmax at temperature 0, else a draw from
// the softmax of logits / temperature restricted to the top-k and to the top-p nucleus.
at::Tensor next_tokens(at::Tensor logits, const Options& o, at::Generator& generator) {
  if (o.temperature == 0) return logits.argmax(-1);
  logits = logits / o.temperature;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < logits.size(-1)) {
    const at::Tensor kth = std::get<0>(logits.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, minus_inf);
  }
  if (o.top_p < 1) {
    auto [sorted, order] = logits.sort(-1, /*descending=*/true);
    const at::Tensor probs = at::softmax(sorted, -1);
    // A token stays when the tokens ahead of it hold less than top_p of the mass (the first always stays).
    const at::Tensor outside = (probs.cumsum(-1) - probs) >= o.top_p;
    logits = at::full_like(logits, minus_inf).scatter(-1, order, sorted.masked_fill(outside, minus_inf));
  }
  return at::multinomial(at::softmax(logits, -1), 1, /*replacement=*/false, generator).squeeze(-1);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs `work` on every rank and then, under a launch of several ranks, learns over `control` (collective) whether
// every rank got through: a rank whose `work` threw rethrows its error, and the others fail naming the ranks that
// stopped, so that no rank waits in a later collective for one that is gone.
template <typename Work>
void on_every_rank(distributed::Communicator* control, const std::string& what, Work&& work) {
  std::exception_ptr error;
  try {
    work();
  } catch (...) {
    if (!control) throw;
    error = std::current_exception();
  }
  if (!control) return;
  at::Tensor failed = at::zeros({control->size()}, at::kLong);
  failed[control->rank()] = error ? 1 : 0;
  failed = failed.to(control->tensor_device());
  control->all_reduce(failed, distributed::ReduceOp::Sum);
  failed = failed.cpu();
  if (error) std::rethrow_exception(error);
  std::vector<int64_t> ranks;
  for (int64_t r = 0; r < failed.size(0); ++r)
    if (failed[r].item<int64_t>() != 0) ranks.push_back(r);
  if (!ranks.empty()) fail_after_peer(what, " failed on rank(s) ", join_ints(ranks), " (the error is theirs); this rank stops too");
}

// Rank 0's host tensor on every rank of `group` (collective), through the group's own device.
at::Tensor broadcast_from_first(distributed::Communicator& group, const at::Tensor& tensor) {
  at::Tensor moved = tensor.to(group.tensor_device()).contiguous();
  group.broadcast(moved, 0);
  return moved.to(at::kCPU);
}

}  // namespace

int run_generate(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kGenerateUsage << kModelChoiceUsage;
      return 0;
    }
  const distributed::LaunchInfo launch = distributed::detect_launch();
  const bool first = launch.rank == 0;
  const bool several = launch.world_size > 1;
  const Options o = parse(args, first, /*check_stdin=*/!several);

  // Under a launch of several ranks: each rank's device and the communicators of the tensor-parallel group.
  at::Device device(o.device);
  std::shared_ptr<distributed::Communicator> group, control;
  if (launch.world_size > 1) {
    distributed::ProcessWorld world = distributed::init_world(launch, std::chrono::seconds(300));
    if (o.device_given && device.type() != world.device.type())
      fail("--device ", o.device, ": under ", launch.launcher, " each rank takes ", world.device.is_cuda() ? "its GPU" : "the CPU",
           " (LibTorch ", world.device.is_cuda() ? "sees GPUs" : "sees no GPU", "); leave --device out");
    device = world.device;
    group = world.comm;
    control = world.control;
    // Loading may take the ranks different times (files read from a shared file system): the agreement after it
    // waits that long for the slowest.
    for (auto* c : {group.get(), control.get()}) c->set_timeout(std::chrono::seconds(3600));
  }

  // The model is built once the source has said its family and shape, without storage, and split over the ranks
  // under TP; each rank then allocates and reads only its own slices of the weights.
  std::shared_ptr<models::Decoder> model;
  std::vector<distributed::ShardedParameter> params;
  std::map<std::string, distributed::Box> pieces;
  auto build = [&](const ModelSource& s) {
    auto built = s.spec->build(*s.args, nn::ParameterOptions{at::TensorOptions().dtype(at::kFloat).device(device), /*allocate=*/false});
    model = std::dynamic_pointer_cast<models::Decoder>(built);
    if (!model) fail("model family ", s.spec->name, " cannot be sampled from yet");
    model->move_buffers(device);
    params = group ? models::parallelize_for_sampling(*model, group) : distributed::describe_parameters(*model);
    distributed::materialize(params);
    for (const auto& p : params) pieces.emplace(p.name, p.layout.local_box());
  };
  ModelSource source;
  // Rank 0 alone reads the tokenizer and the prompts (encoded, left-padded into one batch): the others take their
  // shape and the EOS id from it.
  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::vector<std::vector<int32_t>> prompts;
  int64_t longest = 0, batch = 0, eos_id = -1;
  on_every_rank(control.get(), "reading the checkpoint, tokenizer or prompts", [&] {
    source = read_model_source(o.checkpoint, model_choice(o.model, o.flavor, o.job), nullptr,
                               [&](const ModelSource& s, const std::string& name, const std::vector<int64_t>& shape) {
                                 if (!model) build(s);
                                 auto it = pieces.find(name);
                                 return it != pieces.end() ? it->second : distributed::Box::whole(shape);
                               },
                               /*weights_only=*/true);
    if (!model) build(source);
    if (!first) return;
    const std::string tokenizer_path = !o.tokenizer.empty() ? o.tokenizer : source.tokenizer_path;
    if (!o.tokenizer.empty() && !fs::exists(o.tokenizer)) fail("--tokenizer ", quote(o.tokenizer), ": no such file or directory");
    if (tokenizer_path.empty() || !fs::exists(tokenizer_path))
      fail(source.description, tokenizer_path.empty() ? " records no tokenizer" : " records the tokenizer " + tokenizer_path + ", which no longer exists",
           "; pass --tokenizer PATH (a tokenizer file or model.hf_assets_path)");
    tok = tokenizer::load(tokenizer_path);
    if (tok->vocab_size() > source.args->vocabulary())
      fail("the tokenizer ", tokenizer_path, " has ", tok->vocab_size(), " ids, more than the model's vocabulary (",
           source.args->vocabulary(), "): not the model's tokenizer");
    for (size_t i = 0; i < o.prompts.size(); ++i)
      if (o.prompts[i].empty()) fail("prompt ", i + 1, " is empty (nothing on standard input); give the text to continue");
    for (const auto& text : o.prompts) {
      prompts.push_back(tok->encode_prompt(text));
      longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts.back().size()));
    }
    batch = static_cast<int64_t>(prompts.size());
    if (tok->eos_id()) eos_id = *tok->eos_id();
  });
  if (control) {
    const at::Tensor shape = broadcast_from_first(*control, at::tensor({batch, longest, eos_id}, at::kLong));
    batch = shape[0].item<int64_t>();
    longest = shape[1].item<int64_t>();
    eos_id = shape[2].item<int64_t>();
    for (auto* c : {group.get(), control.get()}) c->set_timeout(std::chrono::seconds(300));
  }
  const int64_t trained = source.args->context_length(), context = o.context ? o.context : trained;
  const int64_t total = longest + o.max_new_tokens;
  if (total > context)
    fail("the longest prompt (", longest, " tokens) and --max-new-tokens ", o.max_new_tokens, " make ", total, " positions, more than ",
         o.context ? cat("--context ", context) : cat("the model's context of ", context, " (max_seq_len)"),
         "; shorten the prompt, ask for fewer tokens", o.context ? ", or raise --context" : ", or pass --context N to go past it");
  if (total > trained) {
    model->extend_positions(total);
    if (first)
      std::cerr << "warning: positions " << trained + 1 << " to " << total << " are past the model's max_seq_len of " << trained
                << " (what it was trained on): RoPE continues with its frequencies there, but expect the text to degrade\n";
  }
  at::Tensor tokens = at::zeros({batch, longest}, at::kLong), padding = at::zeros({batch}, at::kLong);
  for (int64_t b = 0; b < static_cast<int64_t>(prompts.size()); ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    const int64_t pad = longest - static_cast<int64_t>(p.size());
    padding[b] = pad;
    for (size_t j = 0; j < p.size(); ++j) tokens[b][pad + static_cast<int64_t>(j)] = p[j];
  }
  if (control) {
    tokens = broadcast_from_first(*control, tokens);
    padding = broadcast_from_first(*control, padding);
  }

  // The checkpoint's weights (each rank's slices under tensor parallelism) into the model.
  int64_t whole_parameters = 0, local_parameters = 0;
  for (const auto& p : source.args->parameter_shapes()) whole_parameters += c10::multiply_integers(p.shape);
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> weights(source.weights.begin(), source.weights.end());
    for (auto& p : params) {
      p.local.copy_(weights.at(p.name));
      local_parameters += p.local.numel();
    }
    for (auto& item : model->named_buffers())
      if (auto it = weights.find(item.key()); it != weights.end()) item.value().copy_(it->second);
    source.weights.clear();
  }
  model->eval();

  models::KvCache cache(*model, padding.to(device), total);
  // Rank 0 samples (and its seed is the one printed); the others take its tokens.
  const uint64_t seed = o.seed ? *o.seed : std::random_device{}();
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const bool autocast = o.dtype == "bfloat16";
  c10::InferenceMode inference;
  if (autocast) {
    at::autocast::set_autocast_dtype(device.type(), at::kBFloat16);
    at::autocast::set_autocast_enabled(device.type(), true);
  }
  // Each decoding step attends over one more cached key, and cuDNN's attention (LibTorch's first choice for bf16 on
  // recent GPUs) builds a plan for every new shape: on an H200 that held bf16 sampling to 15 tokens/s against 432 in
  // float32. The flash and memory-efficient kernels take any length as it comes.
  if (device.is_cuda()) at::globalContext().setSDPUseCuDNN(false);
  const int64_t n = static_cast<int64_t>(model->layers.size());
  // The logits of each row's last token of `input` (batch x count), whose cache positions start at `start`.
  auto step = [&](const at::Tensor& input, int64_t start) {
    const int64_t count = input.size(1);
    cache.advance_to(start);
    const at::Tensor positions = cache.positions(start, count).to(device);
    at::Tensor h = model->forward_modules(input.to(device), 0, n + 2, start + count, positions);
    h = h.narrow(1, count - 1, 1);
    return model->forward_modules(h, n + 2, n + 3, 1).select(1, 0).to(at::kCPU, at::kFloat);
  };

  std::vector<std::vector<int32_t>> generated(static_cast<size_t>(batch));
  std::vector<std::vector<double>> logprobs(static_cast<size_t>(batch));  // the model's, before temperature
  std::vector<bool> stopped(static_cast<size_t>(batch), false);
  const auto start_time = std::chrono::steady_clock::now();
  at::Tensor logits = step(tokens, 0);
  const double prefill_seconds = seconds_since(start_time);
  int64_t produced = 0;
  for (int64_t t = 0; t < o.max_new_tokens; ++t) {
    // A failure of rank 0's sampling (a non-finite logit) reaches the others as ids of -1.
    at::Tensor next = at::full({batch}, -1, at::kLong);
    std::exception_ptr sampling_error;
    if (first) {
      try {
        // A model whose vocabulary is wider than its tokenizer (padded to a round size, as torchtitan's debug model's
        // 2,048 over its test tokenizer's 2,004 ids) never samples an id the tokenizer cannot decode; the reported
        // log-probabilities stay the model's.
        at::Tensor choosable = logits;
        if (const int64_t ids = tok->vocab_size(); ids < logits.size(-1)) {
          choosable = logits.clone();
          choosable.narrow(-1, ids, logits.size(-1) - ids).fill_(-std::numeric_limits<float>::infinity());
        }
        next = next_tokens(choosable, o, generator);
      } catch (...) {
        if (!control) throw;
        sampling_error = std::current_exception();
      }
    }
    if (control) next = broadcast_from_first(*control, next);
    if (sampling_error) std::rethrow_exception(sampling_error);
    if (next[0].item<int64_t>() < 0) fail("rank 0 could not sample the next tokens (its error is above); this rank stops too");
    bool all_stopped = true;
    const at::Tensor chosen = first ? at::log_softmax(logits, -1).gather(-1, next.view({batch, 1})).view({batch}) : at::Tensor();
    for (int64_t b = 0; b < batch; ++b) {
      if (stopped[static_cast<size_t>(b)]) continue;
      const int32_t id = static_cast<int32_t>(next[b].item<int64_t>());
      generated[static_cast<size_t>(b)].push_back(id);
      if (first) logprobs[static_cast<size_t>(b)].push_back(chosen[b].item<double>());
      ++produced;
      if (!o.ignore_eos && eos_id >= 0 && id == eos_id) stopped[static_cast<size_t>(b)] = true;
      else all_stopped = false;
    }
    if (all_stopped || t + 1 == o.max_new_tokens) break;
    logits = step(next.view({batch, 1}), longest + t);
  }
  const double total_seconds = seconds_since(start_time);
  if (autocast) at::autocast::set_autocast_enabled(device.type(), false);
  if (!first) return 0;

  for (int64_t b = 0; b < batch; ++b) {
    const auto& ids = generated[static_cast<size_t>(b)];
    const std::string text = tok->decode(ids, /*skip_special_tokens=*/true);
    if (o.json) {
      nlohmann::json j = {{"prompt", o.prompts[static_cast<size_t>(b)]},
                          {"prompt_ids", prompts[static_cast<size_t>(b)]},
                          {"ids", ids},
                          {"logprobs", logprobs[static_cast<size_t>(b)]},
                          {"text", text},
                          {"stop", stopped[static_cast<size_t>(b)] ? "eos" : "length"}};
      std::cout << j.dump() << "\n";
    } else {
      if (batch > 1) std::cout << "[" << b + 1 << "] ";
      std::cout << o.prompts[static_cast<size_t>(b)] << text << "\n";
    }
  }
  std::cout.flush();
  const double decode_seconds = total_seconds - prefill_seconds;
  std::cerr << strprintf("generated %lld tokens for %lld prompt(s) in %.2f s: prefill %lld tokens in %.3f s, "
                         "then %.1f tokens/s (%s, %s%s, seed %llu, %s)\n",
                         static_cast<long long>(produced), static_cast<long long>(batch), total_seconds,
                         static_cast<long long>(batch * longest), prefill_seconds,
                         decode_seconds > 0 ? static_cast<double>(produced - batch) / decode_seconds : 0.0,
                         source.description.c_str(), o.dtype.c_str(),
                         group ? cat(", tensor parallel over ", group->size(), " ranks (", group->backend(), "; rank 0 holds ",
                                     local_parameters, " of ", whole_parameters, " parameters)").c_str()
                               : "",
                         static_cast<unsigned long long>(seed),
                         o.temperature == 0 ? "greedy" : "sampled");
  return 0;
}

}  // namespace titan::cli
