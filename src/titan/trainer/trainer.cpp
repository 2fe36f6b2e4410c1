#include "titan/trainer/trainer.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/components/metrics/cuda_device.h"
#include "titan/components/metrics/metric_logger.h"
#include "titan/distributed/init_world.h"
#include "titan/models/registry.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/data/builtin.h"
#include "titan/components/loss.h"
#include "titan/config/support.h"
#include "titan/distributed/functional_collectives.h"
#include "titan/distributed/grad_norm.h"
#include "titan/distributed/mpi_runtime.h"
#include "titan/kernels/fused_ops.h"
#include "titan/nn/autocast.h"
#include "titan/nn/matmul.h"

namespace titan {
namespace {

std::atomic<int> g_stop_signal{0};

// The signals that stop training after the current step (with a checkpoint when checkpointing is on): Ctrl-C,
// SIGTERM (scancel, preemption), SIGUSR1 (SLURM's --signal=USR1@seconds warning) and SIGHUP (a closed terminal).
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGHUP};

void on_stop_signal(int signal) {
  if (g_stop_signal.exchange(signal) != 0) {
    // A second stop signal, of any kind, ends the process at once, even mid-step.
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  std::signal(signal, SIG_DFL);  // and a second one of the same kind gets the default behaviour directly
}

const char* signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGHUP: return "SIGHUP";
  }
  return "a signal";
}

// Installs the stop handlers; the destructor restores what was there.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    for (int s : kStopSignals) previous_.push_back(std::signal(s, on_stop_signal));
  }
  ~StopSignals() {
    for (size_t i = 0; i < previous_.size(); ++i) std::signal(kStopSignals[i], previous_[i]);
  }

 private:
  std::vector<void (*)(int)> previous_;
};

at::ScalarType dtype_from_name(const std::string& name) { return name == "bfloat16" ? at::kBFloat16 : at::kFloat; }

// Ranks that print: LOG_RANK (comma-separated ranks, or "all"), rank 0 by default, as torchtitan's launcher.
bool rank_logs(int rank) {
  const char* env = std::getenv("LOG_RANK");
  if (!env || !*env) return rank == 0;
  if (std::string(env) == "all") return true;
  for (const auto& part : split(env, ','))
    if (trim(part) == std::to_string(rank)) return true;
  return false;
}

// TITAN_WEIGHT_CASTS: "step" (the default) keeps autocast's weight copies over the whole step; "forward" drops them
// after each micro-batch's forward, so backward's recomputation casts again (LibTorch's own behaviour).
bool weight_casts_per_step() {
  const char* env = std::getenv("TITAN_WEIGHT_CASTS");
  if (!env || !*env) return true;
  const std::string value = env;
  if (value == "step") return true;
  if (value == "forward") return false;
  fail("TITAN_WEIGHT_CASTS=", quote(value), ": expected \"step\" (the default: each weight cast once per step) or \"forward\"");
}

}  // namespace

