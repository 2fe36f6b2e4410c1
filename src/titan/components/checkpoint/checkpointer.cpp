#include "titan/components/checkpoint/checkpointer.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/accumulate.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <set>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/files.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/config/dtypes.h"
#include "titan/components/checkpoint/formats/dcp.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/components/checkpoint/torch_dcp_source.h"

namespace titan::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Host memory for a staging copy. Large buffers are mapped on a 2 MiB boundary with transparent huge pages asked
// for, so that the first copy into them faults in 2 MiB pages rather than 4 KiB ones: on the 2-core VM the 4 KiB
// faults held a copy into fresh memory to about 0.35 GB/s, against 5 GB/s into memory already touched.
at::Tensor host_buffer(at::IntArrayRef sizes, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  constexpr size_t kHuge = 2u << 20;
  if (bytes < 2 * kHuge) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  const size_t mapped = bytes + kHuge;
  void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  auto* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1));
#ifdef MADV_HUGEPAGE
  ::madvise(aligned, bytes, MADV_HUGEPAGE);  // a hint; without huge pages the buffer works the same
#endif
  return at::from_blob(aligned, sizes, [base, mapped](void*) { ::munmap(base, mapped); }, at::TensorOptions().dtype(dtype));
}

// What a staging copy of one piece needs to know.
struct PieceShape {
  std::string key;
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  std::optional<at::Device> device;  // a device tensor's (copied into pinned memory), none for host tensors
};

size_t bytes_of(const PieceShape& p) { return static_cast<size_t>(c10::multiply_integers(p.sizes)) * c10::elementSize(p.dtype); }

std::vector<PieceShape> shapes_of(const std::vector<protocols::TensorPiece>& pieces) {
  std::vector<PieceShape> out;
  for (const auto& p : pieces)
    out.push_back({p.key, p.tensor.sizes().vec(), p.tensor.scalar_type(),
                   p.tensor.is_cpu() ? std::nullopt : std::optional<at::Device>(p.tensor.device())});
  return out;
}

// What an asynchronous save writes from: copies of the state in host memory. Host-resident state is copied into
// one mapping (`arena`, with a view per key) kept for the next save and made again only when the set of tensors
// or a shape changes; device tensors are copied with non-blocking transfers, into pinned buffers kept for the next
// save when `pinned` is given (async_with_pinned_mem), else into fresh host memory, and finish() waits for those
// copies once. Synchronous saves write the tensors themselves.
class HostStaging {
 public:
  HostStaging(at::Tensor* arena, std::map<std::string, at::Tensor>* kept, std::map<std::string, at::Tensor>* pinned)
      : arena_(arena), kept_(kept), pinned_(pinned) {}

  // Makes the buffers a save of pieces of these shapes copies into, unless the kept ones fit. With `touch` (ahead
  // of the first save, in the background) every page of the host mapping is written once, so that the kernel's
  // zeroing of fresh pages happens now rather than inside the save; pinned buffers are made for device pieces.
  void prepare(const std::vector<PieceShape>& pieces, bool touch) {
    size_t host_pieces = 0;
    bool same = true;
    for (const auto& piece : pieces) {
      if (piece.device) continue;
      ++host_pieces;
      auto it = kept_->find(piece.key);
      same = same && it != kept_->end() && it->second.sizes() == piece.sizes && it->second.scalar_type() == piece.dtype;
    }
    if (!same || host_pieces != kept_->size()) {
      kept_->clear();
      *arena_ = at::Tensor();
      constexpr size_t kAlign = 64;
      size_t total = 0;
      for (const auto& piece : pieces)
        if (!piece.device) total += (bytes_of(piece) + kAlign - 1) / kAlign * kAlign;
      *arena_ = host_buffer({static_cast<int64_t>(std::max<size_t>(total, 1))}, at::kByte);
      if (touch) {
        auto* bytes = static_cast<volatile char*>(arena_->data_ptr());
        for (size_t i = 0; i < total; i += 4096) bytes[i] = 0;
      }
      size_t offset = 0;
      for (const auto& piece : pieces) {
        if (piece.device) continue;
        const size_t bytes = bytes_of(piece);
        (*kept_)[piece.key] = arena_->narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(bytes)).view(piece.dtype).view(piece.sizes);
        offset += (bytes + kAlign - 1) / kAlign * kAlign;
      }
    }
    if (!pinned_) return;
    for (const auto& piece : pieces) {
      if (!piece.device) continue;
      at::Tensor& buffer = (*pinned_)[piece.key];
      if (!buffer.defined() || buffer.sizes() != piece.sizes || buffer.scalar_type() != piece.dtype) {
        c10::DeviceGuard guard(*piece.device);  // pinned memory belongs to this rank's GPU's context
        buffer = at::empty(piece.sizes, at::TensorOptions().dtype(piece.dtype).pinned_memory(true));
      }
    }
  }

  // Replaces every piece's tensor by its host copy.
  void stage(std::vector<protocols::TensorPiece>& pieces) {
    prepare(shapes_of(pieces), /*touch=*/false);
    for (auto& piece : pieces) {
      const at::Tensor t = piece.tensor.detach();
      if (t.is_cpu()) {
        at::Tensor& buffer = kept_->at(piece.key);
        buffer.copy_(t);
        piece.tensor = buffer;
        continue;
      }
      device_ = t.device();
      at::Tensor host;
      if (pinned_) {
        host = pinned_->at(piece.key);
      } else {
        host = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
      }
      host.copy_(t, /*non_blocking=*/true);
      piece.tensor = host;
    }
  }
  void finish() {
    if (!device_) return;
    c10::Event copied(device_->type());
    copied.record(c10::impl::VirtualGuardImpl(device_->type()).getStream(*device_));
    copied.synchronize();
  }

 private:
  at::Tensor* arena_;
  std::map<std::string, at::Tensor>* kept_;
  std::map<std::string, at::Tensor>* pinned_;
  std::optional<at::Device> device_;
};

