// Weights & Biases runs written without the W&B SDK, in its offline-run layout: {dir}/wandb/offline-run-<time>-<id>/
// run-<id>.wandb, which `wandb sync` uploads later (how W&B is used on compute nodes without internet access).
//
// The file is W&B's record log: a 7-byte header (":W&B", 0xBEE1 little-endian, version 0), then LevelDB's log framing
// (32 KiB blocks; each fragment has the CRC-32 of its type byte and data, its length and its type: whole, first,
// middle or last) around hand-encoded wandb_internal.Record protobufs: a header record, the run record (id, project,
// entity, name, group, job type, notes, tags, host, start time and the job config, one item per top-level section),
// one history record per logged step followed by a summary record of the same values, and an exit record with the
// process's exit code when the run ends. Each record reaches the file (fflush) when written, so a run killed mid-way
// still uploads everything up to its last complete step.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace titan::metrics {

struct WandbRunOptions {
  std::string id;       // empty: 8 random characters [a-z0-9]
  std::string project = "titan";
  std::string entity;   // empty: the account's default entity, chosen by `wandb sync`
  std::string name;     // display name; empty: W&B's generated one
  std::string group, job_type, notes;
  std::vector<std::string> tags;
  bool resume = false;  // the run record's resume flag: `wandb sync` continues a run of the same id on W&B
};

// The options torchtitan's W&B logger takes from the environment: WANDB_RUN_ID, WANDB_PROJECT, WANDB_TEAM (entity),
// WANDB_RUN_NAME, WANDB_RUN_GROUP, WANDB_RUN_JOB_TYPE, WANDB_RUN_NOTES, WANDB_RUN_TAGS (comma-separated), each but the
// first two falling back to the SDK's own name (WANDB_ENTITY, WANDB_NAME, WANDB_JOB_TYPE, WANDB_NOTES, WANDB_TAGS) as
// the SDK does under torchtitan. `resume` is set when WANDB_RUN_ID is (a restarted job continues its run), unless
// WANDB_RESUME = never; any other WANDB_RESUME value sets it too. Throws a UserError naming the variable for a run id
// W&B would refuse, and for WANDB_RESUME_FROM / WANDB_FORK_FROM (rewinding and forking are operations of W&B's
// server, not of an offline run).
WandbRunOptions wandb_options_from_environment();

// Whether WANDB_MODE=disabled or WANDB_DISABLED=true switches W&B logging off (as they do for the W&B SDK).
bool wandb_disabled_by_environment();

class WandbOfflineRun {
 public:
  // The run {directory}/wandb/offline-run-YYYYmmdd_HHMMSS-<id>/run-<id>.wandb, created with its header and run records
  // when its first step or its end is written (a job that fails while starting leaves none); `config_json` is a JSON
  // object whose top-level members become the run's config.
  WandbOfflineRun(const std::string& directory, WandbRunOptions options, const std::string& config_json);
  // Without finish(): writes the pending step and an exit record with code 1 if an exception is unwinding, 0 if not
  // (nothing if the run was never written).
  ~WandbOfflineRun();
  WandbOfflineRun(const WandbOfflineRun&) = delete;
  WandbOfflineRun& operator=(const WandbOfflineRun&) = delete;

  // Values logged for the same step (training, then validation) form one history row, written by end_step(), when a
  // later step is logged, or when the run finishes; steps must not decrease. Non-finite values are written as NaN /
  // Infinity.
  void log(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  // Writes the row of the step logged last (nothing if it is written already).
  void end_step();
  // Writes the pending step and the exit record; the run is closed afterwards.
  void finish(int exit_code);

  const std::string& run_directory() const { return run_directory_; }
  const std::string& path() const { return path_; }
  const std::string& id() const { return options_.id; }

 private:
  std::string record_info() const;
  void open();
  void write_record(int field, const std::string& message);
  void write_bytes(const std::string& bytes);  // a write error closes the file, then throws
  void close_file();

  WandbRunOptions options_;
  std::string config_json_;
  bool opened_ = false, finished_ = false;
  std::string run_directory_, path_;
  std::FILE* file_ = nullptr;
  uint64_t offset_ = 0;  // bytes in the file, for the 32 KiB blocks
  int64_t record_number_ = 0;
  double start_time_ = 0;
  bool has_pending_ = false;
  int64_t pending_step_ = 0;
  double pending_time_ = 0;
  std::vector<std::pair<std::string, double>> pending_;
};

}  // namespace titan::metrics
