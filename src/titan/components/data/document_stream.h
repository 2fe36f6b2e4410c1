// DocumentStream: the global, deterministic sequence of documents of a dataset mixture. Each source visits its
// shards (optionally in a seeded order per epoch) and serves rows in blocks, each block in a seeded random order;
// the source of document g is a seeded weighted draw keyed by g. Its state is small (positions, not contents) and
// restoring it reproduces the rest of the sequence exactly. The semantics are spelled out in docs/data.md.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "titan/components/data/source.h"

namespace titan::data {

struct SourceState {
  int64_t epoch = 0;
  std::vector<uint32_t> order;  // shards not finished in this epoch, current first
  ShardPosition block_start;    // start of the current block in shard order[0]
  uint64_t block_seed = 0;      // seed the current block was shuffled with
  uint64_t block_pos = 0;       // rows of the current block already served
  uint64_t epoch_rows = 0;      // rows served in this epoch
  uint64_t rows_served = 0;     // rows served in all epochs
  bool exhausted = false;       // loop = false and every shard served
};

struct StreamState {
  uint64_t doc = 0;                                      // index of the next document
  std::vector<std::pair<uint64_t, uint64_t>> seeds;      // (first document, seed), ascending
  // (first document, each source's weight), ascending; a state saved before 2026-11-30 has none (the configured
  // weights then apply throughout).
  std::vector<std::pair<uint64_t, std::vector<double>>> weights;
  std::vector<SourceState> sources;
};

void to_json(nlohmann::json& j, const StreamState& s);
// Checks the state against the configured sources (count, names, shard counts) and throws UserError otherwise.
StreamState stream_state_from_json(const nlohmann::json& j, const std::vector<SourceSpec>& sources);

struct StreamOptions {
  uint64_t seed = 0;
  int64_t shuffle_buffer = 0;  // rows per shuffled block; <= 1 keeps file order
  bool shuffle_shards = false;
};

struct Document {
  uint64_t index = 0;
  uint32_t source = 0;
  RawRow row;
};

class DocumentStream {
 public:
  DocumentStream(const std::vector<SourceSpec>& sources, StreamOptions options);
  ~DocumentStream();
  DocumentStream(DocumentStream&&) noexcept;
  DocumentStream& operator=(DocumentStream&&) noexcept;

  // The next document; false when every source is exhausted (only possible with loop = false everywhere).
  bool next(Document& doc);
  // Advances past the next document without copying it.
  bool skip();
  // The position before the next document.
  const StreamState& state() const { return state_; }
  uint64_t position() const { return state_.doc; }
  void restore(const StreamState& state);
  // From document `from` on, draws use `seed` (a restart with a new training.data_seed).
  void add_seed(uint64_t from, uint64_t seed);
  // From document `from` on, draws use the configured weights (a restart with new mixture weights): a document
  // already begun was drawn with the old ones and is finished from its own source.
  void add_configured_weights(uint64_t from);
  const std::vector<SourceSpec>& sources() const { return *sources_; }

 private:
  struct Reader;
  bool advance(Document* doc);
  const RawRow* next_row(uint32_t source);
  bool load_block(uint32_t source, bool fresh);
  uint64_t seed_at(uint64_t doc) const;
  const std::vector<double>& weights_at(uint64_t doc) const;
  std::vector<double> configured_weights() const;
  void apply_seed_switch(uint64_t seed);
  const std::vector<SourceSpec>* sources_;
  StreamOptions options_;
  StreamState state_;
  std::vector<std::unique_ptr<Reader>> readers_;
};

}  // namespace titan::data