std::optional<int64_t> step_of(const fs::path& p) {
  static const std::regex pattern(R"(step-(\d+))");
  std::smatch m;
  const std::string name = p.filename().string();
  if (!std::regex_match(name, m, pattern)) return std::nullopt;
  return std::stoll(m[1]);
}

at::ScalarType export_dtype(const std::string& name) { return titan::config::dtype_from_name(name, "checkpoint.export_dtype"); }

// The fields the loader relies on, checked before anything is read, so that a damaged or hand-edited metadata (the
// checksum guards version 3 only) is refused naming the field instead of loading something else.
void check_metadata(const json& meta, const std::string& path, const std::string& directory, bool weights_only) {
  auto field = [&](const json& parent, const char* key) -> const json& {
    if (!parent.is_object() || !parent.contains(key)) fail(path, ": the metadata has no field ", quote(key));
    return parent.at(key);
  };
  auto integer = [&](const json& parent, const char* key, int64_t lo, int64_t hi) {
    const json& v = field(parent, key);
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail(path, ": field ", quote(key), " is ", v.dump(), "; expected an integer from ", lo, " to ", hi);
    return v.get<int64_t>();
  };
  const int64_t step = integer(meta, "step", 0, INT64_MAX);
  if (auto named = step_of(fs::path(directory)); named && *named != step)
    fail(path, ": the metadata says step ", step, " but the folder is ", quote(fs::path(directory).filename().string()),
         "; a checkpoint folder must not be renamed");
  if (meta.contains("model_only") && !meta["model_only"].is_boolean())
    fail(path, ": field \"model_only\" is ", meta["model_only"].dump(), "; expected true or false");
  const int64_t world_size = integer(meta, "world_size", 1, INT32_MAX);
  if (!field(meta, "flavor").is_string()) fail(path, ": field \"flavor\" is not a string");
  if (weights_only || meta.value("model_only", false)) return;
  const json& train = field(meta, "train_state");
  if (integer(train, "step", 0, INT64_MAX) != step)
    fail(path, ": train_state.step is ", train.at("step").dump(), " but the checkpoint's step is ", step);
  integer(train, "tokens_seen", 0, INT64_MAX);
  integer(field(meta, "lr_scheduler"), "completed", 0, step);
  for (const auto& [name, value] : field(field(meta, "optimizer"), "steps").items())
    if (!value.is_number() || !(value.get<double>() >= 0 && value.get<double>() <= static_cast<double>(step)))
      fail(path, ": optimizer.steps of ", quote(name), " is ", value.dump(), "; expected 0 to ", step);
  const json& ranks = field(meta, "ranks");
  if (!ranks.is_array() || static_cast<int64_t>(ranks.size()) != world_size)
    fail(path, ": field \"ranks\" must list ", world_size, " rank(s) (world_size)");
  for (const auto& r : ranks)
    if (!r.is_object() || (r.contains("dataloader") && !r["dataloader"].is_string()))
      fail(path, ": an entry of \"ranks\" is not a rank state");
}

}  // namespace

