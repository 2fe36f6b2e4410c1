#include "titan/trainer/trainer.h"

#include <c10/core/CPUAllocator.h>

#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <sstream>
#include <fstream>
#include <random>

#include "titan/common/checksum.h"
#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/checkpoint/formats/dcp.h"
#include "titan/components/data/builtin.h"
#include "titan/components/metrics/cuda_device.h"
#include "titan/components/metrics/host_block_cache.h"
#include "titan/components/quantization/float8.h"
#include "titan/config/dtypes.h"
#include "titan/config/support.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/functional_collectives.h"
#include "titan/distributed/grad_norm.h"
#include "titan/distributed/init_world.h"
#include "titan/distributed/mpi_runtime.h"
#include "titan/kernels/fused_ops.h"
#include "titan/models/registry.h"
#include "titan/nn/autocast.h"
#include "titan/nn/loss.h"
#include "titan/nn/matmul.h"

namespace titan {
Trainer::Trainer(config::LoadedConfig loaded) : loaded_(std::move(loaded)) {
  const distributed::ParallelDims dims = check_job();
  start_process(dims);
  build_tokenizer();
  check_memory(dims);  // of the job as configured
  if (launch_.launcher == "fake_backend") {
    // After the model, its tokenizer and its memory were decided as the job's (a starting checkpoint or Hugging Face
    // folder may give the model's shape and tokenizer): a checkpoint holds every rank's pieces, and one rank's, saved
    // or loaded alone, would be a wrong or partial one.
    loaded_.config.checkpoint.enable = false;
    loaded_.config.checkpoint.initial_load_path.reset();
    loaded_.config.checkpoint.create_seed_checkpoint = false;
  }
  if (loaded_.config.memory_estimation.enable) restrict_to_memory_estimation();
  if (estimate_only()) return;  // the estimate is the result: nothing large is allocated
  build_model(dims);
  build_training(dims);
}

distributed::ParallelDims Trainer::check_job() {
  const config::JobConfig& c = loaded_.config;
  // comm.mode = "fake_backend": this process plays one rank of the job (NGPU, RANK) and communicates with no one.
  launch_ = c.comm.mode == "fake_backend" ? distributed::fake_launch() : distributed::detect_launch();
  log::set_enabled(rank_logs(launch_.rank) || launch_.launcher == "fake_backend");  // before the configuration's warnings: once, not once per rank
  // Open MPI hands each rank a pseudo-terminal whether or not mpirun's own output is one, so a rank cannot tell a
  // pipe from a terminal there: no colors under mpirun (metrics.disable_color_printing aside).
  log::set_color(!c.metrics.disable_color_printing && isatty(STDOUT_FILENO) && launch_.launcher != "mpirun");
  config::require_supported(loaded_);
  if (launch_.launcher == "fake_backend")
    log::info("comm.mode = \"fake_backend\": this process plays rank ", launch_.rank, " of ", launch_.world_size,
              " (RANK, NGPU), with no communication");
  kernels::set_fused_kernels_enabled(c.training.fused_kernels);
  weight_casts_per_step_ = c.training.autocast_weight_casts == "step";
  if (const int used = c.training.fused_kernels ? kernels::kernel_threads() : 0; used > 0 && used < at::get_num_threads())
    log::warn("titan's fused CPU kernels split their work over ", used, " of ", at::get_num_threads(),
              " threads: titan was built without OpenMP (not with GCC; see CMakeLists.txt), or OMP_DYNAMIC / ",
              "OMP_THREAD_LIMIT limit the threads");
  auto dims = distributed::ParallelDims::from_config(c.parallelism, launch_.world_size, launch_.launcher == "fake_backend");
  if ((c.checkpoint.enable || c.checkpoint.initial_load_path) && c.checkpoint.load_step >= 0 &&
      !checkpoint::Checkpointer::resume_directory(c.checkpoint, c.job.dump_folder))
    // Said before the model is decided: a run from a Hugging Face folder would otherwise name that folder first.
    fail("checkpoint.load_step = ", c.checkpoint.load_step, " ", loaded_.where("checkpoint.load_step"), ": no complete checkpoint ",
         (std::filesystem::path(c.job.dump_folder) / c.checkpoint.folder / cat("step-", c.checkpoint.load_step)).string());
  const JobChoice choice = choose_job_model(loaded_);
  if (!choice.source.empty()) log::info(choice.source);
  spec_ = choice.spec;
  const protocols::JobModel& job_model = choice.model;
  checkpoint_flavor_ = choice.checkpoint_flavor;
  model_args_ = job_model.args;
  model_name_ = job_model.name;
  if (models::take_flavor_mask(loaded_, *model_args_))
    log::info("Attention mask: ", c.model.attn_mask_type, " (flavor ", quote(model_name_),
              "'s, as torchtitan defines it; set model.attn_mask_type to choose another)");
  spec_->check_parallelism(*model_args_, dims, c);
  // The stage split and schedule are checked before any communication.
  if (dims.pp > 1) distributed::pipeline::plan_stages(model_args_->layers(), spec_->tied_embeddings(*model_args_), c, dims.pp);

  log::info("Starting job: ", c.job.description);
  if (c.job.print_config) log::info("Running with configs: ", config::to_json(c));
  std::filesystem::create_directories(c.job.dump_folder);
  if (c.job.save_config_file && launch_.rank == 0) {
    auto path = std::filesystem::path(c.job.dump_folder) / *c.job.save_config_file;
    write_file(path.string(), config::to_json(c) + "\n");
    log::info("Saved job configs to ", path.string());
  }
  return dims;
}

void Trainer::start_process(const distributed::ParallelDims& dims) {
  const config::JobConfig& c = loaded_.config;
  const auto init_timeout = std::chrono::seconds(c.comm.init_timeout_seconds);
  distributed::ProcessWorld process = distributed::init_world(launch_, init_timeout);
  device_ = process.device;
  control_ = process.control;
  std::shared_ptr<distributed::Communicator> comm = process.comm;  // groups created from it inherit its timeout
  if (device_.is_cuda()) {
    if (launch_.launcher != "fake_backend") {  // a dry run's ranks are all this one
      const auto devices = distributed::report_devices(*control_, device_);
      constexpr size_t kListed = 16;
      for (size_t r = 0; r < std::min(devices.ranks.size(), kListed); ++r) log::info("Device of ", devices.ranks[r]);
      if (devices.ranks.size() > kListed) log::info("Devices of ", devices.ranks.size() - kListed, " more ranks not listed");
      for (const auto& line : devices.shared) log::warn(line, ": NCCL does not support two ranks on one GPU and may hang");
    }
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
  seed_ = c.debug.seed ? static_cast<uint64_t>(*c.debug.seed) : std::random_device{}();
  {
    // Every rank initialises the same model: rank 0's seed wins.
    at::Tensor shared = at::full({1}, static_cast<int64_t>(seed_ & 0x7fffffffffffffffULL), at::kLong).to(device_);
    mesh_->world()->broadcast(shared, 0);
    seed_ = static_cast<uint64_t>(shared.cpu().item<int64_t>());
  }
  at::manual_seed(seed_);
  log::info("Seed ", seed_, c.debug.seed ? " (debug.seed)" : " (random; set --debug.seed to reproduce)");
}

std::string Trainer::hf_folder_tokenizer(const std::string& folder) {
  // Weights from a Hugging Face folder come with their tokenizer: it is the default over torchtitan's path. The run
  // reads a copy in the dump folder named by its content, hf_tokenizer/<CRC-32>, which nothing replaces or removes:
  // its checkpoints record that copy, and a resume reads it again though the folder changed or went since.
  namespace fs = std::filesystem;
  const config::JobConfig& c = loaded_.config;
  const std::vector<std::string> names = {"tokenizer.json", "tokenizer.model", "tokenizer.meta.json", "tokenizer_config.json",
                                          "special_tokens_map.json"};
  if (const auto resume = checkpoint::Checkpointer::resume_directory(c.checkpoint, c.job.dump_folder);
      resume && fs::exists(fs::path(*resume) / "metadata.json")) {
    const checkpoint::Reader reader(*resume);
    const std::string recorded = reader.metadata().value("tokenizer", "");
    const fs::path copies = fs::absolute(fs::path(c.job.dump_folder) / "hf_tokenizer").lexically_normal();
    if (!recorded.empty() && fs::exists(recorded) &&
        fs::absolute(recorded).lexically_normal().parent_path().parent_path() == copies) {
      log::info("Tokenizer: the copy ", recorded, " the run has trained with (of the folder its weights came from)");
      mesh_->world()->barrier();  // every rank passes one barrier here, whichever way it decides
      return fs::path(recorded).parent_path().string();
    }
  }
  std::vector<std::string> present;
  for (const auto& name : names)
    if (fs::exists(fs::path(folder) / name)) present.push_back(name);
  if (std::find(present.begin(), present.end(), names[0]) == present.end() &&
      std::find(present.begin(), present.end(), names[1]) == present.end()) {
    mesh_->world()->barrier();
    return c.model.hf_assets_path;  // no tokenizer there: torchtitan's default path, which names itself if missing
  }
  uint32_t crc = 0;
  for (const auto& name : present) {
    std::ifstream in(fs::path(folder) / name, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    crc = crc32_update(crc32_update(crc, name.data(), name.size() + 1), bytes.data(), bytes.size());
  }
  const fs::path copy = fs::path(c.job.dump_folder) / "hf_tokenizer" / strprintf("%08x", crc);
  // Each rank copies what it does not see (a dump folder need not be shared); the same bytes under the same name.
  auto make_copy = [&] {
    if (fs::exists(copy)) return;
    const fs::path partial = cat(copy.string(), ".partial-", launch_.rank);
    fs::remove_all(partial);
    fs::create_directories(partial);
    for (const auto& name : present) copy_file_as_own((fs::path(folder) / name).string(), (partial / name).string());
    std::error_code ec;
    fs::rename(partial, copy, ec);  // fails where another rank's copy came first: that one is the same
    if (ec) fs::remove_all(partial);
  };
  if (launch_.rank == 0) make_copy();
  mesh_->world()->barrier();
  make_copy();
  log::info("Tokenizer of ", quote(folder), ", the folder the weights come from (model.hf_assets_path is not set), read from "
            "its copy ", copy.string());
  return copy.string();
}

void Trainer::build_tokenizer() {
  const config::JobConfig& c = loaded_.config;
  const int64_t vocab = model_args_->vocabulary();
  std::string tokenizer_path = c.model.hf_assets_path;
  if (c.checkpoint.initial_load_in_hf && c.checkpoint.initial_load_path && !loaded_.origins.count("model.hf_assets_path") &&
      !loaded_.origins.count("model.tokenizer_path"))
    tokenizer_path = hf_folder_tokenizer(*c.checkpoint.initial_load_path);
  if (tokenizer_path == data::kBuiltinTokenizer) {
    // Rank 0 learns it; the others reuse its file, or learn the same one where the dump folder is not shared.
    if (launch_.rank == 0) data::ensure_builtin_tokenizer(c.job.dump_folder, vocab);
    mesh_->world()->barrier();
    tokenizer_path = data::ensure_builtin_tokenizer(c.job.dump_folder, vocab);
  }
  tokenizer_ = tokenizer::load(tokenizer_path);
  if (!tokenizer_->bos_id() && !tokenizer_->eos_id())
    log::warn("the tokenizer at ", quote(tokenizer_path), " has neither a BOS nor an EOS token (none of the usual names, no "
              "tokenizer_config.json naming them): packed documents run into each other with nothing between them");
  log::info("Tokenizer: ", tokenizer_->description(), "; BOS ", tokenizer_->bos_id() ? std::to_string(*tokenizer_->bos_id()) : "none",
            ", EOS ", tokenizer_->eos_id() ? std::to_string(*tokenizer_->eos_id()) : "none");
  if (tokenizer_->vocab_size() > vocab)
    fail("the tokenizer at ", quote(tokenizer_path), " has ", tokenizer_->vocab_size(), " ids but the model (", model_name_,
         ") has vocab_size ", vocab,
         "; pick a tokenizer that fits (model.hf_assets_path), a flavor with a larger vocabulary or a larger model.vocab_size");
}

void Trainer::build_model(const distributed::ParallelDims& dims) {
  const config::JobConfig& c = loaded_.config;
  const protocols::ModelArgs& args = *model_args_;
  // The model is built without storage; the parallelisms shard it, and each rank then allocates and initialises
  // only its own pieces, with values that depend on the seed alone (nn/init.h), not on the layout.
  const at::ScalarType param_dtype = titan::config::dtype_from_name(c.training.dtype, "training.dtype");
  if (const auto errors = quantization::float8_config_errors(loaded_, device_); !errors.empty())
    fail("this configuration asks for model conversions (model.converters, [quantize]) titan.cpp cannot run:\n  - ", join(errors, "\n  - "));
  model_ = spec_->build(args, nn::ParameterOptions{at::TensorOptions().device(device_).dtype(param_dtype), /*allocate=*/false});
  model_->move_buffers(device_);
  // Converters run between building and parallelizing (torchtitan's order: converters, TP, CP, AC, FSDP).
  std::shared_ptr<distributed::FsdpOptions::Float8AllGather> fsdp_float8;
  if (quantization::float8_enabled(c)) fsdp_float8 = quantization::convert_to_float8(*model_, c).fsdp_float8;
  if (quantization::mx_enabled(c)) quantization::convert_to_mx(*model_, c);
  if (quantization::grouped_mx_enabled(c) || quantization::grouped_float8_enabled(c)) quantization::convert_grouped(*model_, c);
  if (c.model.print_after_conversion) {
    std::ostringstream structure;
    structure << *model_;
    log::info("Model after conversion (model.print_after_conversion):\n", structure.str());
  }
  hf_adapter_ = spec_->state_dict_adapter(args);
  log::info("Model ", spec_->name, " ", model_name_, " size: ", with_thousands(args.reported_parameters()), " total parameters; ",
            strprintf("%.2f", args.flops_per_token(c.training.seq_len) / 1e6), " MFLOP per token at seq_len ", c.training.seq_len);

  // Mixed precision as torchtitan: FSDP gathers parameters in mixed_precision_param and reduces gradients in
  // mixed_precision_reduce; single-device, TP-only and DDP runs compute under autocast instead.
  const at::ScalarType mp_param = titan::config::dtype_from_name(c.training.mixed_precision_param, "training.mixed_precision_param");
  distributed::FsdpOptions fsdp;
  fsdp.device = device_;
  fsdp.shard_dtype = param_dtype;
  fsdp.param_dtype = param_dtype == at::kFloat ? mp_param : param_dtype;
  fsdp.reduce_dtype = titan::config::dtype_from_name(c.training.mixed_precision_reduce, "training.mixed_precision_reduce");
  fsdp.reshard_after_forward = c.parallelism.fsdp_reshard_after_forward;
  if (fsdp_float8 && dims.tp > 1) fsdp_float8->tp_group = mesh_->get("tp");
  fsdp.float8 = fsdp_float8;
  if (protocols::computes_under_autocast(c, dims)) autocast_dtype_ = at::kBFloat16;
  schedule_ = make_step_schedule(*model_, *spec_, args, *mesh_, c, fsdp, autocast_dtype_);
  for (const auto& line : schedule_->describe()) log::info(line);
  for (auto& part : model_parts()) {
    for (const auto& p : part.parameters) parameters_.push_back(p);
    for (const auto& b : part.buffers) buffers_.push_back(b);
  }
  distributed::initialize(parameters_, model_->init_specs(), seed_);
  metrics_ = std::make_unique<MetricsProcessor>(c, launch_.rank, device_, dims.non_data_parallel_size());
  profiler_ = std::make_unique<Profiler>(c.profiling, c.job.dump_folder, launch_.rank, device_.is_cuda());
  log::info(strprintf("Parameters on this rank: %.2f MB (initialised from seed %llu, %s); peak memory so far %.2f GiB",
                      distributed::local_parameter_bytes(parameters_) / 1e6, static_cast<unsigned long long>(seed_),
                      mesh_->world()->size() > 1 ? "each rank its own pieces" : "whole model", metrics_->memory().peak().peak_gib));
  if (dims.fsdp_enabled()) {
    log::info("Mixed precision training is handled by FSDP (", c.training.mixed_precision_param, " compute, ",
              c.training.mixed_precision_reduce, " gradient reduction)");
  } else {
    log::info(!autocast_dtype_ ? cat("Training in ", c.training.dtype, " without autocast")
                               : cat("Mixed precision training is handled by autocast (bfloat16 compute, float32 parameters; ",
                                     weight_casts_per_step_ ? "each weight cast once per step)"
                                                            : "weights cast in every forward and recomputation: training.autocast_weight_casts = \"forward\")"));
  }
  const bool bf16_compute = dims.fsdp_enabled() ? fsdp.param_dtype == at::kBFloat16
                                                : autocast_dtype_ == at::kBFloat16 || c.training.dtype == "bfloat16";
  if (device_.is_cpu() && bf16_compute && nn::emulates_bf16_gemm())
    log::info("bf16 matrix products computed in float32 and rounded to bf16 (nn/matmul.h): this CPU lacks AVX512_BF16, "
              "where LibTorch's bf16 GEMM runs at 1/80 (no AVX-512) to 1/3 (AVX-512) of the float32 rate");
}

void Trainer::build_training(const distributed::ParallelDims& dims) {
  const config::JobConfig& c = loaded_.config;
  optimizer_ = std::make_unique<Adam>(distributed::local_tensors(parameters_), c.optimizer);
  // The moments are allocated now rather than at the first update (as PyTorch does): the first step then holds what
  // every later one holds, so its memory line shows the run's peak, and a job that cannot hold them fails before it
  // trains. Zero moments and a zero step count are what the lazy path starts from, and checkpoints leave them out.
  optimizer_->init_state();
  if (c.optimizer.early_step_in_backward) {
    step_in_backward_ = std::make_unique<StepInBackward>(*optimizer_, parameters_);
    for (auto& part : model_parts())
      part.data_parallel->set_gradient_listener([this](const std::vector<at::Tensor>& locals) { step_in_backward_->on_gradients(locals); });
    log::info("Optimizer steps in backward (optimizer.early_step_in_backward): each parameter is updated once its gradient "
              "for the step is final, and the gradient freed");
  }
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
  for (const auto& source : sources) {
    const bool named_by_file = source.shards.size() == 1 && source.name == source.shards.front().path;
    log::info("Dataset ", quote(source.name), ": ", source.shards.size(), " file(s), ", data::format_name(source.shards.front().format),
              sources.size() > 1 ? cat(", weight ", source.weight) : std::string(),
              named_by_file ? "" : cat(source.shards.size() > 1 ? ", first " : ", ", source.shards.front().path));
  }
  data::LoaderOptions data_options = data::training_loader_options(c, mesh_->dp_rank(), dp_degree);
  dataloader_ = std::make_unique<data::DataLoader>(std::move(sources), tokenizer_.get(), data_options);
  if (c.validation.enable) validator_ = std::make_unique<Validator>(c, *tokenizer_, *mesh_, device_);

  if (c.checkpoint.enable || c.checkpoint.initial_load_path) {
    checkpointer_ = std::make_unique<checkpoint::Checkpointer>(c.checkpoint, c.job.dump_folder,
                                                               static_cast<double>(c.comm.train_timeout_seconds) + 600.0, *mesh_);
    model_weights_ = std::make_unique<checkpoint::ModelWeights>(
        parameters_, *model_args_, checkpoint_flavor_, std::filesystem::absolute(tokenizer_->source_path()).string(), &buffers_);
    optimizer_state_ = std::make_unique<OptimizerState>(*optimizer_, parameters_, c.optimizer);
    // One data-parallel rank's stream is read by every rank of its TP/CP/PP group; the first of them saves it.
    const bool saves_data = mesh_->coordinate("tp") == 0 && mesh_->coordinate("cp") == 0 && mesh_->coordinate("pp") == 0;
    dataloader_state_ = std::make_unique<data::DataLoaderState>(*dataloader_, saves_data);
    checkpoint_parts_ = {{"model", model_weights_.get()}, {"optimizer", optimizer_state_.get()},
                         {"lr_scheduler", lr_scheduler_.get()}, {"dataloader", dataloader_state_.get()},
                         {"train_state", &train_state_}};
    if (checkpointer_->load(checkpoint_parts_, hf_model())) optimizer_->set_lr(lr_scheduler_->current_lr());
    if (c.checkpoint.enable && c.checkpoint.load_only)
      log::info("checkpoint.load_only: checkpoints are loaded but none is saved (no interval, last or signal saves)");
  }
  // The device's peak for MFU, measured (on a CPU) once everything is built, as the first step will find the machine.
  const at::ScalarType param_dtype = titan::config::dtype_from_name(c.training.dtype, "training.dtype");
  metrics_->set_flops(model_args_->flops_per_token(c.training.seq_len),
                      metrics::peak_flops(device_, autocast_dtype_.value_or(param_dtype), /*may_cache=*/launch_.local_world_size == 1));
  log::info(metrics_->memory().describe(), "; ", metrics_->peak().derivation);
}

Trainer::~Trainer() = default;

std::vector<data::Batch> Trainer::next_microbatches() {
  std::vector<data::Batch> out;
  for (int64_t i = 0; i < grad_accum_steps_; ++i) out.push_back(dataloader_->next());
  return out;
}

Control Trainer::exchange_control(bool exhausted, int64_t valid_tokens, int signal, bool save_failed) {
  if (control_->size() > 1) ++control_reductions_;
  return titan::exchange_control(*control_, mesh_->dims().non_data_parallel_size(), exhausted, valid_tokens, signal, save_failed,
                                 device_reads_);
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
  out.step = train_state_.step;
  out.lr = optimizer_->lr();
  optimizer_->zero_grad();
  // The loss is divided by the number of valid tokens in the whole global batch (all micro-batches, all ranks),
  // so every token weighs the same however the batch is split.
  if (global_valid_count == 0) fail("a training step has no valid label tokens");
  for (const auto& mb : microbatches) out.tokens += mb.labels.numel();  // per device, divided by cp x tp x pp in the log
  at::Tensor loss_total;
  {
    // Autocast's bfloat16 copies of the weights live until every micro-batch's backward is done, before the update.
    nn::StepWeightCasts casts(autocast_dtype_.has_value() && weight_casts_per_step_);
    loss_total = schedule_->train(microbatches, static_cast<double>(global_valid_count), train_state_.step);
  }
  schedule_->finish_gradients();
  // The parts' pre-optimizer-step work (MoE balancing) and the model's figures from it (the maximum over the parts
  // and the pipeline stages), read on the host with the loss.
  at::Tensor figures;
  for (auto& part : model_parts())
    if (part.before_optimizer_step) {
      at::Tensor f = part.before_optimizer_step->update().to(device_, at::kDouble).reshape(-1);
      figures = figures.defined() ? at::maximum(figures, f) : f;
    }
  if (figures.defined()) {
    if (const auto pp = mesh_->get("pp"); pp->size() > 1) {
      at::Tensor buffer = figures.to(pp->tensor_device()).contiguous();
      pp->all_reduce(buffer, distributed::ReduceOp::Max);
      figures = buffer.to(device_);
    }
    out.figure_count = figures.numel();
  }
  at::Tensor norm = step_in_backward_ ? step_in_backward_->finish(*mesh_->world())
                                      : distributed::clip_grad_norm(parameters_, loaded_.config.training.max_norm, *mesh_->world());
  if (step_in_backward_ && !step_in_backward_logged_) {
    step_in_backward_logged_ = true;
    log::info("Optimizer steps in backward: ", step_in_backward_->stepped_during_backward(), " of this rank's parameter tensors were "
              "updated as their gradients became final, ", step_in_backward_->stepped_after_backward(),
              " once every reduction had ended (tensor-parallel sums, DDP's last bucket)");
  }
  mesh_->get("loss")->all_reduce(loss_total, distributed::ReduceOp::Sum);
  schedule_->gather_loss(loss_total);
  // Loss, gradient norm and whether either is not finite, on the device; both are global (the same on every rank),
  // so every rank takes the same decision.
  at::Tensor values = at::stack({loss_total.reshape({}).to(at::kDouble), norm.reshape({}).to(at::kDouble)});
  const at::Tensor nonfinite = values.isfinite().all().logical_not();
  std::vector<at::Tensor> all = {values, nonfinite.to(at::kDouble).reshape({1})};
  if (figures.defined()) all.push_back(figures);
  out.values = at::cat(all);
  if (!device_.is_cpu()) {
    // Copied to pinned host memory behind the step's work, with an event to wait on when they are read: a
    // blocking copy would wait for everything queued by then (the next step's forward and backward too).
    out.host_values = at::empty({out.values.numel()}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
    out.host_values.copy_(out.values, /*non_blocking=*/true);
    out.ready = std::make_shared<c10::Event>(device_.type());
    out.ready->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
  }
  // The step before this one is settled now, before this step's update: its values were computed long ago, so
  // reading them waits for nothing that is still running.
  settle_pending();
  update(out, nonfinite);
  if (pipeline() && loaded_.config.debug.pipeline_timeline) write_pipeline_timeline();
  return out;
}

void Trainer::update(DeviceStep& step, const at::Tensor& nonfinite) {
  if (step_in_backward_) {
    // Already applied during backward. The step is read later, as the fused path's: before the next update, a log
    // line, a checkpoint or validation, so a non-finite step stops the run before any checkpoint holds its weights.
  } else if (optimizer_->skips_on_device()) {
    // No update where the step was not finite, decided on the device; the host learns of it later (settle).
    optimizer_->step(nonfinite.to(at::kFloat));
  } else {
    ++reads_at_once_;
    step.settled = settle(step);
    if (!step.settled->skipped) optimizer_->step();  // a skipped step: no update; the schedule still advances
  }
  // The gradients are spent: freed now rather than at the next step's start, so that validation, checkpoint saves and
  // exports between the steps do not run beside them (the memory estimate's last moment is the end of backward).
  optimizer_->zero_grad();
  for (auto& part : model_parts()) part.data_parallel->after_optimizer_step();
  lr_scheduler_->step();
  optimizer_->set_lr(lr_scheduler_->current_lr());
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
  if (pending.figure_count > 0)
    for (auto& part : model_parts())
      if (part.before_optimizer_step) {
        const at::Tensor f = v.narrow(0, 3, pending.figure_count);
        r.scalars = part.before_optimizer_step->scalars(f);
        r.summary = part.before_optimizer_step->summary(f);
        break;
      }

  if (!r.skipped) {
    nonfinite_in_row_ = 0;
    return r;
  }
  // A non-finite loss or gradient norm: nothing was applied, and the last checkpoint is untouched.
  ++nonfinite_in_row_;
  ++nonfinite_total_;
  const int64_t allowed = loaded_.config.training.skip_nonfinite_steps;
  const std::string what = cat("step ", pending.step, ": the loss is ", r.loss, " and the gradient norm ", r.grad_norm);
  if (step_in_backward_)
    fail(what, "; the update was applied during backward (optimizer.early_step_in_backward), so the weights in memory "
         "may not be finite: stopping (the last checkpoint is untouched)");
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
  ++(pending.step < train_state_.step ? reads_a_step_later_ : reads_at_once_);
  return settle(pending);
}

at::Tensor Trainer::read_host_tensor(const at::Tensor& t) {
  if (!t.device().is_cpu()) ++device_reads_;
  return t.cpu();
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
  // A GPU's caching allocator, and on the CPU titan's host block cache (which splits and merges its blocks since
  // 2026-12-03), reuse freed memory for requests of any size, so the gradients backward makes take the activations'
  // memory as it is freed. Without the cache (TITAN_HOST_ALLOCATOR=malloc, another malloc preloaded) glibc's heap
  // keeps the blocks it serves, and the peak holds both.
  const bool host_cache = device_.is_cpu() && c10::GetCPUAllocator() == metrics::host_block_cache();
  const auto allocator = !device_.is_cpu() || host_cache ? protocols::Allocator::device_caching : protocols::Allocator::host_cache;
  auto estimate = spec_->estimate_memory(*model_args_, c, dims, autocast, runtime, protocols::Execution::titan,
                                         mesh_->coordinate("pp"), fused, allocator);
  // Asynchronous checkpoints keep a host copy of the rank's whole state (its parameters and AdamW moments) for their
  // saves, made after the first step (Checkpointer::prepare_staging) and kept: on a CPU that is this device's memory.
  if (device_.is_cpu() && saves_checkpoints() && c.checkpoint.async_mode != "disabled") {
    double state = 0;
    for (const auto& term : estimate.terms)
      if (term.name == "parameters" || term.name == "optimizer") state += term.bytes;
    estimate.terms.insert(estimate.terms.end() - (estimate.terms.back().name == "runtime" ? 1 : 0), {"checkpoint staging", state});
  }
  const auto available = metrics::available_memory(device_, launch_.local_world_size);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  log::info("Memory estimate for this rank: ", estimate.describe(), strprintf(" of %.2f GiB available (", available.bytes / gib),
            available.source, ")");
  estimated_bytes_ = estimate.total();
  available_bytes_ = available.bytes;
  if (estimate.total() <= available.bytes || estimate_only()) return;  // an estimate alone reports what does not fit
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

void Trainer::restrict_to_memory_estimation() {
  // torchtitan estimates a job's memory in a separate script (FakeTensorMode: no real allocations); titan's start-up
  // estimate needs no allocations either. With disable_fake_mode the job also runs two real steps, and the estimate
  // is set against their measured peak. Neither trains: nothing is loaded, saved, validated, profiled or logged to
  // metric files.
  config::JobConfig& c = loaded_.config;
  c.checkpoint.enable = false;
  c.checkpoint.initial_load_path.reset();
  c.checkpoint.create_seed_checkpoint = false;
  c.validation.enable = false;
  c.profiling.enable_profiling = false;
  c.profiling.enable_memory_snapshot = false;
  c.metrics.enable_tensorboard = c.metrics.enable_wandb = c.metrics.enable_jsonl = false;
  c.metrics.log_freq = 1;  // each step's peak
  log::info("memory_estimation.enable: estimating this job's memory instead of training it: ",
            c.memory_estimation.disable_fake_mode
                ? "2 steps, then each rank's estimate against its measured peak (no checkpoint, validation, profiling or "
                  "metric files)"
                : "each rank's start-up estimate, with nothing allocated (memory_estimation.disable_fake_mode = true also "
                  "runs 2 steps and measures)");
}

int Trainer::report_memory_estimation(int64_t steps_run) {
  const bool measured = steps_run > 0;
  // Rank 0 lists every rank: estimate, measured peak (or 0), what was available.
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double mine[3] = {estimated_bytes_ / gib, measured ? metrics_->highest_peak_gib() : 0.0, available_bytes_ / gib};
  auto world = mesh_->world();
  at::Tensor local = at::tensor(at::ArrayRef<double>(mine, 3), at::kDouble).to(world->tensor_device());
  at::Tensor all = at::empty({world->size() * 3}, local.options());
  world->all_gather_into(all, local);
  all = all.cpu();
  const double* v = all.data_ptr<double>();
  bool fits = true;
  std::string lines;
  // A dry run (comm.mode = "fake_backend") knows only the rank it plays: the others' figures would be copies of it.
  const bool one_rank = launch_.launcher == "fake_backend";
  for (int r = one_rank ? launch_.rank : 0; r < (one_rank ? launch_.rank + 1 : world->size()); ++r) {
    const double estimate = v[3 * (one_rank ? 0 : r)], peak = v[3 * (one_rank ? 0 : r) + 1], available = v[3 * (one_rank ? 0 : r) + 2];
    fits = fits && estimate <= available;
    lines += strprintf("\n  rank %d: estimated %.3f GiB", r, estimate);
    if (measured) lines += strprintf(", measured peak %.3f GiB (estimate / measured %.2f)", peak, peak > 0 ? estimate / peak : 0.0);
    lines += strprintf(" of %.2f GiB available%s", available, estimate <= available ? "" : ": does not fit");
  }
  log::info("Memory estimation (memory_estimation.enable; ",
            measured ? cat(steps_run, " step(s) run") : estimate_only() ? std::string("nothing allocated") : std::string("no step run"), "), ",
            one_rank ? (fits ? "this rank fits" : "this rank does not fit") : fits ? "every rank fits" : "some ranks do not fit", ":", lines);
  return 0;
}

void Trainer::write_pipeline_timeline() {
  // debug.pipeline_timeline: what each action of this step ran, when, on this rank (appended per step).
  const auto dir = std::filesystem::path(loaded_.config.job.dump_folder) / "pipeline_timeline";
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / strprintf("rank-%05d.csv", mesh_->world()->rank()), std::ios::app);
  for (const auto& e : pipeline()->runner().timeline())
    out << e.step << "," << e.action << "," << strprintf("%.6f,%.6f,%.6f", e.start, e.end, e.waited) << "\n";
  if (!out.flush()) fail("cannot write the pipeline timeline in ", quote(dir.string()), describe_write_error(errno));
  pipeline()->runner().clear_timeline();
}

double Trainer::validate() {
  if (!validator_) fail("validation is off (validation.enable = false)");
  // A stop signal ends a long validation early (every rank agrees before each batch), so that the step's checkpoint
  // is saved within a preemption's grace period; the training loop then stops as after any step.
  const ValidationResult result =
      validator_->run(*schedule_, [&] { return exchange_control(false, 0, StopSignals::received(), false).signal; });
  if (result.interrupted) {
    log::warn("validation at step ", train_state_.step, " stopped after ", result.batches, " batch(es): ",
              signal_name(result.interrupted), " received; its loss is not logged",
              train_state_.step == loaded_.config.training.steps ? " (training itself is complete and saved)" : "");
    return std::nan("");
  }
  metrics_->log_validation(train_state_.step, result);
  return result.loss;
}

int Trainer::create_seed_checkpoint() {
  // torchtitan's seed checkpoint: the initialised model, saved once as step 0 from a single process, so that later
  // runs on any layout start from the same weights.
  if (mesh_->world()->size() != 1)
    fail("checkpoint.create_seed_checkpoint runs on a single process (it saves the unsharded initial model); got ",
         mesh_->world()->size(), " ranks");
  if (!checkpointer_ || !loaded_.config.checkpoint.enable) fail("checkpoint.create_seed_checkpoint needs checkpoint.enable = true");
  if (loaded_.config.checkpoint.load_only) fail("checkpoint.create_seed_checkpoint saves a checkpoint; checkpoint.load_only = true saves none");
  const std::filesystem::path existing = std::filesystem::path(checkpointer_->folder()) / "step-0" / "metadata.json";
  if (std::filesystem::exists(existing)) {
    log::warn("a seed checkpoint already exists in ", checkpointer_->folder(), " (step-0); it is kept, not replaced: remove it "
              "to create another");
    return 0;
  }
  save_checkpoint(/*last=*/true);
  checkpointer_->wait();
  log::info("Created seed checkpoint at step 0 in ", checkpointer_->folder());
  return 0;
}

int Trainer::stop_for_signal(int signal, int64_t first_step, std::vector<data::LaneState> position_before) {
  // Every rank stops after the same step, whichever rank the signal reached, and saves it (collective) unless it was
  // just saved, with the data position before the batches just fetched, so that a preempted or requeued job resumes
  // where it stopped.
  const auto& c = loaded_.config;
  const int64_t step = train_state_.step;
  settle_pending();
  const bool enabled = checkpointer_ && saves_checkpoints() && step > first_step;
  if (enabled && !checkpointer_->should_save(step, step == c.training.steps)) {
    dataloader_->rewind_reported_position(std::move(position_before));
    save_checkpoint(/*last=*/false);
  }
  if (checkpointer_) checkpointer_->wait();
  log::warn("received ", signal_name(signal), ": stopped cleanly after step ", step, " of ", c.training.steps,
            enabled ? cat("; checkpoint step-", step, " is complete") : std::string(), " (exit code ", 128 + signal, ")");
  return 128 + signal;
}

void Trainer::after_step(std::optional<StepResult> r, int64_t first_step) {
  // The step's loss and gradient norm stay on the device until a log line, a checkpoint or the end needs them (or the
  // next step's update, before which a non-finite step must be known): no per-step wait for the device.
  const auto& c = loaded_.config;
  const int64_t step = train_state_.step;
  // After the first step this process ran (start-up and first collectives done; on a resumed run too) a tighter
  // timeout catches a dead or hung rank.
  if (step == first_step + 1) {
    const auto timeout = std::chrono::seconds(c.comm.train_timeout_seconds);
    mesh_->set_timeout(timeout);
    if (control_ != mesh_->world()) control_->set_timeout(timeout);
    if (pipeline()) pipeline()->runner().set_timeout(timeout);
  }
  const bool log_now = step == 1 || step % c.metrics.log_freq == 0;
  const bool save_now = checkpointer_ && saves_checkpoints() && checkpointer_->should_save(step, step == c.training.steps);
  const bool validate_now = c.validation.enable && (step == 1 || step % c.validation.freq == 0);
  if ((log_now || save_now || validate_now || step == c.training.steps) && !r) r = settle_pending();
  if (log_now) metrics_->log_step(step, *r, train_state_.tokens_seen);
  if (save_now) {
    save_checkpoint(step == c.training.steps);
    metrics_->restart_clock();  // saving time does not count against training throughput
  } else if (step == first_step + 1 && checkpointer_ && saves_checkpoints()) {
    // Async saves: the first save's staging memory, made in the background now that the optimizer state exists.
    checkpointer_->prepare_staging(checkpoint_parts_, step, c.training.steps);
  }
  if (validate_now) {
    validate();
    metrics_->restart_clock();  // nor does validation's
  }
  if (log_now || validate_now) metrics_->end_step();
}

int Trainer::train() {
  if (estimate_only()) return report_memory_estimation(0);
  const auto& c = loaded_.config;
  StopSignals stop_signals;
  const int64_t pp_microbatches = mesh_->dims().pp > 1
                                      ? c.training.local_batch_size / std::max<int64_t>(1, c.parallelism.pipeline_parallel_microbatch_size)
                                      : 0;
  log::info("Training starts at step ", train_state_.step + 1, " of ", c.training.steps, " (local batch ", c.training.local_batch_size,
            " x seq_len ", c.training.seq_len, ", ", grad_accum_steps_, " gradient-accumulation pass(es) per step",
            pp_microbatches ? cat(", each ", pp_microbatches, " pipeline micro-batches") : std::string(), ", lr warm-up ",
            lr_scheduler_->warmup_steps(), " steps)");
  if (c.checkpoint.create_seed_checkpoint) {
    const int code = create_seed_checkpoint();
    metrics_->finish(code);
    return code;
  }
  if (train_state_.step >= c.training.steps && !c.memory_estimation.enable)
    log::warn("the run starts at step ", train_state_.step, " (its checkpoint), which is not before training.steps = ", c.training.steps,
              " ", loaded_.where("training.steps"), ": there is nothing to train; raise training.steps to continue");
  metrics_->restart_clock();
  const double train_start = now_seconds();
  const int64_t first_step = train_state_.step;
  metrics_->memory().reset_peak();
  int exit_code = 0;
  const int64_t last_step = c.memory_estimation.enable ? std::min(c.training.steps, first_step + 2) : c.training.steps;
  while (train_state_.step < last_step) {
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
    // One control reduction per step: whether any rank ran out of data (lanes run out at different steps), the step's
    // valid label tokens, and what reached any rank since the last step (a stop signal, a failed background
    // checkpoint write), so that every rank takes the same decision.
    const bool save_failed_here = checkpointer_ && !checkpointer_->background_failure().empty();
    const Control control = exchange_control(exhausted, exhausted ? 0 : local_valid_tokens(microbatches), StopSignals::received(),
                                             save_failed_here);
    if (control.save_failed) {
      checkpointer_->abandon_background();
      if (save_failed_here) checkpointer_->wait();  // throws with the cause
      fail_after_peer("stopping after step ", train_state_.step, ": another rank's asynchronous checkpoint write failed (its "
                      "error says why); the previous complete checkpoint is untouched");
    }
    if (control.signal) {
      exit_code = stop_for_signal(control.signal, first_step, std::move(position_before));
      break;
    }
    if (control.exhausted) {
      log::warn("stopping after step ", train_state_.step, " of ", c.training.steps, ": the data ran out");
      break;
    }
    ++train_state_.step;
    profiler_->step_begin(train_state_.step);
    DeviceStep launched = launch_step(microbatches, control.valid_tokens);
    profiler_->step_end(train_state_.step);
    metrics_->count_step(launched.tokens, data_seconds);
    train_state_.tokens_seen += launched.tokens * mesh_->dims().dp_degree();  // all ranks: the same after a change of layout
    std::optional<StepResult> r = launched.settled;
    if (!r) unsettled_ = std::move(launched);
    after_step(r, first_step);
  }
  settle_pending();  // a step left unread when the loop stopped early
  if (exit_code == 0 && train_state_.step == c.training.steps && train_state_.step > first_step) check_last_save();
  log::info("Step results read on the host: ", reads_at_once_, " right after their step (log lines, checkpoints, validation, the "
            "last step), ", reads_a_step_later_, " one step later (before the next update, waiting for no running work); ",
            control_reductions_, " control reduction(s) over ", control_->size(), " rank(s) on ",
            control_->tensor_device().is_cpu() ? "host memory" : "the device", "; ", device_reads_, " read(s) of device memory");
  if (checkpointer_) checkpointer_->wait();
  if (c.memory_estimation.enable && exit_code == 0) exit_code = report_memory_estimation(train_state_.step - first_step);
  else if (exit_code == 0)
    log::info("Training completed: ", train_state_.step, " steps, ", with_thousands(train_state_.tokens_seen), " tokens");
  log_summary(first_step, train_start);
  metrics_->finish(exit_code);
  return exit_code;
}

void Trainer::record_failure(int exit_code) noexcept {
  if (!metrics_) return;
  try {
    metrics_->finish(exit_code);
  } catch (const std::exception& e) {
    log::warn("the metric files could not record exit code ", exit_code, ": ", e.what());
  }
}

void Trainer::check_last_save() {
  // The last step's background checkpoint write may have failed on another rank: every rank learns of it (a stop
  // signal this late changes nothing: the run is complete).
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
    fail_after_peer("step ", train_state_.step, ": another rank's asynchronous checkpoint write failed (its error says why); "
                    "the previous complete checkpoint is untouched");
  }
}

void Trainer::log_summary(int64_t first_step, double train_start) {
  const double steps = static_cast<double>(train_state_.step - first_step);  // run by this process
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
  if (pipeline() && pipeline()->runner().steps() > 0) {
    const auto& r = pipeline()->runner();
    log::info(strprintf("Pipeline on this rank: measured bubble %.1f%%%s (schedule's simulated bubble %.1f%%), %.2f MB sent to "
                        "neighbouring stages per step, at most %d micro-batches in flight; %lld activation shape header(s) read "
                        "back from the device over %lld training pass(es) of the schedule (the first activation of a shape "
                        "on each channel, and every one in validation), no loss read back within a pass",
                        100.0 * r.bubble(), mesh_->world()->waits_block_host() ? "" : " (host clock: GPU work runs after it is issued)",
                        100.0 * r.schedule().simulate().bubble,
                        static_cast<double>(r.bytes_sent()) / static_cast<double>(r.steps()) * static_cast<double>(grad_accum_steps_) / 1e6, r.max_in_flight(),
                        static_cast<long long>(r.header_reads()), static_cast<long long>(r.steps())));
  }
  if (mesh_->dims().cp > 1 && steps > 0)
    log::info(strprintf("Context-parallel communication per step on this rank: %.2f MB sent, %.3f s %s for keys and "
                        "values or their gradients; %.3f s per step in all",
                        mesh_->get("cp")->bytes_communicated() / steps / 1e6, distributed::ContextParallel::wait_seconds() / steps,
                        blocked.c_str(), (now_seconds() - train_start) / steps));
  if (mesh_->dims().tp > 1 && steps > 0)
    log::info(strprintf("Tensor-parallel communication per step on this rank: %.2f MB sent, %.3f s in its (synchronous) "
                        "collectives; %.3f s per step in all",
                        mesh_->get("tp")->bytes_communicated() / steps / 1e6, distributed::functional::collective_seconds() / steps,
                        (now_seconds() - train_start) / steps));
}

}  // namespace titan
