#include "titan/components/metrics/wandb.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "titan/common/checksum.h"
#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/metrics/protobuf_wire.h"

namespace titan::metrics {

namespace {

namespace fs = std::filesystem;
using wire::length_delimited;
using wire::varint_field;

// LevelDB's log framing, as W&B's record files use it.
constexpr uint64_t kBlockSize = 32768;
constexpr uint64_t kFragmentHeader = 7;  // CRC-32 (4), length (2), type (1)
enum FragmentType : unsigned char { kFull = 1, kFirst = 2, kMiddle = 3, kLast = 4 };

// wandb_internal.Record's fields (wandb/proto/wandb_internal.proto).
enum RecordField { kNum = 1, kHistory = 2, kSummary = 3, kRun = 17, kExit = 18, kHeader = 21, kInfo = 200 };

double wall_time() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string random_id() {
  static const char alphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device device;
  std::uniform_int_distribution<int> pick(0, 35);
  std::string id;
  for (int i = 0; i < 8; ++i) id += alphabet[pick(device)];
  return id;
}

// A JSON number as W&B's SDK writes one: 17 significant digits (read back bitwise), and Python json's NaN / Infinity
// for non-finite values, which W&B accepts.
std::string json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == std::nearbyint(v) && std::fabs(v) < 9.0e15) return std::to_string(static_cast<long long>(v));
  return strprintf("%.17g", v);
}

// HistoryItem / SummaryItem / ConfigItem share their fields: key = 1, nested_key = 2 (repeated), value_json = 16.
// History and summary keys go as a one-element nested_key, as the offline files of wandb 0.31.0's SDK hold them:
// "loss_metrics/global_avg_loss" stays one flat name.
std::string item(const std::string& name, const std::string& value_json, bool nested = true) {
  std::string m;
  length_delimited(m, nested ? 2 : 1, name);
  length_delimited(m, 16, value_json);
  return m;
}

std::string timestamp(double seconds) {
  std::string m;
  const double whole = std::floor(seconds);
  varint_field(m, 1, static_cast<int64_t>(whole));
  varint_field(m, 2, static_cast<int64_t>((seconds - whole) * 1e9));
  return m;
}