Trainer::Trainer(config::LoadedConfig loaded) : loaded_(std::move(loaded)) {
  const config::JobConfig& c = loaded_.config;
  config::require_supported(loaded_);
  kernels::set_fused_enabled(c.training.fused_kernels);
  weight_casts_per_step_ = weight_casts_per_step();  // checked on every layout, before anything is built
  launch_ = distributed::detect_launch();
  log::set_enabled(rank_logs(launch_.rank));
  log::set_color(!c.metrics.disable_color_printing && isatty(STDOUT_FILENO));
  if (const int used = c.training.fused_kernels ? kernels::kernel_threads() : 0; used > 0 && used < at::get_num_threads())
    log::warn("titan's fused CPU kernels split their work over ", used, " of ", at::get_num_threads(),
              " threads: titan was built without OpenMP (not with GCC; see CMakeLists.txt), or OMP_DYNAMIC / ",
              "OMP_THREAD_LIMIT limit the threads");
  auto dims = distributed::ParallelDims::from_config(c.parallelism, launch_.world_size);
  spec_ = &models::job_spec(loaded_);
  const protocols::JobModel job_model = spec_->job_model(loaded_);
  model_args_ = job_model.args;
  const protocols::ModelArgs& args = *model_args_;
  spec_->check_parallelism(args, dims, c);
  // The stage split and schedule are checked before any communication.
  if (dims.pp > 1) distributed::pipeline::plan_stages(args.layers(), spec_->tied_embeddings(args), c, dims.pp);

  log::info("Starting job: ", c.job.description);
  if (c.job.print_config) log::info("Running with configs: ", config::to_json(c));
  std::filesystem::create_directories(c.job.dump_folder);
  if (c.job.save_config_file && launch_.rank == 0) {
    auto path = std::filesystem::path(c.job.dump_folder) / *c.job.save_config_file;
    write_file(path.string(), config::to_json(c) + "\n");
    log::info("Saved job configs to ", path.string());
  }

  const auto init_timeout = std::chrono::seconds(c.comm.init_timeout_seconds);
  distributed::ProcessWorld process = distributed::init_world(launch_, init_timeout);
  device_ = process.device;
  control_ = process.control;
  std::shared_ptr<distributed::Communicator> comm = process.comm;  // groups created from it inherit its timeout
  if (device_.is_cuda()) {
    const auto devices = distributed::report_devices(*control_, device_);
    constexpr size_t kListed = 16;
    for (size_t r = 0; r < std::min(devices.ranks.size(), kListed); ++r) log::info("Device of ", devices.ranks[r]);
    if (devices.ranks.size() > kListed) log::info("Devices of ", devices.ranks.size() - kListed, " more ranks not listed");
    for (const auto& line : devices.shared) log::warn(line, ": NCCL does not support two ranks on one GPU and may hang");
  } else {
    log::info(metrics::keep_freed_host_memory());
  }
  mesh_ = std::make_unique<distributed::DeviceMesh>(dims, comm);
  mesh_->set_timeout(init_timeout);
  if (control_ != comm) control_->set_timeout(init_timeout);
  log::info("Parallelism: ", dims.describe(), " launched by ", launch_.launcher, "; ", comm->backend(), " communication");

  // Determinism and seeding.
  if (c.debug.deterministic) {
    // cuBLAS is deterministic only with a fixed workspace configuration, set before its first use.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, c.debug.deterministic_warn_only);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
    log::info("Deterministic algorithms enabled (", c.debug.deterministic_warn_only ? "warn only" : "errors on non-deterministic ops", ")");
  }
  uint64_t seed = c.debug.seed ? static_cast<uint64_t>(*c.debug.seed) : std::random_device{}();
  {
    // Every rank initialises the same model: rank 0's seed wins.
    at::Tensor shared = at::full({1}, static_cast<int64_t>(seed & 0x7fffffffffffffffULL), at::kLong).to(device_);
    mesh_->world()->broadcast(shared, 0);
    seed = static_cast<uint64_t>(shared.cpu().item<int64_t>());
  }
  at::manual_seed(seed);
  log::info("Seed ", seed, c.debug.seed ? " (debug.seed)" : " (random; set --debug.seed to reproduce)");

  // Tokenizer.
  std::string tokenizer_path = c.model.hf_assets_path;
  if (tokenizer_path == data::kBuiltinTokenizer) {
    // Rank 0 learns it; the others reuse its file, or learn the same one where the dump folder is not shared.
    if (launch_.rank == 0) data::ensure_builtin_tokenizer(c.job.dump_folder, args.vocabulary());
    mesh_->world()->barrier();
    tokenizer_path = data::ensure_builtin_tokenizer(c.job.dump_folder, args.vocabulary());
  }
  tokenizer_ = tokenizer::load(tokenizer_path);
  log::info("Tokenizer: ", tokenizer_->description(), "; BOS ", tokenizer_->bos_id() ? std::to_string(*tokenizer_->bos_id()) : "none",
            ", EOS ", tokenizer_->eos_id() ? std::to_string(*tokenizer_->eos_id()) : "none");
  if (tokenizer_->vocab_size() > args.vocabulary())
    fail("the tokenizer at ", quote(tokenizer_path), " has ", tokenizer_->vocab_size(), " ids but the model (",
         job_model.name, ") has vocab_size ", args.vocabulary(),
         "; pick a tokenizer that fits (model.hf_assets_path), a flavor with a larger vocabulary or a larger model.vocab_size");

  check_memory(dims);

  // The model is built without storage; the parallelisms shard it, and each rank then allocates and initialises
  // only its own pieces, with values that depend on the seed alone (nn/init.h), not on the layout.
  const at::ScalarType param_dtype = dtype_from_name(c.training.dtype);
  model_ = spec_->build(args, nn::ParameterOptions{at::TensorOptions().device(device_).dtype(param_dtype), /*allocate=*/false});
  model_->move_buffers(device_);
  hf_adapter_ = spec_->state_dict_adapter(args);
  const int64_t n_params = args.reported_parameters();
  flops_per_token_ = args.flops_per_token(c.training.seq_len);
  log::info("Model ", spec_->name, " ", job_model.name, " size: ", with_thousands(n_params), " total parameters; ",
            strprintf("%.2f", flops_per_token_ / 1e6), " MFLOP per token at seq_len ", c.training.seq_len);

  // Mixed precision as torchtitan: FSDP gathers parameters in mixed_precision_param and reduces gradients in
  // mixed_precision_reduce; single-device, TP-only and DDP runs compute under autocast instead.
  const at::ScalarType mp_param = dtype_from_name(c.training.mixed_precision_param);
  distributed::FsdpOptions fsdp;
  fsdp.device = device_;
  fsdp.shard_dtype = param_dtype;
  fsdp.param_dtype = param_dtype == at::kFloat ? mp_param : param_dtype;
  fsdp.reduce_dtype = dtype_from_name(c.training.mixed_precision_reduce);
  fsdp.reshard_after_forward = c.parallelism.fsdp_reshard_after_forward;
  if (!dims.fsdp_enabled() && param_dtype == at::kFloat && mp_param == at::kBFloat16) autocast_dtype_ = at::kBFloat16;
  if (dims.cp > 1)
    cp_ = std::make_unique<distributed::ContextParallel>(mesh_->get("cp"), distributed::parse_cp_load_balancer(c.parallelism.context_parallel_load_balancer),
                                                         distributed::parse_cp_rotate_method(c.parallelism.context_parallel_rotate_method));
  if (dims.pp > 1) {
    const auto parallelize = [this](nn::Model& model, const distributed::DeviceMesh& mesh, const distributed::FsdpOptions& options,
                                    const distributed::ModuleRange& part, bool split_backward) {
      return spec_->parallelize(model, mesh, loaded_.config, options, part, split_backward);
    };
    pipeline_ = std::make_unique<distributed::pipeline::Pipeline>(*model_, args.layers(), spec_->tied_embeddings(args), parallelize,
                                                                  *mesh_, c, fsdp, autocast_dtype_);
    pipeline_->runner().record_timeline(c.debug.pipeline_timeline);
    for (const auto& line : pipeline_->describe()) log::info(line);
  } else {
    whole_.push_back(spec_->parallelize(*model_, *mesh_, c, fsdp, distributed::ModuleRange::whole(*model_), false));
    for (const auto& line : whole_.front().description) log::info(line);
  }
  for (auto& part : model_parts())
    for (const auto& p : part.parameters) parameters_.push_back(p);
  distributed::initialize(parameters_, model_->init_specs(), seed);
  memory_ = std::make_unique<metrics::MemoryMonitor>(device_);
  metric_logger_ = std::make_unique<metrics::MetricLogger>(c.metrics, c.job.dump_folder, launch_.rank);
  profiler_ = std::make_unique<Profiler>(c.profiling, c.job.dump_folder, launch_.rank, device_.is_cuda());
  log::info(strprintf("Parameters on this rank: %.2f MB (initialised from seed %llu, %s); peak memory so far %.2f GiB",
                      distributed::local_parameter_bytes(parameters_) / 1e6, static_cast<unsigned long long>(seed),
                      mesh_->world()->size() > 1 ? "each rank its own pieces" : "whole model", memory_->peak().peak_gib));
  if (dims.fsdp_enabled()) {
    log::info("Mixed precision training is handled by FSDP (", c.training.mixed_precision_param, " compute, ",
              c.training.mixed_precision_reduce, " gradient reduction)");
  } else {
    log::info(!autocast_dtype_ ? cat("Training in ", c.training.dtype, " without autocast")
                               : cat("Mixed precision training is handled by autocast (bfloat16 compute, float32 parameters; ",
                                     weight_casts_per_step_ ? "each weight cast once per step)"
                                                            : "weights cast in every forward and recomputation: TITAN_WEIGHT_CASTS=forward)"));
  }
  const bool bf16_compute = dims.fsdp_enabled() ? c.training.mixed_precision_param == "bfloat16"
                                                : autocast_dtype_ == at::kBFloat16 || c.training.dtype == "bfloat16";
  if (device_.is_cpu() && bf16_compute && nn::emulates_bf16_gemm())
    log::info("bf16 matrix products computed in float32 and rounded to bf16 (nn/matmul.h): LibTorch's bf16 GEMM is a "
              "scalar loop on CPUs without AVX-512, about 1/80 of the float32 rate");

  optimizer_ = std::make_unique<AdamW>(distributed::local_tensors(parameters_), c.optimizer);
  lr_scheduler_ = std::make_unique<LRScheduler>(c.lr_scheduler, c.optimizer.lr, c.training.steps);
  optimizer_->set_lr(lr_scheduler_->current_lr());

  // Batch sizes: global = local x data-parallel degree unless set; the rest is gradient accumulation.
  const int64_t dp_degree = dims.dp_degree();
  const int64_t per_step = c.training.local_batch_size * dp_degree;
  const int64_t global = c.training.global_batch_size < 0 ? per_step : c.training.global_batch_size;
  if (global % per_step != 0)
    fail("training.global_batch_size ", global, " ", loaded_.where("training.global_batch_size"),
         " must be a multiple of training.local_batch_size x data-parallel degree = ", per_step);
  grad_accum_steps_ = global / per_step;
  if (grad_accum_steps_ > 1) log::info("Gradient accumulation over ", grad_accum_steps_, " micro-batches per step");

  auto sources = data::resolve_sources(c.training);
  for (const auto& source : sources)
    log::info("Dataset ", quote(source.name), ": ", source.shards.size(), " file(s), ", data::format_name(source.shards.front().format),
              sources.size() > 1 ? cat(", weight ", source.weight) : std::string());
  block_causal_ = c.model.attn_mask_type == "block_causal";
  data::LoaderOptions data_options = data::training_loader_options(c, mesh_->dp_rank(), dp_degree);
  dataloader_ = std::make_unique<data::DataLoader>(std::move(sources), tokenizer_.get(), data_options);
  if (c.validation.enable) {
    // Resolved now so that a bad validation path fails before training starts.
    validation_sources_ = data::resolve_sources(c.validation.dataset, c.validation.dataset_path, "auto", "text", "validation");
    for (const auto& source : validation_sources_)
      log::info("Validation dataset ", quote(source.name), ": ", source.shards.size(), " file(s), every ",
                c.validation.freq, " steps, ", c.validation.steps < 0 ? std::string("one full pass") : cat(c.validation.steps, " batches"));
  }

  if (c.checkpoint.enable || c.checkpoint.initial_load_path) {
    checkpointer_ = std::make_unique<checkpoint::Checkpointer>(loaded_, *mesh_);
    auto view = checkpoint_view();
    if (checkpointer_->load(view)) {
      step_ = train_state_.step;
      tokens_seen_ = train_state_.tokens_seen;
      optimizer_->set_lr(lr_scheduler_->current_lr());
    }
  }
  const at::ScalarType compute_dtype = autocast_dtype_.value_or(param_dtype);
  peak_ = metrics::peak_flops(device_, compute_dtype, /*may_cache=*/launch_.local_world_size == 1);
  log::info(memory_->describe(), "; ", peak_.derivation);
}