Checkpointer::Checkpointer(const config::Checkpoint& config, const std::string& dump_folder, double background_timeout_seconds,
                           const distributed::DeviceMesh& mesh)
    : config_(config), mesh_(mesh), root_((fs::path(dump_folder) / config_.folder).string()),
      background_timeout_seconds_(background_timeout_seconds) {
  if (config_.interval < 1) fail("checkpoint.interval must be at least 1, got ", config_.interval);
}

Checkpointer::~Checkpointer() {
  // An error still pending here was already reported by the training loop (or the job is failing anyway).
  abandon_background();
  if (purge_thread_.joinable()) purge_thread_.join();
  if (background_.joinable()) background_.join();
  if (staging_thread_.joinable()) staging_thread_.join();
}

void Checkpointer::prepare_staging(const protocols::StatefulParts& parts, int64_t step, int64_t last_step) {
  if (config_.async_mode == "disabled" || staging_thread_.joinable()) return;
  // Only ahead of a save of the whole state (the last save may be model-only, in another dtype).
  bool full_save_ahead = false;
  for (int64_t s = step + 1; s <= last_step && !full_save_ahead; ++s)
    full_save_ahead = should_save(s, s == last_step) && !(s == last_step && config_.last_save_model_only);
  if (!full_save_ahead) return;
  std::vector<protocols::TensorPiece> items;
  for (const auto& [name, part] : parts) {
    protocols::SavedState saved = part->state_dict(protocols::SaveOptions{});
    for (auto& piece : saved.tensors) items.push_back(std::move(piece));
  }
  staging_thread_ = std::thread([this, shapes = shapes_of(items)] {
    try {
      const double start = now_seconds();
      HostStaging(&host_arena_, &host_buffers_, config_.async_mode == "async_with_pinned_mem" ? &pinned_buffers_ : nullptr)
          .prepare(shapes, /*touch=*/true);
      double bytes = 0;
      for (const auto& p : shapes) bytes += static_cast<double>(bytes_of(p));
      log::info(strprintf("Asynchronous checkpoints: %.1f MB of staging memory for the first save made in %.2f s in the background",
                          bytes / 1e6, now_seconds() - start));
    } catch (const std::exception& e) {
      // The save makes its buffers itself then.
      log::warn("could not prepare the asynchronous checkpoint's staging memory ahead of the first save: ", e.what());
    }
  });
}

void Checkpointer::wait() {
  if (purge_thread_.joinable()) purge_thread_.join();
  if (background_.joinable()) background_.join();
  std::string message;
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    message.swap(background_error_);
  }
  if (!message.empty())
    fail("asynchronous checkpoint failed: ", message,
         message.find("untouched") == std::string::npos ? " (the previous complete checkpoint is untouched)" : "");
}

std::string Checkpointer::background_failure() {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return background_error_;
}

void Checkpointer::abandon_background() { abandon_ = true; }

std::optional<int64_t> Checkpointer::latest_complete_step(const std::string& root) {
  std::optional<int64_t> best;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return best;
  for (const auto& e : fs::directory_iterator(root)) {
    auto step = step_of(e.path());
    const bool complete = fs::exists(e.path() / "metadata.json") || torch_dcp::is_checkpoint(e.path().string());
    if (step && complete && (!best || *step > *best)) best = step;
  }
  return best;
}

std::optional<std::string> Checkpointer::resume_directory(const config::Checkpoint& config, const std::string& dump_folder) {
  const fs::path root = fs::path(dump_folder) / config.folder;
  const std::optional<int64_t> step = config.load_step >= 0 ? std::optional<int64_t>(config.load_step) : latest_complete_step(root.string());
  if (!step) return std::nullopt;
  const fs::path dir = root / ("step-" + std::to_string(*step));
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;  // load() names a missing load_step
  return dir.string();
}

bool Checkpointer::should_save(int64_t step, bool last) const {
  return last || step % config_.interval == 0 || (step == 1 && config_.enable_first_step_checkpoint);
}

