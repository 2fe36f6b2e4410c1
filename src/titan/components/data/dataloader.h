// DataLoader: packs a DocumentStream into fixed-size windows for one data-parallel rank, in the background, with a
// small state that resumes exactly -- also under a different number of ranks. See docs/data.md for the semantics.
//
// The global document stream is dealt round-robin to L "lanes" (document g to lane g mod L); each lane packs its
// documents (BOS + tokens + EOS) into seq_len + 1 windows. Global window w is window w / L of lane w mod L. Rank r
// of N owns the lanes l with l mod N == r and always serves its lane whose next window comes first globally, so
// after every step the windows consumed by all ranks together are a prefix of the global window stream: the
// same stream for every N that divides L.
#pragma once
#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "titan/components/data/document_stream.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"

namespace titan::data {

struct Batch {
  at::Tensor inputs;     // int64 (batch, seq_len)
  at::Tensor labels;     // int64 (batch, seq_len)
  at::Tensor positions;  // int64 (batch, seq_len): each input token's index in its document; empty unless asked
};

// Every source ran out (all of them have loop = false).
class DataExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct LoaderOptions {
  int64_t seq_len = 2048;
  int64_t batch_size = 1;   // windows per next() on this rank
  int64_t dp_rank = 0, dp_degree = 1;
  int64_t lanes = -1;       // -1: dp_degree, or on load the saved lane count when dp_degree divides it
  StreamOptions stream;
  bool skip_malformed_rows = false;
  int64_t prefetch_batches = 0;  // 0: produce in next() on the calling thread
  bool positions = false;
  std::string name = "training";
  // One pass to the end (validation's full pass): a lane whose sources are exhausted gives way to this rank's
  // other lanes, rows none can fill are padding (token 0, label kIgnoreIndex: no loss, no valid token), and next()
  // throws DataExhausted only when every lane of this rank is exhausted.
  bool drain = false;
  // Whether the lanes are checked against the sources' documents (check_documents_per_lane) when they are made.
  bool check_documents_per_lane = true;
};

// Fails (naming `name`'s data, the file and the remedy) when whole-file text sources hold fewer documents than
// `lanes`: lanes l and l + D of D documents would serve the same windows.
void check_documents_per_lane(const std::vector<SourceSpec>& sources, int64_t lanes, const std::string& name);

// Consumption recorded by an earlier lane layout, so a re-layout neither repeats nor skips documents.
struct Layer {
  uint32_t lanes = 0;
  std::vector<uint64_t> cursor;  // per old lane: documents of that lane before this index were consumed
  std::vector<uint64_t> offset;  // tokens of document `cursor` already consumed (when it belongs to the lane)
  uint64_t end = 0;              // no document from here on is affected
};

struct LaneState {
  uint32_t id = 0;
  StreamState stream;   // before the lane's current document (or the next one when none is open)
  uint64_t offset = 0;  // tokens of the current document already packed
  uint64_t windows = 0;
  std::vector<Layer> layers;
};


// The training loader's options from a job config (training.* keys, model.attn_mask_type).
LoaderOptions training_loader_options(const config::JobConfig& config, int64_t dp_rank, int64_t dp_degree);

class DataLoader {
 public:
  DataLoader(std::vector<SourceSpec> sources, const tokenizer::Tokenizer* tokenizer, LoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  Batch next();
  // The state after the last batch next() returned (JSON text, a few KB).
  std::string state_dict() const;
  // The states that all ranks of the saved run returned, in any order. Same lane count (when this run's rank count
  // divides it): the batch stream continues exactly. Otherwise the documents are re-dealt from the earliest
  // unconsumed one, skipping what any old lane consumed and finishing its partly packed document. A changed
  // stream seed takes effect after the last document any old lane had reached.
  void load_state_dict(const std::vector<std::string>& rank_states);
  // The position state_dict() reports (after the last batch handed out), and a way to report an earlier one again:
  // a run that fetched the next step's batches and then stops without training on them saves the position before
  // them. The stream does not go back, so next() refuses to run after rewind_reported_position().
  std::vector<LaneState> reported_position() const { return served_state_; }
  void rewind_reported_position(std::vector<LaneState> position);

  int64_t lanes() const { return lane_count_; }
  double wait_seconds() const { return wait_seconds_; }
  uint64_t malformed_rows_skipped() const { return malformed_->load(); }
  const std::vector<SourceSpec>& sources() const { return sources_; }

 private:
  class Lane;
  Batch produce(std::vector<LaneState>& snapshot);
  void build_lanes(int64_t lane_count);
  void stop_worker();
  void worker_loop();

  std::vector<SourceSpec> sources_;
  const tokenizer::Tokenizer* tokenizer_;
  LoaderOptions options_;
  int64_t lane_count_ = 1;
  std::vector<std::unique_ptr<Lane>> lanes_;  // this rank's lanes
  std::set<uint32_t> exhausted_;              // ids of lanes with nothing left (drain)
  std::vector<LaneState> served_state_;       // after the last batch handed out
  bool rewound_ = false;                      // rewind_reported_position() was called
  std::shared_ptr<std::atomic<uint64_t>> malformed_;
  double wait_seconds_ = 0;

  struct Item {
    Batch batch;
    std::vector<LaneState> state;
  };
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::exception_ptr worker_error_;
  bool stop_ = false;
};

}  // namespace titan::data