Trainer::~Trainer() = default;

std::vector<data::Batch> Trainer::next_microbatches() {
  std::vector<data::Batch> out;
  for (int64_t i = 0; i < grad_accum_steps_; ++i) out.push_back(dataloader_->next());
  return out;
}

Trainer::Control Trainer::exchange_control(bool exhausted, int64_t valid_tokens, int signal, bool save_failed) {
  // Sums over all ranks: ranks out of data, failed background saves, valid label tokens, and for each stop signal
  // the ranks it reached. The ranks of one data-parallel replica (its TP, CP and PP ranks) hold the same batch, so
  // the world's token sum is the replicas' sum times their size.
  std::vector<int64_t> values = {exhausted ? 1 : 0, save_failed ? 1 : 0, valid_tokens};
  for (int s : kStopSignals) values.push_back(signal == s ? 1 : 0);
  if (control_->size() > 1) {
    at::Tensor t = at::tensor(values, at::kLong).to(control_->tensor_device());
    control_->all_reduce(t, distributed::ReduceOp::Sum);
    ++control_reductions_;
    t = read_host_tensor(t);
    for (size_t i = 0; i < values.size(); ++i) values[i] = t[static_cast<int64_t>(i)].item<int64_t>();
    values[2] /= mesh_->dims().non_data_parallel_size();
  }
  Control out;
  out.exhausted = values[0] > 0;
  out.save_failed = values[1] > 0;
  out.valid_tokens = values[2];
  // The highest-numbered signal that reached any rank, the same on all.
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    if (values[3 + i] > 0) out.signal = std::max(out.signal, kStopSignals[i]);
  return out;
}