void Checkpointer::purge(int64_t newest_step) {
  if (config_.keep_latest_k <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> complete;
  for (const auto& e : fs::directory_iterator(root_)) {
    auto step = step_of(e.path());
    if (step && *step <= newest_step && fs::exists(e.path() / "metadata.json")) complete.emplace_back(*step, e.path());
  }
  std::sort(complete.rbegin(), complete.rend());
  for (size_t i = static_cast<size_t>(config_.keep_latest_k); i < complete.size(); ++i) {
    // Renamed first (atomic), so a purge interrupted half-way leaves step-N.partial, which the next start removes
    // as titan's own leftover.
    std::error_code ec;
    const fs::path doomed = complete[i].second.string() + ".partial";
    fs::rename(complete[i].second, doomed, ec);
    if (ec) continue;
    fs::remove_all(doomed, ec);
  }
}

namespace {

// The metadata document: the files and pieces every rank wrote, the parts' global fields (rank 0's), their gathered
// fields united over the ranks, and unless model-only every rank's own fields.
json metadata_for(std::vector<json> parts, const json& global) {
  json ranks = json::array();
  for (auto& part : parts) ranks.push_back(part["rank_state"]);
  json metadata = merge_rank_parts(parts);
  for (const auto& [k, v] : global.items()) metadata[k] = v;
  for (const auto& part : parts) metadata.merge_patch(part["gathered"]);
  if (!global.value("model_only", false)) metadata["ranks"] = ranks;
  return metadata;
}

// Adds `fields` to `into`; two parts writing the same metadata field is a programming error.
void add_fields(json& into, const json& fields, const std::string& part) {
  for (const auto& [k, v] : fields.items()) {
    if (into.contains(k)) fail("internal: checkpoint part ", quote(part), " writes metadata field ", quote(k), ", which another part writes");
    into[k] = v;
  }
}

// A titan checkpoint directory as the parts read it.
class TitanSource : public protocols::StateSource {
 public:
  TitanSource(Reader& reader, bool model_only, int rank, int world_size) : reader_(reader), model_only_(model_only) {
    const json& meta = reader.metadata();
    if (meta.contains("ranks") && meta["ranks"].is_array()) ranks_ = meta["ranks"];
    if (static_cast<int>(ranks_.size()) == world_size) own_ = &ranks_[static_cast<size_t>(rank)];
  }
  std::string name() const override { return "checkpoint " + reader_.directory(); }
  std::vector<std::string> keys() const override {
    std::vector<std::string> keys;
    for (const auto& [key, entry] : reader_.tensors()) keys.push_back(key);
    return keys;
  }
  std::optional<Entry> entry(const std::string& key) const override {
    if (!reader_.contains(key)) return std::nullopt;
    const auto& e = reader_.tensors().at(key);
    return Entry{e.shape, e.dtype};
  }
  void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) override {
    reader_.read_box(key, offsets, std::move(out));
  }
  const json& metadata() const override { return reader_.metadata(); }
  const json& ranks() const override { return ranks_; }
  const json* own_rank() const override { return own_; }
  bool exact_dtypes() const override { return !model_only_; }

 private:
  Reader& reader_;
  bool model_only_;
  json ranks_ = json::array();
  const json* own_ = nullptr;
};

// A Hugging Face directory: the model's weights only.
class HfSource : public protocols::StateSource {
 public:
  HfSource(const std::string& directory, const HfModel& hf)
      : directory_(directory), reader_(directory, hf.args, hf.adapter) {
    for (const auto& p : hf.args.parameter_shapes()) shapes_["model." + p.name] = {p.name, p.shape};
    for (const auto& b : hf.args.buffer_shapes())  // DeepSeek-V3's balancing biases where the files hold them
      if (reader_.contains(b.name)) shapes_["model." + b.name] = {b.name, b.shape};
  }
  std::string name() const override { return "Hugging Face directory " + directory_; }
  std::string key_name(const std::string& key) const override {
    auto it = shapes_.find(key);
    return it == shapes_.end() ? key : it->second.first;
  }
  std::vector<std::string> keys() const override {
    std::vector<std::string> keys;
    for (const auto& [key, shape] : shapes_) keys.push_back(key);
    return keys;
  }
  std::optional<Entry> entry(const std::string& key) const override {
    auto it = shapes_.find(key);
    if (it == shapes_.end()) return std::nullopt;
    return Entry{it->second.second, reader_.dtype(it->second.first)};
  }
  void read_box(const std::string& key, const std::vector<int64_t>& offsets, at::Tensor out) override {
    reader_.read_box(shapes_.at(key).first, offsets, out);
  }
  const json& metadata() const override { return empty_; }
  const json& ranks() const override { return no_ranks_; }

 private:
  std::string directory_;
  HfReader reader_;
  std::map<std::string, std::pair<std::string, std::vector<int64_t>>> shapes_;  // titan key -> (name, shape)
  json empty_ = json::object(), no_ranks_ = json::array();
};

uint64_t directory_bytes(const fs::path& dir) {
  uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir)) bytes += fs::file_size(e.path());
  return bytes;
}

}  // namespace