bool valid_run_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (unsigned char c : id)
    if (!(std::isalnum(c) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

}  // namespace

WandbRunOptions wandb_options_from_environment() {
  for (const char* name : {"WANDB_RESUME_FROM", "WANDB_FORK_FROM"})
    if (!env(name).empty())
      fail(name, "=", quote(env(name)), ": rewinding or forking a W&B run happens on W&B's server; titan.cpp writes offline "
           "runs for `wandb sync` (metrics.enable_wandb), so unset it and rewind or fork the run on W&B after syncing");
  // torchtitan's variable first, then the W&B SDK's own (which the SDK reads when torchtitan passes None).
  const auto either = [](const char* torchtitan, const char* sdk) { return env(torchtitan).empty() ? env(sdk) : env(torchtitan); };
  WandbRunOptions o;
  o.id = env("WANDB_RUN_ID");
  if (!o.id.empty() && !valid_run_id(o.id))
    fail("WANDB_RUN_ID=", quote(o.id), ": a W&B run id is 1-128 letters, digits, '-', '_' or '.' (metrics.enable_wandb)");
  const std::string resume = env("WANDB_RESUME");
  o.resume = resume.empty() ? !o.id.empty() : resume != "never";
  if (!env("WANDB_PROJECT").empty()) o.project = env("WANDB_PROJECT");
  o.entity = either("WANDB_TEAM", "WANDB_ENTITY");
  o.name = either("WANDB_RUN_NAME", "WANDB_NAME");
  o.group = env("WANDB_RUN_GROUP");
  o.job_type = either("WANDB_RUN_JOB_TYPE", "WANDB_JOB_TYPE");
  o.notes = either("WANDB_RUN_NOTES", "WANDB_NOTES");
  for (const auto& tag : split(either("WANDB_RUN_TAGS", "WANDB_TAGS"), ',')) {
    const std::string t = trim(tag);
    if (!t.empty()) o.tags.push_back(t);
  }
  return o;
}

bool wandb_disabled_by_environment() {
  const std::string disabled = env("WANDB_DISABLED");
  return env("WANDB_MODE") == "disabled" || disabled == "true" || disabled == "1";
}

WandbOfflineRun::WandbOfflineRun(const std::string& directory, WandbRunOptions options, const std::string& config_json)
    : options_(std::move(options)), config_json_(config_json) {
  if (options_.id.empty()) options_.id = random_id();
  start_time_ = wall_time();
  // The SDK's folder name; a restart of the same id within the same second takes the next free second.
  for (std::time_t second = static_cast<std::time_t>(start_time_);; ++second) {
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%d_%H%M%S", std::localtime(&second));
    run_directory_ = (fs::path(directory) / "wandb" / cat("offline-run-", stamp, "-", options_.id)).string();
    std::error_code ec;
    if (!fs::exists(run_directory_, ec)) break;
  }
  path_ = (fs::path(run_directory_) / cat("run-", options_.id, ".wandb")).string();
}

void WandbOfflineRun::open() {
  if (opened_) return;
  opened_ = true;
  std::error_code ec;
  fs::create_directories(fs::path(run_directory_) / "files", ec);
  if (ec) fail("cannot create the W&B run folder ", quote(run_directory_), ": ", ec.message(), " (metrics.enable_wandb)");
  file_ = std::fopen(path_.c_str(), "wbx");  // a new run never overwrites another's records
  if (!file_) fail("cannot create the W&B run file ", quote(path_), ": ", std::strerror(errno), " (metrics.enable_wandb)");
  std::string ident = ":W&B";
  wire::fixed(ident, 0xBEE1, 2);
  ident.push_back('\0');
  write_bytes(ident);

  std::string version;
  length_delimited(version, 1, cat("titan.cpp ", TITAN_VERSION));  // producer
  std::string header;
  length_delimited(header, 1, version);
  write_record(kHeader, header);

  nlohmann::ordered_json config;
  try {
    config = nlohmann::ordered_json::parse(config_json_);
  } catch (const std::exception& e) {
    close_file();
    fail("the job config does not serialise to JSON for W&B: ", e.what());
  }
  std::string config_record;
  for (const auto& [section, value] : config.items()) length_delimited(config_record, 1, item(section, value.dump(), false));
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  std::string run;
  length_delimited(run, 1, options_.id);
  if (!options_.entity.empty()) length_delimited(run, 2, options_.entity);
  length_delimited(run, 3, options_.project);
  length_delimited(run, 4, config_record);
  if (!options_.group.empty()) length_delimited(run, 6, options_.group);
  if (!options_.job_type.empty()) length_delimited(run, 7, options_.job_type);
  if (!options_.name.empty()) length_delimited(run, 8, options_.name);
  if (!options_.notes.empty()) length_delimited(run, 9, options_.notes);
  for (const auto& tag : options_.tags) length_delimited(run, 10, tag);
  length_delimited(run, 13, host);
  length_delimited(run, 17, timestamp(start_time_));
  if (options_.resume) varint_field(run, 24, 1);  // resume: a run of this id may exist already (W&B appends to it)
  write_record(kRun, run);
}

WandbOfflineRun::~WandbOfflineRun() {
  // A run that never logged (its job failed while starting) leaves no file; one that did is closed with an exit code.
  if (!file_) return;
  try {
    finish(std::uncaught_exceptions() > 0 ? 1 : 0);
  } catch (const std::exception& e) {
    log::warn("W&B run file ", path_, " was not closed cleanly: ", e.what());
  }
  close_file();
}

void WandbOfflineRun::close_file() {
  if (file_) std::fclose(file_);
  file_ = nullptr;
}

void WandbOfflineRun::write_bytes(const std::string& bytes) {
  if (std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size() || std::fflush(file_) != 0) {
    const int error = errno;
    close_file();  // nothing more is appended at a block offset the file does not have
    fail("cannot write the W&B run file ", quote(path_), ": ", std::strerror(error), error == ENOSPC ? " (disk full)" : "");
  }
  offset_ += bytes.size();
}

std::string WandbOfflineRun::record_info() const {
  std::string info;
  length_delimited(info, 1, options_.id);  // _RecordInfo.stream_id
  return info;
}

void WandbOfflineRun::write_record(int field, const std::string& message) {
  std::string record;
  varint_field(record, kNum, ++record_number_);
  length_delimited(record, field, message);
  length_delimited(record, kInfo, record_info());
  // Fragments never cross a 32 KiB block; a block's last bytes too few for a fragment header are zeros.
  std::string out;
  size_t pos = 0;
  bool first = true;
  uint64_t offset = offset_;  // where `out` starts; offset_ moves once it is written
  do {
    uint64_t left = kBlockSize - offset % kBlockSize;
    if (left < kFragmentHeader) {
      out.append(left, '\0');
      offset += left;
      left = kBlockSize;
    }
    const size_t n = std::min<size_t>(left - kFragmentHeader, record.size() - pos);
    const bool last = pos + n == record.size();
    const unsigned char type = first && last ? kFull : first ? kFirst : last ? kLast : kMiddle;
    const uint32_t crc = crc32_update(crc32_update(0, &type, 1), record.data() + pos, n);
    wire::fixed(out, crc, 4);
    wire::fixed(out, n, 2);
    out.push_back(static_cast<char>(type));
    out.append(record, pos, n);
    offset += kFragmentHeader + n;
    pos += n;
    first = false;
  } while (pos < record.size());
  write_bytes(out);
}

void WandbOfflineRun::log(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  if (finished_) fail("the W&B run ", options_.id, " is finished; step ", step, " was logged after it");
  if (has_pending_ && step < pending_step_)
    fail("W&B history steps must not decrease: step ", step, " was logged after step ", pending_step_);
  if (has_pending_ && step != pending_step_) end_step();
  if (!has_pending_) {
    has_pending_ = true;
    pending_step_ = step;
  }
  pending_time_ = wall_time();
  for (const auto& [name, value] : scalars) {
    auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& p) { return p.first == name; });
    if (it != pending_.end())
      it->second = value;
    else
      pending_.emplace_back(name, value);
  }
}