int64_t Trainer::local_valid_tokens(const std::vector<data::Batch>& microbatches) {
  int64_t valid = 0;
  for (const auto& mb : microbatches) valid += count_valid_tokens(mb.labels);  // host tensors: no device read
  return valid;
}

StepResult Trainer::train_step(const std::vector<data::Batch>& microbatches) {
  at::Tensor valid = at::full({1}, local_valid_tokens(microbatches), at::kLong).to(device_);
  mesh_->get("dp")->all_reduce(valid, distributed::ReduceOp::Sum);
  DeviceStep pending = launch_step(microbatches, read_host_tensor(valid).item<int64_t>());
  if (pending.settled) return *pending.settled;
  ++reads_at_once_;
  return settle(pending);
}

Trainer::DeviceStep Trainer::launch_step(const std::vector<data::Batch>& microbatches, int64_t global_valid_count) {
  DeviceStep out;
  out.step = step_;
  out.lr = optimizer_->lr();
  optimizer_->zero_grad();
  // The loss is divided by the number of valid tokens in the whole global batch (all micro-batches, all ranks),
  // so every token weighs the same however the batch is split.
  if (global_valid_count == 0) fail("a training step has no valid label tokens");
  const double global_valid = static_cast<double>(global_valid_count);

  at::Tensor loss_total = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  // Autocast's bfloat16 copies of the weights live until every micro-batch's backward is done, before the update.
  std::optional<nn::StepWeightCasts> casts(std::in_place, autocast_dtype_.has_value() && weight_casts_per_step_);
  if (pipeline_) {
    // The schedule runs each local batch's micro-batches through the stages; gradients are reduced once at the end.
    at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (const auto& mb : microbatches) {
      sum += pipeline_->train(mb.inputs, mb.labels, block_causal_ ? mb.positions : at::Tensor(), global_valid, step_);
      out.tokens += mb.labels.numel();
    }
    loss_total.copy_(sum.reshape({1}));  // float64 sum rounded once, on the device
  } else {
    auto& part = whole_.front();
    for (size_t m = 0; m < microbatches.size(); ++m) {
      const auto& mb = microbatches[m];
      at::Tensor inputs = to_device(mb.inputs), labels = to_device(mb.labels);
      if (cp_) {
        // This rank's chunks of every sequence; the loss sums its tokens, divided by the global count.
        inputs = cp_->shard(inputs, 1);
        labels = cp_->shard(labels, 1);
      }
      at::Tensor loss;
      {
        // Autocast for the forward pass and loss (torchtitan: single-device and DDP runs compute in
        // training.mixed_precision_param through autocast).
        nn::AutocastRegion autocast(nn::AutocastState::enabled_for(device_.type(), autocast_dtype_));
        loss = part.loss_sum(forward(inputs, mb, part.fused_loss ? labels : at::Tensor()), labels) / global_valid;
      }
      part.data_parallel->before_backward(m + 1 == microbatches.size());
      loss.backward();
      part.data_parallel->after_backward();
      loss_total += loss.detach();
      out.tokens += mb.labels.numel();  // per device, divided by cp x tp x pp in the log as torchtitan
    }
  }
  casts.reset();
  finish_gradients();
  at::Tensor norm = distributed::clip_grad_norm(parameters_, loaded_.config.training.max_norm, *mesh_->world());
  mesh_->get("loss")->all_reduce(loss_total, distributed::ReduceOp::Sum);
  if (pipeline_) mesh_->get("pp")->all_reduce(loss_total, distributed::ReduceOp::Sum);  // from the last stage's ranks
  // Loss, gradient norm and whether either is not finite, on the device; both are global (the same on every rank),
  // so every rank takes the same decision.
  at::Tensor values = at::stack({loss_total.reshape({}).to(at::kDouble), norm.reshape({}).to(at::kDouble)});
  const at::Tensor nonfinite = values.isfinite().all().logical_not();
  out.values = at::cat({values, nonfinite.to(at::kDouble).reshape({1})});
  if (!device_.is_cpu()) {
    // Copied to pinned host memory behind the step's work, with an event to wait on when they are read: a
    // blocking copy would wait for everything queued by then (the next step's forward and backward too).
    out.host_values = at::empty({3}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
    out.host_values.copy_(out.values, /*non_blocking=*/true);
    out.ready = std::make_shared<c10::Event>(device_.type());
    out.ready->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
  }
  // The step before this one is settled now, before this step's update: its values were computed long ago, so
  // reading them waits for nothing that is still running.
  settle_pending();
  if (optimizer_->skips_on_device()) {
    // No update where the step was not finite, decided on the device; the host learns of it later (settle).
    optimizer_->step(nonfinite.to(at::kFloat));
  } else {
    ++reads_at_once_;
    out.settled = settle(out);
    if (out.settled->skipped) optimizer_->zero_grad();  // no update from this step; the schedule still advances
    else optimizer_->step();
  }
  lr_scheduler_->step();
  optimizer_->set_lr(lr_scheduler_->current_lr());
  if (pipeline_ && loaded_.config.debug.pipeline_timeline) write_pipeline_timeline();
  return out;
}

StepResult Trainer::settle(const DeviceStep& pending) {
  at::Tensor v;
  if (pending.ready) {
    pending.ready->synchronize();  // the step's own work only
    v = pending.host_values;
  } else {
    v = read_host_tensor(pending.values);
  }
  StepResult r;
  r.loss = v[0].item<double>();
  r.grad_norm = v[1].item<double>();
  r.skipped = v[2].item<double>() != 0;
  r.lr = pending.lr;
  r.tokens = pending.tokens;
  if (!r.skipped) {
    nonfinite_in_row_ = 0;
    return r;
  }
  // A non-finite loss or gradient norm: nothing was applied, and the last checkpoint is untouched.
  ++nonfinite_in_row_;
  ++nonfinite_total_;
  const int64_t allowed = loaded_.config.training.skip_nonfinite_steps;
  const std::string what = cat("step ", pending.step, ": the loss is ", r.loss, " and the gradient norm ", r.grad_norm);
  if (allowed == 0)
    fail(what, "; stopping without applying the step (the last checkpoint is untouched). training.skip_nonfinite_steps = N "
         "skips up to N such steps in a row instead");
  if (nonfinite_in_row_ > allowed)
    fail(what, "; ", nonfinite_in_row_, " steps in a row were not finite (training.skip_nonfinite_steps = ", allowed,
         "); stopping (the last checkpoint is untouched)");
  log::warn(what, "; step skipped without an update (", nonfinite_in_row_, " in a row, ", nonfinite_total_,
            " in this run; training.skip_nonfinite_steps = ", allowed, ")");
  return r;
}

std::optional<StepResult> Trainer::settle_pending() {
  if (!unsettled_) return std::nullopt;
  DeviceStep pending = std::move(*unsettled_);
  unsettled_.reset();
  ++(pending.step < step_ ? reads_a_step_later_ : reads_at_once_);
  return settle(pending);
}

at::Tensor Trainer::to_device(const at::Tensor& t) {
  // From pinned memory without waiting: a pageable copy waits for all the work queued on the device before it.
  if (device_.is_cpu()) return t;
  return t.pin_memory().to(device_, /*non_blocking=*/true);
}

at::Tensor Trainer::read_host_tensor(const at::Tensor& t) {
  if (!t.device().is_cpu()) ++device_reads_;
  return t.cpu();
}

void Trainer::finish_gradients() {
  for (auto& part : model_parts()) {
    // Under pipeline parallelism nothing was synchronised during the interleaved backwards: DDP's last pass is now.
    if (pipeline_) part.data_parallel->before_backward(true);
    part.finish_gradients();
  }
}

void Trainer::check_memory(const distributed::ParallelDims& dims) {
  // Before anything large is allocated: a job that cannot fit fails here with the numbers, not in the kernel's OOM
  // killer or an allocator abort midway through the first step.
  const config::JobConfig& c = loaded_.config;
  const bool autocast = protocols::computes_under_autocast(c, dims);
  const double runtime = device_.is_cuda() ? 0.0 : static_cast<double>(metrics::current_rss_bytes());
  using protocols::FusedKernels;
  const FusedKernels fused = device_.is_cpu()                                   ? FusedKernels::cpu
                             : device_.is_cuda() && kernels::cuda_kernels_built() ? FusedKernels::cuda
                                                                                 : FusedKernels::none;
  const auto estimate = spec_->estimate_memory(*model_args_, c, dims, autocast, runtime, protocols::Execution::titan,
                                               mesh_->coordinate("pp"), fused);
  const auto available = metrics::available_memory(device_, launch_.local_world_size);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  log::info("Memory estimate for this rank: ", estimate.describe(), strprintf(" of %.2f GiB available (", available.bytes / gib),
            available.source, ")");
  if (estimate.total() <= available.bytes) return;
  const std::string what = strprintf("this rank needs about %.2f GiB but %.2f GiB is available (%s)", estimate.total() / gib,
                                     available.bytes / gib, available.source.c_str());
  if (c.debug.skip_memory_check) {
    log::warn(what, "; starting anyway (debug.skip_memory_check)");
    return;
  }
  fail(what, ". Estimated: ", estimate.describe(),
       ". To fit: shard over more ranks (parallelism.data_parallel_shard_degree, tensor_parallel_degree, "
       "pipeline_parallel_degree), recompute activations (activation_checkpoint.mode = \"full\"), or lower "
       "training.local_batch_size (", c.training.local_batch_size, ") or training.seq_len (", c.training.seq_len,
       "); --debug.skip_memory_check starts anyway");
}

void Trainer::write_pipeline_timeline() {
  // debug.pipeline_timeline: what each action of this step ran, when, on this rank (appended per step).
  const auto dir = std::filesystem::path(loaded_.config.job.dump_folder) / "pipeline_timeline";
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / strprintf("rank-%05d.csv", mesh_->world()->rank()), std::ios::app);
  for (const auto& e : pipeline_->runner().timeline())
    out << e.step << "," << e.action << "," << strprintf("%.6f,%.6f,%.6f", e.start, e.end, e.waited) << "\n";
  if (!out.flush()) fail("cannot write the pipeline timeline in ", quote(dir.string()), describe_write_error(errno));
  pipeline_->runner().clear_timeline();
}