void Checkpointer::save(const protocols::StatefulParts& parts, const HfModel& hf, int64_t step, bool last) {
  const double start = now_seconds();
  auto world = mesh_.world();
  const int rank = world->rank(), world_size = world->size();
  const bool model_only = last && config_.last_save_model_only;
  const bool hf_export = model_only && config_.last_save_in_hf;
  const bool async = config_.async_mode != "disabled" && !hf_export;  // the export reads the committed checkpoint
  const fs::path final_dir = fs::path(root_) / ("step-" + std::to_string(step));
  const fs::path partial_dir = fs::path(root_) / ("step-" + std::to_string(step) + ".partial");
  wait();  // the previous background write (and purge) must finish before a new save starts
  if (fs::exists(final_dir / "metadata.json")) {
    log::warn("checkpoint ", final_dir.string(), " already exists; it is kept, not overwritten");
    return;
  }
  if (std::error_code ec; fs::exists(final_dir, ec) && !fs::is_empty(final_dir, ec)) {
    // Not titan's (a run's last save exported in place for Hugging Face, checkpoint.last_save_in_hf, or another
    // tool's files): kept too. The commit's rename could not replace a non-empty folder anyway.
    log::warn("checkpoint folder ", final_dir.string(), " already exists and is not a titan checkpoint (a Hugging Face export "
              "such as checkpoint.last_save_in_hf writes, or other files); it is kept, and step ", step, "'s checkpoint is not written");
    return;
  }
  {
    std::error_code ec;
    if (!async) {
      if (rank == 0) fs::remove_all(partial_dir, ec);
      world->barrier();  // nobody creates the folder before rank 0 cleared a stale one
    }
    fs::create_directories(partial_dir, ec);
    if (ec) fail("cannot create checkpoint folder ", quote(partial_dir.string()), ": ", ec.message(),
                 " (checkpoint.folder = ", quote(config_.folder), " under job.dump_folder)");
  }

  // What this rank writes: each part's pieces (a replicated piece is written by one rank only), copied to host
  // memory in async mode so that training can change the originals while the copy is written.
  protocols::SaveOptions options;
  options.model_only = model_only;
  if (model_only) options.weights_dtype = export_dtype(config_.export_dtype);
  std::vector<protocols::TensorPiece> items;
  json global = metadata_header(step, model_only, world_size, ""), global_fields = json::object();
  json rank_state = {{"rank", rank}}, gathered = json::object();
  for (const auto& [name, part] : parts) {
    if (model_only && name != "model") continue;
    protocols::SavedState saved = part->state_dict(options);
    for (auto& piece : saved.tensors) items.push_back(std::move(piece));
    add_fields(global_fields, saved.global, name);
    add_fields(gathered, saved.gathered, name);
    add_fields(rank_state, saved.rank, name);
  }
  if (async) {
    if (staging_thread_.joinable()) staging_thread_.join();  // the buffers made ahead (prepare_staging)
    HostStaging staging(&host_arena_, &host_buffers_, config_.async_mode == "async_with_pinned_mem" ? &pinned_buffers_ : nullptr);
    staging.stage(items);
    staging.finish();  // the copies to host memory are complete before training changes the originals
  }
  for (const auto& [k, v] : global_fields.items()) global[k] = v;
  const std::string what = cat(final_dir.string(), model_only ? cat(" (model only, ", config_.export_dtype, ")") : std::string());

  if (!async) {
    RankWriter writer(partial_dir.string(), rank);
    for (const auto& item : items) writer.add(item.key, item.tensor, item.offsets, item.shape);
    json part = writer.finish();
    part["rank_state"] = rank_state;
    part["gathered"] = gathered;
    auto parts_text = distributed::all_gather_strings(*world, part.dump());
    if (rank == 0) {
      std::vector<json> parts;
      for (const auto& t : parts_text) parts.push_back(json::parse(t));
      commit(partial_dir.string(), final_dir.string(), metadata_for(std::move(parts), global));
    }
    if (hf_export) {
      // Rank 0 converts; every rank learns whether it worked, so none waits for a rank that failed.
      std::string error;
      if (rank == 0) {
        try {
          export_hf_in_place(hf, final_dir.string());
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      const std::string outcome = distributed::all_gather_strings(*world, error).front();
      if (!outcome.empty())
        fail("the last checkpoint ", final_dir.string(), " could not be written as a Hugging Face model (checkpoint.last_save_in_hf): ",
             outcome, rank == 0 ? "" : " (on rank 0)");
    }
    world->barrier();
    const double seconds = now_seconds() - start;
    if (rank == 0) {
      const uint64_t bytes = directory_bytes(final_dir);
      purge_thread_ = std::thread([this, step] { purge(step); });
      log::info("Saved checkpoint ", what, strprintf(": %.1f MB in %.2f s (%.0f MB/s)", bytes / 1e6, seconds,
                                                     bytes / 1e6 / std::max(seconds, 1e-9)));
    } else {
      log::info("Saved checkpoint ", what);
    }
    return;
  }

  // Async: every rank writes its file and then its part of the metadata as rank-R.json (the rank's commit); rank 0
  // waits for all parts, commits and purges. No collective runs in the background, so training's collectives
  // cannot interleave with the checkpoint's.
  const double blocked = now_seconds() - start;
  log::info(strprintf("Checkpoint step %lld: state copied to host memory, training blocked %.3f s; writing in the background",
                      static_cast<long long>(step), blocked));
  const double timeout = background_timeout_seconds_;
  background_ = std::thread([this, items = std::move(items), rank_state, gathered, global, partial_dir, final_dir, rank, world_size,
                             step, what, start, timeout]() mutable {
    try {
      RankWriter writer(partial_dir.string(), rank);
      for (const auto& item : items) writer.add(item.key, item.tensor, item.offsets, item.shape);
      items.clear();
      json part = writer.finish();
      part["rank_state"] = rank_state;
      part["gathered"] = gathered;
      const fs::path part_path = partial_dir / strprintf("rank-%05d.json", rank);
      write_file(part_path.string(), part.dump(), /*durable=*/true);
      if (rank != 0) return;
      std::vector<json> parts(static_cast<size_t>(world_size));
      for (int r = 0; r < world_size; ++r) {
        const fs::path p = partial_dir / strprintf("rank-%05d.json", r);
        while (!fs::exists(p)) {
          if (abandon_) fail("rank ", r, " did not finish writing checkpoint ", final_dir.string(), " (the job is stopping); it stays incomplete");
          if (now_seconds() - start > timeout)
            fail("rank ", r, " did not finish writing checkpoint ", final_dir.string(), "; it stays incomplete");
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        std::ifstream in(p);
        parts[r] = json::parse(in);
      }
      for (int r = 0; r < world_size; ++r) fs::remove(partial_dir / strprintf("rank-%05d.json", r));
      commit(partial_dir.string(), final_dir.string(), metadata_for(std::move(parts), global));
      const double seconds = now_seconds() - start;
      const uint64_t bytes = directory_bytes(final_dir);
      log::info("Saved checkpoint ", what, strprintf(": %.1f MB in %.2f s (%.0f MB/s) in the background", bytes / 1e6,
                                                     seconds, bytes / 1e6 / std::max(seconds, 1e-9)));
      purge(step);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      background_error_ = e.what();
    }
  });
}

bool Checkpointer::load(const protocols::StatefulParts& parts, const HfModel& hf) {
  auto world = mesh_.world();
  if (world->rank() == 0 && fs::is_directory(root_)) {
    std::vector<fs::path> entries;
    for (const auto& e : fs::directory_iterator(root_)) entries.push_back(e.path());
    for (const auto& path : entries) {
      const std::string name = path.filename().string();
      std::error_code ec;
      if (ends_with(name, ".partial")) {
        // titan writes every save as step-N.partial and renames it when complete: this one did not finish.
        log::warn("removing incomplete checkpoint ", path.string(), " (a save that did not finish)");
        fs::remove_all(path, ec);
      } else if (step_of(path) && !fs::exists(path / "metadata.json") && !torch_dcp::is_checkpoint(path.string()) &&
                 !fs::exists(path / "config.json")) {  // config.json: a last_save_in_hf export, kept
        // Not something titan left (its saves become step-N only once complete): keep it, out of the way.
        fs::path aside = path.string() + ".quarantined";
        for (int k = 2; fs::exists(aside); ++k) aside = path.string() + ".quarantined" + std::to_string(k);
        fs::rename(path, aside, ec);
        if (ec) fail("checkpoint folder ", path.string(), " has no metadata.json (titan did not write it) and cannot be moved aside: ",
                     ec.message(), "; move or remove it");
        log::warn("checkpoint folder ", path.string(), " has no metadata.json and was not written by titan; moved to ",
                  aside.string(), " (nothing was deleted)");
      }
    }
  }
  world->barrier();
  std::optional<int64_t> step;
  if (config_.load_step >= 0) {
    step = config_.load_step;
    const fs::path dir = fs::path(root_) / ("step-" + std::to_string(*step));
    if (!fs::exists(dir / "metadata.json") && !torch_dcp::is_checkpoint(dir.string()))
      fail("checkpoint.load_step = ", *step, ": no complete checkpoint ", (fs::path(root_) / ("step-" + std::to_string(*step))).string());
  } else {
    step = latest_complete_step(root_);
  }
  if (!step) {
    if (config_.initial_load_path) {
      const std::string& path = *config_.initial_load_path;
      if (config_.initial_load_in_hf) {
        load_hf_weights(parts, hf, path);
        return true;
      }
      if (torch_dcp::is_checkpoint(path)) return load_torch_dcp(parts, path, config_.initial_load_model_only);
      return load_directory(parts, path, config_.initial_load_model_only);
    }
    log::info("No checkpoint in ", root_, "; training starts from scratch");
    return false;
  }
  const std::string directory = (fs::path(root_) / ("step-" + std::to_string(*step))).string();
  if (!fs::exists(fs::path(directory) / "metadata.json")) {  // torchtitan's
    if (!torch_dcp::has_training_state(directory))
      fail("checkpoint ", directory, " is torchtitan's model-only save (no optimizer or train state): a run cannot resume "
           "from it, and would start over from step 1 at every restart. Set checkpoint.initial_load_path to it to start "
           "from its weights, and move it out of checkpoint.folder");
    return load_torch_dcp(parts, directory, false);
  }
  if (config_.load_step < 0 && *step > 0 && Reader(directory).metadata().value("model_only", false)) {
    // The final save of a finished run (last_save_model_only): resuming from it would start over at step 1, and the
    // new run's checkpoints would sort below it, so every restart would load it again.
    std::optional<int64_t> full;
    for (const auto& e : fs::directory_iterator(root_)) {
      const std::string name = e.path().filename().string();
      if (!name.starts_with("step-") || !fs::exists(e.path() / "metadata.json")) continue;
      try {
        const int64_t s = std::stoll(name.substr(5));
        if (s < *step && (!full || s > *full) && !Reader(e.path().string()).metadata().value("model_only", false)) full = s;
      } catch (const std::exception&) {
      }
    }
    fail("checkpoint ", directory, " is a model-only save (the last save of a finished run, checkpoint.last_save_model_only): "
         "a run cannot resume from it, and would start over from step 1 at every restart. To train on from its weights, "
         "use a new checkpoint.folder with checkpoint.initial_load_path = ", quote(directory),
         full ? cat("; to continue the run itself, set checkpoint.load_step = ", *full, " (its newest full checkpoint) and raise "
                    "training.steps")
              : std::string(),
         "; keep checkpoint.last_save_model_only = false for runs that will be extended");
  }
  return load_directory(parts, directory, false);
}

void Checkpointer::export_hf_in_place(const HfModel& hf, const std::string& directory) {
  const double start = now_seconds();
  Reader reader(directory);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::ScalarType dtype = at::kFloat;
  for (const auto& p : hf.args.parameter_shapes()) {
    const auto& entry = reader.tensors().at("model." + p.name);
    at::Tensor full = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
    reader.read_box("model." + p.name, std::vector<int64_t>(entry.shape.size(), 0), full);
    dtype = entry.dtype;
    tensors.emplace_back(p.name, full);
  }
  // The MoE balancing biases too, as titan convert exports them: DeepSeek-V3's format holds them
  // (e_score_correction_bias); where a format has no place for them save_hf warns that it leaves them out.
  for (const auto& b : hf.args.buffer_shapes()) {
    const auto it = reader.tensors().find("model." + b.name);
    if (it == reader.tensors().end()) continue;
    at::Tensor full = at::empty(it->second.shape, at::TensorOptions().dtype(it->second.dtype));
    reader.read_box("model." + b.name, std::vector<int64_t>(it->second.shape.size(), 0), full);
    tensors.emplace_back(b.name, full);
  }
  const std::string partial = directory + ".hf.partial", aside = directory + ".model-only";
  fs::remove_all(partial);
  save_hf(partial, hf.args, hf.adapter, tensors, dtype, int64_t{5} * 1000 * 1000 * 1000, hf.tokenizer);
  for (const auto& e : fs::directory_iterator(partial)) fsync_path(e.path().string(), false);
  // torchtitan's last_save_in_hf layout: the export takes step-N's place. The titan copy moves aside first and goes
  // last, so a crash in between leaves the weights in step-N.model-only (a complete titan checkpoint).
  fs::remove_all(aside);
  fs::rename(directory, aside);
  fs::rename(partial, directory);
  fsync_path(fs::path(directory).parent_path().string(), true);
  fs::remove_all(aside);
  log::info(strprintf("Saved the last checkpoint as a Hugging Face model (checkpoint.last_save_in_hf): %s in %.2f s",
                      directory.c_str(), now_seconds() - start));
}

void Checkpointer::load_parts(const protocols::StatefulParts& parts, protocols::StateSource& source, bool weights_only) {
  const auto& excluded = config_.exclude_from_loading;
  for (const auto& [name, part] : parts) {
    if (weights_only && name != "model") continue;
    if (std::find(excluded.begin(), excluded.end(), name) != excluded.end()) continue;  // keeps its state
    part->load_state_dict(source);
  }
}

void Checkpointer::load_hf_weights(const protocols::StatefulParts& parts, const HfModel& hf, const std::string& directory) {
  const double start = now_seconds();
  HfSource source(directory, hf);  // checks config.json against the model and every weight's shape
  load_parts(parts, source, /*weights_only=*/true);  // each rank reads only the rows its pieces need
  log::info(strprintf("Loaded Hugging Face weights from %s in %.2f s (checkpoint.initial_load_in_hf); training starts at step 1",
                      directory.c_str(), now_seconds() - start));
}

bool Checkpointer::load_directory(const protocols::StatefulParts& parts, const std::string& directory, bool weights_only) {
  const double start = now_seconds();
  Reader reader(directory);
  const json& meta = reader.metadata();
  check_metadata(meta, directory + "/metadata.json", directory, weights_only);
  const bool model_only = weights_only || meta.value("model_only", false);
  auto world = mesh_.world();
  TitanSource source(reader, model_only, world->rank(), world->size());
  load_parts(parts, source, model_only);
  if (model_only) {
    log::info("Loaded model weights from ", reader.directory(), " (model only: training starts at step 1)");
    return true;
  }
  log::info(strprintf("Loaded checkpoint %s (step %lld, saved by %d rank(s)) in %.2f s", reader.directory().c_str(),
                      static_cast<long long>(meta.value("step", 0)), meta.value("world_size", 0), now_seconds() - start));
  return true;
}

bool Checkpointer::load_torch_dcp(const protocols::StatefulParts& parts, const std::string& directory, bool weights_only) {
  const double start = now_seconds();
  TorchDcpSource source(directory, weights_only);
  const bool model_only = weights_only || !source.step();
  load_parts(parts, source, model_only);
  if (model_only) {
    log::info("Loaded model weights from torch DCP checkpoint ", directory,
              source.step() ? " (model only: training starts at step 1)"
                            : " (it holds model weights only, as torchtitan's last save: training starts at step 1)",
              strprintf(" in %.2f s", now_seconds() - start));
    return true;
  }
  log::info(strprintf("Loaded torch DCP checkpoint %s (step %lld: model, optimizer, LR schedule) in %.2f s", directory.c_str(),
                      static_cast<long long>(*source.step()), now_seconds() - start));
  return true;
}

}  // namespace titan::checkpoint