void WandbOfflineRun::end_step() {
  if (!has_pending_) return;
  open();
  if (!file_) fail("the W&B run file ", quote(path_), " could not be written earlier; step ", pending_step_, " is not in it");
  // W&B's own keys: _step (the row's step), _timestamp (Unix seconds) and _runtime (seconds since the run started).
  std::vector<std::pair<std::string, std::string>> values = {{"_step", std::to_string(pending_step_)}};
  for (const auto& [name, value] : pending_) values.emplace_back(name, json_number(value));
  values.emplace_back("_timestamp", strprintf("%.17g", pending_time_));
  values.emplace_back("_runtime", strprintf("%.17g", pending_time_ - start_time_));
  std::string history, summary;
  for (const auto& [name, value] : values) {
    length_delimited(history, 1, item(name, value));
    length_delimited(summary, 1, item(name, value));
  }
  std::string step;
  varint_field(step, 1, pending_step_);
  length_delimited(history, 2, step);
  has_pending_ = false;
  pending_.clear();
  write_record(kHistory, history);
  write_record(kSummary, summary);
}

void WandbOfflineRun::finish(int exit_code) {
  if (finished_) return;
  finished_ = true;
  open();
  if (!file_) return;  // a write failed earlier, and said so
  end_step();
  std::string exit;
  varint_field(exit, 1, exit_code);
  varint_field(exit, 2, static_cast<int64_t>(wall_time() - start_time_));
  write_record(kExit, exit);
  close_file();
}

}  // namespace titan::metrics