at::Tensor Trainer::forward(const at::Tensor& inputs, const data::Batch& batch, const at::Tensor& labels) {
  // Block-causal attention takes each token's position in its document from the loader; under context parallelism
  // RoPE takes the global positions of this rank's chunks.
  if (cp_) {
    const int64_t seq_len = batch.inputs.size(1);
    if (seq_len > model_->max_seq_len())
      fail("sequence length ", seq_len, " exceeds the model's max_seq_len ", model_->max_seq_len(), " (training.seq_len)");
    return model_->forward(inputs, cp_->positions(seq_len, device_), {}, labels);
  }
  return model_->forward(inputs, {}, block_causal_ ? to_device(batch.positions) : at::Tensor(), labels);
}

checkpoint::CheckpointedState Trainer::checkpoint_view() {
  train_state_.step = step_;
  train_state_.tokens_seen = tokens_seen_;
  return checkpoint::CheckpointedState{parameters_,  *model_args_, *hf_adapter_, *optimizer_, *lr_scheduler_,
                                       *dataloader_, train_state_,  tokenizer_.get()};
}

double Trainer::validate() {
  const auto& c = loaded_.config;
  const auto& v = c.validation;
  const double start = now_seconds();
  // A fresh loader every time: the same batches each validation, in file order, without shuffling.
  data::LoaderOptions o;
  o.seq_len = v.seq_len;
  o.batch_size = v.local_batch_size;
  o.dp_rank = mesh_->dp_rank();
  o.dp_degree = mesh_->dims().dp_degree();
  o.lanes = c.training.data_lanes;  // a fixed lane count gives the same validation set on any number of ranks
  o.positions = block_causal_;
  o.name = "validation";
  auto sources = validation_sources_;
  for (auto& s : sources) s.loop = v.steps >= 0;  // steps = -1: one pass over the data
  data::DataLoader loader(std::move(sources), tokenizer_.get(), o);
  auto dp = mesh_->get("dp");
  at::NoGradGuard no_grad;
  double loss_sum = 0;
  int64_t batches = 0, tokens = 0;
  while (v.steps < 0 || batches < v.steps) {
    data::Batch batch;
    bool have = true;
    try {
      batch = loader.next();
    } catch (const data::DataExhausted&) {
      have = false;
    }
    if (dp->size() > 1) {
      // Lanes end at different batches: every rank stops when one has nothing left.
      at::Tensor flag = at::full({1}, static_cast<int64_t>(have), at::kLong).to(device_);
      dp->all_reduce(flag, distributed::ReduceOp::Min);
      have = flag.cpu().item<int64_t>() != 0;
    }
    if (!have) break;
    at::Tensor inputs = batch.inputs.to(device_), labels = batch.labels.to(device_);
    at::Tensor valid = at::full({1}, count_valid_tokens(batch.labels), at::kLong).to(device_);
    dp->all_reduce(valid, distributed::ReduceOp::Sum);
    double sum = 0;
    if (pipeline_) {
      at::Tensor pp_sum = pipeline_->evaluate(batch.inputs, batch.labels, block_causal_ ? batch.positions : at::Tensor()).reshape({1});
      mesh_->get("pp")->all_reduce(pp_sum, distributed::ReduceOp::Sum);  // from the last stage's ranks
      if (cp_) cp_->group()->all_reduce(pp_sum, distributed::ReduceOp::Sum);   // each CP rank has its chunks' share
      sum = pp_sum.cpu().item<double>();
    } else {
      nn::AutocastRegion autocast(nn::AutocastState::enabled_for(device_.type(), autocast_dtype_));
      if (cp_) {
        inputs = cp_->shard(inputs, 1);
        labels = cp_->shard(labels, 1);
      }
      const auto& part = whole_.front();
      at::Tensor out = forward(inputs, batch, part.fused_loss ? labels : at::Tensor());
      at::Tensor part_sum = part.loss_sum(out, labels).to(at::kDouble).reshape({1});
      if (cp_) cp_->group()->all_reduce(part_sum, distributed::ReduceOp::Sum);
      sum = part_sum.item<double>();
    }
    // torchtitan's formula: the mean over batches of (this batch's loss sum / its global valid tokens).
    loss_sum += sum / static_cast<double>(std::max<int64_t>(1, valid.cpu().item<int64_t>()));
    tokens += batch.labels.numel();
    ++batches;
  }
  // Units FSDP keeps gathered after forward wait for a backward that never comes.
  for (auto& part : model_parts()) part.data_parallel->reshard_all();
  if (batches == 0) fail("validation: the validation data has no complete batch of ", v.local_batch_size, " x ", v.seq_len, " tokens");
  at::Tensor total = at::full({1}, loss_sum / static_cast<double>(batches), at::TensorOptions().dtype(at::kDouble)).to(device_);
  dp->all_reduce(total, distributed::ReduceOp::Sum);
  const double loss = total.cpu().item<double>();
  const double elapsed = std::max(1e-9, now_seconds() - start);
  auto mem = memory_->peak();
  const auto& k = log::colors();
  log::info(strprintf("%svalidate step: %2lld  %sloss: %7.4f  %smemory: %5.2fGiB(%.2f%%)  %stps: %s  (%lld batches)%s", k.yellow,
                      static_cast<long long>(step_), k.green, loss, k.turquoise, mem.peak_gib, mem.peak_pct, k.blue,
                      with_thousands(static_cast<long long>(std::nearbyint(static_cast<double>(tokens) / elapsed /
                                                                          static_cast<double>(mesh_->dims().non_data_parallel_size())))).c_str(),
                      static_cast<long long>(batches), k.reset));
  metric_logger_->log(step_, {{"validation_metrics/loss", loss},
                              {"validation_metrics/throughput(tps)",
                               static_cast<double>(tokens) / elapsed / static_cast<double>(mesh_->dims().non_data_parallel_size())},
                              {"validation_metrics/memory/max_active(GiB)", mem.peak_gib},
                              {"validation_metrics/memory/max_active(%)", mem.peak_pct}});
  return loss;
}

void Trainer::log_step(const StepResult& r, double data_seconds) {
  const double now = now_seconds();
  const double elapsed = std::max(1e-9, now - time_last_log_);
  // Per device as torchtitan: the ranks of one TP/CP/PP group share their tokens.
  const double tps = static_cast<double>(tokens_since_log_) / elapsed / static_cast<double>(mesh_->dims().non_data_parallel_size());
  const double tflops = flops_per_token_ * tps / 1e12;
  if (peak_.measured && flops_per_token_ * tps > peak_.flops) {
    // A measured CPU peak a step beat is wrong (measured in a slow moment, or cached on another machine state):
    // measured again once per run; after that the fastest step's rate is the peak (the model's FLOPs formula counts
    // the whole attention square where causal kernels compute half, so a step can outrun any matmul).
    if (!peak_remeasured_) {
      peak_ = metrics::remeasured_peak_flops(peak_, flops_per_token_ * tps);
      peak_remeasured_ = true;
      log::warn("MFU peak: ", peak_.derivation);
    } else {
      peak_.flops = flops_per_token_ * tps;
    }
  }
  const double mfu = peak_.flops > 0 ? 100.0 * flops_per_token_ * tps / peak_.flops : 0.0;
  auto mem = memory_->peak();
  const auto& k = log::colors();
  // data: time blocked waiting for batches, per step over the logging interval, and its share of the time
  // (torchtitan's time_metrics/data_loading(s) and data_loading(%)).
  const double data_per_step = data_seconds / static_cast<double>(std::max<int64_t>(1, steps_since_log_));
  log::info(strprintf("%sstep: %2lld  %sloss: %8.5f  %sgrad_norm: %7.4f  %smemory: %5.2fGiB(%.2f%%)  %stps: %s  %stflops: %s  %smfu: %.2f%%  %sdata: %.3fs(%.1f%%)%s",
                      k.red, static_cast<long long>(step_), k.green, r.loss, k.orange, r.grad_norm, k.turquoise, mem.peak_gib,
                      mem.peak_pct, k.blue, with_thousands(static_cast<long long>(std::nearbyint(tps))).c_str(), k.cyan,
                      with_thousands(tflops, 2).c_str(),
                      k.magenta, mfu, k.yellow, data_per_step, 100.0 * data_seconds / elapsed, k.reset));
  // torchtitan's TensorBoard keys (its global_max_loss, the largest data-parallel rank's loss, is not computed here).
  metric_logger_->log(step_, {{"loss_metrics/global_avg_loss", r.loss},
                              {"grad_norm", r.grad_norm},
                              {"throughput(tps)", tps},
                              {"tflops", tflops},
                              {"mfu(%)", mfu},
                              {"time_metrics/end_to_end(s)", elapsed / static_cast<double>(std::max<int64_t>(1, steps_since_log_))},
                              {"time_metrics/data_loading(s)", data_per_step},
                              {"time_metrics/data_loading(%)", 100.0 * data_seconds / elapsed},
                              {"memory/max_active(GiB)", mem.peak_gib},
                              {"memory/max_active(%)", mem.peak_pct},
                              {"n_tokens_seen", static_cast<double>(tokens_seen_)},
                              {"lr", r.lr}});
  steps_since_log_ = 0;
  tokens_since_log_ = 0;
  data_seconds_since_log_ = 0;
  time_last_log_ = now_seconds();
  memory_->reset_peak();
}

int Trainer::train() {
  const auto& c = loaded_.config;
  StopSignals stop_signals;
  log::info("Training starts at step ", step_ + 1, " of ", c.training.steps, " (local batch ", c.training.local_batch_size,
            " x seq_len ", c.training.seq_len, ", ", grad_accum_steps_, " micro-batch(es) per step, lr warm-up ",
            lr_scheduler_->warmup_steps(), " steps)");
  if (c.checkpoint.create_seed_checkpoint) {
    // torchtitan's seed checkpoint: the initialised model, saved once as step 0 from a single process, so that later
    // runs on any layout start from the same weights.
    if (mesh_->world()->size() != 1)
      fail("checkpoint.create_seed_checkpoint runs on a single process (it saves the unsharded initial model); got ",
           mesh_->world()->size(), " ranks");
    if (!checkpointer_ || !c.checkpoint.enable) fail("checkpoint.create_seed_checkpoint needs checkpoint.enable = true");
    auto view = checkpoint_view();
    checkpointer_->save(view, /*last=*/true);
    checkpointer_->wait();
    log::info("Created seed checkpoint at step 0 in ", checkpointer_->folder());
    return 0;
  }
  time_last_log_ = now_seconds();
  const double train_start = time_last_log_;
  const int64_t first_step = step_;
  memory_->reset_peak();
  int exit_code = 0;
  while (step_ < c.training.steps) {
    const double data_start = now_seconds();
    // The position before this step's batches: a stop decided below saves the previous step with it.
    auto position_before = dataloader_->reported_position();
    std::vector<data::Batch> microbatches;
    bool exhausted = false;
    try {
      microbatches = next_microbatches();
    } catch (const data::DataExhausted& e) {
      log::warn("data: ", e.what());
      exhausted = true;
    }
    const double data_seconds = now_seconds() - data_start;
    // One control reduction per step, on the host where the launcher gives one: whether any rank ran out of data
    // (lanes run out at different steps), the step's valid label tokens, and what reached any rank since the last
    // step (a stop signal, a failed background checkpoint write), so that every rank takes the same decision.
    const bool save_failed_here = checkpointer_ && !checkpointer_->background_failure().empty();
    const Control control = exchange_control(exhausted, exhausted ? 0 : local_valid_tokens(microbatches), g_stop_signal.load(),
                                             save_failed_here);
    if (control.save_failed) {
      checkpointer_->abandon_background();
      if (save_failed_here) checkpointer_->wait();  // throws with the cause
      fail("stopping after step ", step_, ": another rank's asynchronous checkpoint write failed (its error says why); the "
           "previous complete checkpoint is untouched");
    }
    if (control.signal) {
      // Every rank stops after the same step, whichever rank the signal reached, and saves it (collective) unless it
      // was just saved, with the data position before the batches just fetched, so that a preempted or requeued job
      // resumes where it stopped.
      const int sig = control.signal;
      settle_pending();
      const bool save = checkpointer_ && c.checkpoint.enable && step_ > first_step &&
                        !checkpointer_->should_save(step_, step_ == c.training.steps);
      if (save) {
        dataloader_->rewind_reported_position(std::move(position_before));
        auto view = checkpoint_view();
        checkpointer_->save(view, /*last=*/false);
      }
      if (checkpointer_) checkpointer_->wait();
      const bool saved_here = checkpointer_ && c.checkpoint.enable && step_ > first_step;
      log::warn("received ", signal_name(sig), ": stopped cleanly after step ", step_, " of ", c.training.steps,
                saved_here ? cat("; checkpoint step-", step_, " is complete") : std::string(), " (exit code ", 128 + sig, ")");
      exit_code = 128 + sig;
      break;
    }
    if (control.exhausted) {
      log::warn("stopping after step ", step_, " of ", c.training.steps, ": the data ran out");
      break;
    }
    data_seconds_since_log_ += data_seconds;
    ++steps_since_log_;
    ++step_;
    profiler_->step_begin(step_);
    DeviceStep launched = launch_step(microbatches, control.valid_tokens);
    profiler_->step_end(step_);
    tokens_seen_ += launched.tokens * mesh_->dims().dp_degree();  // all ranks: the same after a change of layout
    tokens_since_log_ += launched.tokens;
    // After the first step this process ran (start-up and first collectives done; on a resumed run too) a tighter
    // timeout catches a dead or hung rank.
    if (step_ == first_step + 1) {
      mesh_->set_timeout(std::chrono::seconds(c.comm.train_timeout_seconds));
      if (control_ != mesh_->world()) control_->set_timeout(std::chrono::seconds(c.comm.train_timeout_seconds));
      if (pipeline_) pipeline_->runner().set_timeout(std::chrono::seconds(c.comm.train_timeout_seconds));
    }
    const bool log_now = step_ == 1 || step_ % c.metrics.log_freq == 0;
    const bool save_now = checkpointer_ && c.checkpoint.enable && checkpointer_->should_save(step_, step_ == c.training.steps);
    const bool validate_now = c.validation.enable && (step_ == 1 || step_ % c.validation.freq == 0);
    // The step's loss and gradient norm stay on the device until a log line, a checkpoint or the end needs them (or
    // the next step's update, before which a non-finite step must be known): no per-step wait for the device.
    std::optional<StepResult> r = launched.settled;
    if (!r) unsettled_ = std::move(launched);
    if (log_now || save_now || validate_now || step_ == c.training.steps) {
      if (!r) r = settle_pending();
    }
    if (log_now) log_step(*r, data_seconds_since_log_);
    if (save_now) {
      auto view = checkpoint_view();
      checkpointer_->save(view, step_ == c.training.steps);
      time_last_log_ = now_seconds();  // saving time does not count against training throughput
    }
    if (validate_now) {
      validate();
      time_last_log_ = now_seconds();  // validation time does not count against training throughput
    }
  }
  settle_pending();  // a step left unread when the loop stopped early
  if (exit_code == 0 && step_ == c.training.steps && step_ > first_step) {
    // The last step's background checkpoint write may have failed on another rank: every rank learns of it (a
    // stop signal this late changes nothing: the run is complete).
    std::exception_ptr failure;
    if (checkpointer_) {
      try {
        checkpointer_->wait();  // the last write finished (or failed) before the ranks compare
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (exchange_control(false, 0, 0, failure != nullptr).save_failed) {
      if (failure) std::rethrow_exception(failure);  // as the loop's check throws it: the write's own error
      fail("step ", step_, ": another rank's asynchronous checkpoint write failed (its error says why); the previous "
           "complete checkpoint is untouched");
    }
  }
  log::info("Step results read on the host: ", reads_at_once_, " right after their step (log lines, checkpoints, validation, the "
            "last step), ", reads_a_step_later_, " one step later (before the next update, waiting for no running work); ",
            control_reductions_, " control reduction(s) over ", control_->size(), " rank(s) on ",
            control_->tensor_device().is_cpu() ? "host memory" : "the device", "; ", device_reads_, " read(s) of device memory");
  if (checkpointer_) checkpointer_->wait();
  if (exit_code == 0) log::info("Training completed: ", step_, " steps, ", with_thousands(tokens_seen_), " tokens");
  const double steps = static_cast<double>(step_ - first_step);  // run by this process
  // On NCCL a wait orders the GPU's streams and returns at once: the host time in it is not the GPU's stall.
  const std::string blocked = mesh_->world()->waits_block_host()
                                  ? "blocked waiting"
                                  : "in waits on the host (NCCL waits only order GPU streams; GPU-side stalls are in the profiler trace)";
  if (mesh_->dims().dp_enabled() && steps > 0) {
    int64_t bytes = 0;
    double waited = 0;
    for (auto& part : model_parts()) bytes += part.data_parallel->bytes_communicated(), waited += part.data_parallel->wait_seconds();
    log::info(strprintf("Data-parallel communication per step on this rank: %.2f MB sent, %.3f s %s, ", bytes / steps / 1e6,
                        waited / steps, blocked.c_str()),
              device_.is_cpu() ? strprintf("%.3f s inside MPI calls (overlapped or not); ", distributed::mpi_busy_seconds() / steps) : "",
              strprintf("%.3f s per step in all", (now_seconds() - train_start) / steps));
  }
  if (pipeline_ && pipeline_->runner().steps() > 0) {
    const auto& r = pipeline_->runner();
    log::info(strprintf("Pipeline on this rank: measured bubble %.1f%%%s (schedule's unit-time bubble %.1f%%), %.2f MB sent to "
                        "neighbouring stages per step, at most %d micro-batches in flight; %lld activation shape header(s) read "
                        "back from the device over %lld training pass(es) of the schedule (the first activation of a shape "
                        "on each channel, and every one in validation), no loss read back within a pass",
                        100.0 * r.bubble(), mesh_->world()->waits_block_host() ? "" : " (host clock: GPU work runs after it is issued)",
                        100.0 * r.schedule().simulate().bubble,
                        static_cast<double>(r.bytes_sent()) / static_cast<double>(r.steps()) * static_cast<double>(grad_accum_steps_) / 1e6, r.max_in_flight(),
                        static_cast<long long>(r.header_reads()), static_cast<long long>(r.steps())));
  }
  if (cp_ && steps > 0)
    log::info(strprintf("Context-parallel communication per step on this rank: %.2f MB sent, %.3f s %s for keys and "
                        "values or their gradients; %.3f s per step in all",
                        cp_->group()->bytes_communicated() / steps / 1e6, distributed::ContextParallel::wait_seconds() / steps,
                        blocked.c_str(), (now_seconds() - train_start) / steps));
  if (mesh_->dims().tp > 1 && steps > 0)
    log::info(strprintf("Tensor-parallel communication per step on this rank: %.2f MB sent, %.3f s in its (synchronous) "
                        "collectives; %.3f s per step in all",
                        mesh_->get("tp")->bytes_communicated() / steps / 1e6, distributed::functional::collective_seconds() / steps,
                        (now_seconds() - train_start) / steps));
  return exit_code;
}

}  // namespace titan
