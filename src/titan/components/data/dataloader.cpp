#include "titan/components/data/dataloader.h"

#include <nlohmann/json.hpp>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/components/data/token_shard.h"
#include "titan/nn/loss.h"

namespace titan::data {

namespace {

nlohmann::json layer_json(const Layer& l) {
  return {{"lanes", l.lanes}, {"cursor", l.cursor}, {"offset", l.offset}, {"end", l.end}};
}

Layer layer_from_json(const nlohmann::json& j) {
  Layer l;
  l.lanes = j.at("lanes").get<uint32_t>();
  l.cursor = j.at("cursor").get<std::vector<uint64_t>>();
  l.offset = j.at("offset").get<std::vector<uint64_t>>();
  l.end = j.at("end").get<uint64_t>();
  if (l.lanes == 0 || l.cursor.size() != l.lanes || l.offset.size() != l.lanes) fail("malformed layer");
  return l;
}

}  // namespace

LoaderOptions training_loader_options(const config::JobConfig& c, int64_t dp_rank, int64_t dp_degree) {
  LoaderOptions o;
  o.seq_len = c.training.seq_len;
  o.batch_size = c.training.local_batch_size;
  o.dp_rank = dp_rank;
  o.dp_degree = dp_degree;
  o.lanes = c.training.data_lanes;
  o.stream.seed = static_cast<uint64_t>(c.training.data_seed);
  o.stream.shuffle_buffer = c.training.shuffle_buffer;
  o.stream.shuffle_shards = c.training.shuffle_shards;
  o.skip_malformed_rows = c.training.skip_malformed_rows;
  o.prefetch_batches = c.training.prefetch_batches;
  o.positions = c.model.attn_mask_type == "block_causal";
  return o;
}

class DataLoader::Lane {
 public:
  Lane(uint32_t id, uint32_t count, const std::vector<SourceSpec>& sources, const tokenizer::Tokenizer* tokenizer,
       const LoaderOptions& options, std::shared_ptr<std::atomic<uint64_t>> malformed)
      : id_(id), count_(count), stream_(sources, options.stream), tokenizer_(tokenizer), options_(options),
        malformed_(std::move(malformed)) {}

  uint32_t id() const { return id_; }
  uint64_t windows() const { return windows_; }
  // Global index of this lane's next window.
  uint64_t next_global_window() const { return windows_ * count_ + id_; }

  LaneState state() const {
    LaneState s;
    s.id = id_;
    s.windows = windows_;
    s.layers = layers_;
    if (have_doc_ && offset_ < tokens_.size()) {
      s.stream = doc_state_;
      s.offset = offset_;
    } else {
      s.stream = stream_.state();
    }
    return s;
  }

  // Positions this lane at a saved state. With an open document the document is read and encoded again.
  void restore(const LaneState& s) {
    windows_ = s.windows;
    layers_ = s.layers;
    have_doc_ = false;
    tokens_.clear();
    offset_ = 0;
    stream_.restore(s.stream);
    if (s.offset > 0) {
      if (stream_.position() % count_ != id_)
        fail("dataloader state: lane ", id_, " has a partly packed document ", stream_.position(),
             " that is not its own; the state is corrupt");
      doc_state_ = stream_.state();
      Document doc;
      if (!stream_.next(doc)) fail("dataloader state: the stream ended before the saved document");
      tokens_ = encode(doc);
      offset_ = s.offset;
      have_doc_ = true;
    }
  }

  void add_seed(uint64_t from, uint64_t seed) { stream_.add_seed(from, seed); }
  void add_configured_weights(uint64_t from) { stream_.add_configured_weights(from); }

  // Fills seq_len + 1 tokens (and their positions in their documents).
  void fill(int64_t* window, int64_t* positions, size_t length) {
    size_t filled = 0;
    while (filled < length) {
      if (!have_doc_ || offset_ >= tokens_.size()) {
        have_doc_ = false;
        if (!next_document())
          throw DataExhausted(cat("every data source is exhausted (all have loop = false) after ",
                                  with_thousands(static_cast<int64_t>(stream_.position())), " documents"));
      }
      const size_t take = std::min(length - filled, tokens_.size() - offset_);
      for (size_t i = 0; i < take; ++i) {
        window[filled + i] = tokens_[offset_ + i];
        if (positions) positions[filled + i] = static_cast<int64_t>(offset_ + i);
      }
      offset_ += take;
      filled += take;
    }
    ++windows_;
  }

 private:
  std::vector<int32_t> encode(const Document& doc) {
    const SourceSpec& source = stream_.sources()[doc.source];
    if (source.shards[doc.row.shard].format == Format::Tokens) return doc.row.tokens;
    std::string text;
    try {
      text = row_text(doc.row, source);
    } catch (const UserError& e) {
      if (!options_.skip_malformed_rows) throw;
      const uint64_t n = ++*malformed_;
      if (n <= 10 || (n & (n - 1)) == 0)
        log::warn("skipping malformed row #", n, " (training.skip_malformed_rows): ", e.what());
      return {};
    }
    // A row with no text is no document (as an empty .txt file is none): BOS/EOS alone would be trained on.
    if (text.find_first_not_of(" \t\r\n\f\v") == std::string::npos) return {};
    return tokenizer_->encode_document(text);
  }

  bool next_document() {
    while (true) {
      while (stream_.position() % count_ != id_)
        if (!stream_.skip()) return false;
      StreamState before = stream_.state();
      Document doc;
      if (!stream_.next(doc)) return false;
      uint64_t start = 0;
      bool consumed = false;
      for (const Layer& layer : layers_) {
        const uint64_t l = doc.index % layer.lanes;
        if (doc.index < layer.cursor[l]) consumed = true;
        else if (doc.index == layer.cursor[l]) start = std::max(start, layer.offset[l]);
      }
      std::erase_if(layers_, [&](const Layer& layer) { return stream_.position() >= layer.end; });
      if (consumed) continue;
      std::vector<int32_t> tokens = encode(doc);
      if (tokens.empty()) note_empty_document();
      else starved_docs_ = 0;
      if (start >= tokens.size()) continue;
      tokens_ = std::move(tokens);
      offset_ = start;
      doc_state_ = std::move(before);
      have_doc_ = true;
      return true;
    }
  }

  // A lane whose documents all give no tokens (empty or skipped rows) would loop for ever. It is stuck once every
  // source still serving has started two new passes during the run of empty documents (a whole pass seen) when
  // this lane reads every row, or 2 * lanes + 2 passes when it sees one row in `count_` (with a fixed row order
  // the lane's rows repeat after `count_` passes; shuffled, missing every good row that long is vanishingly rare).
  void note_empty_document() {
    const auto& sources = stream_.state().sources;
    if (starved_docs_++ == 0) {
      starved_from_epoch_.clear();
      for (const SourceState& s : sources) starved_from_epoch_.push_back(s.epoch);
    }
    const int64_t passes = count_ == 1 ? 2 : 2 * static_cast<int64_t>(count_) + 2;
    std::string names;
    for (size_t s = 0; s < sources.size(); ++s) {
      if (sources[s].exhausted) continue;
      if (sources[s].epoch - starved_from_epoch_[s] < passes) return;
      const SourceSpec& spec = stream_.sources()[s];
      names += cat(names.empty() ? "" : ", ", quote(spec.name), " (", spec.shards.size(), " file(s), first ",
                   quote(spec.shards.front().path), ")");
    }
    fail("no training tokens can be read: the last ", with_thousands(static_cast<int64_t>(starved_docs_)),
         " documents of data lane ", id_, " of ", count_, ", over ", passes, " or more passes of data source(s) ",
         names, ", were all empty or skipped as malformed (training.skip_malformed_rows); check the files' contents",
         " and the source's text_field");
  }

  uint32_t id_, count_;
  uint64_t starved_docs_ = 0;
  std::vector<int64_t> starved_from_epoch_;
  DocumentStream stream_;
  const tokenizer::Tokenizer* tokenizer_;
  LoaderOptions options_;
  std::shared_ptr<std::atomic<uint64_t>> malformed_;
  std::vector<Layer> layers_;
  std::vector<int32_t> tokens_;
  uint64_t offset_ = 0, windows_ = 0;
  bool have_doc_ = false;
  StreamState doc_state_;
};

DataLoader::DataLoader(std::vector<SourceSpec> sources, const tokenizer::Tokenizer* tokenizer, LoaderOptions options)
    : sources_(std::move(sources)), tokenizer_(tokenizer), options_(std::move(options)),
      malformed_(std::make_shared<std::atomic<uint64_t>>(0)) {
  if (options_.seq_len < 1 || options_.batch_size < 1) fail("internal: bad dataloader sizes");
  // Pre-tokenized shards must come from a tokenizer whose ids fit the one in use.
  for (const auto& source : sources_)
    for (const auto& shard : source.shards) {
      if (shard.format != Format::Tokens) continue;
      TokenShardReader reader(shard.path);
      const auto& h = reader.header();
      if (tokenizer_ && static_cast<int64_t>(h.vocab_size) != tokenizer_->vocab_size())
        fail(quote(shard.path), ": token shard written for a vocabulary of ", h.vocab_size, " ids, but the tokenizer (",
             tokenizer_->description(), ") has ", tokenizer_->vocab_size(), "; it was written with a different tokenizer");
      if (tokenizer_ && h.bos_id >= 0 && tokenizer_->bos_id() && *tokenizer_->bos_id() != h.bos_id)
        fail(quote(shard.path), ": token shard has BOS id ", h.bos_id, " but the tokenizer's is ",
             *tokenizer_->bos_id(), "; it was written with a different tokenizer");
      if (tokenizer_ && h.eos_id >= 0 && tokenizer_->eos_id() && *tokenizer_->eos_id() != h.eos_id)
        fail(quote(shard.path), ": token shard has EOS id ", h.eos_id, " but the tokenizer's is ",
             *tokenizer_->eos_id(), "; it was written with a different tokenizer");
    }
  if (!tokenizer_)
    for (const auto& source : sources_)
      for (const auto& shard : source.shards)
        if (shard.format != Format::Tokens) fail("internal: a text source needs a tokenizer");
  build_lanes(options_.lanes > 0 ? options_.lanes : options_.dp_degree);
}

DataLoader::~DataLoader() { stop_worker(); }

void check_documents_per_lane(const std::vector<SourceSpec>& sources, int64_t lanes, const std::string& name) {
  // Lanes l and l + D of a stream of D documents per pass are dealt the same documents in the same order: with
  // fewer documents than lanes, some lanes would serve exactly another lane's windows (or, without looping,
  // nothing). Known before reading for whole-file text, the case that meets it (one .txt file).
  int64_t documents = 0;
  for (const auto& source : sources)
    for (const auto& shard : source.shards) {
      if (shard.format != Format::Text) return;
      ++documents;
    }
  if (lanes <= 1 || documents >= lanes) return;
  const bool validation = name == "validation";
  fail(name, " data: ", documents == 1 ? quote(sources.front().shards.front().path) + " holds " : cat("the text files hold "), documents,
       " document(s) (a .txt file is one document under format \"text\"), fewer than the ", lanes,
       " data lanes (training.data_lanes, default: the data-parallel degree): lanes would read the same text from its start, "
       "and ranks would ", validation ? "validate" : "train", " on the same windows", validation ? " (or find none)" : "",
       ". Set ", validation ? "validation" : "training",
       ".dataset_format = \"paragraphs\" or \"lines\"", validation ? "" : " (a [[training.datasets]] table's format)",
       " to make each paragraph or line a document, or split the text into several files");
}

void DataLoader::build_lanes(int64_t lane_count) {
  if (lane_count % options_.dp_degree != 0)
    fail(options_.name, " data: training.data_lanes = ", lane_count, " must be a multiple of the data-parallel degree ",
         options_.dp_degree);
  if (options_.check_documents_per_lane) check_documents_per_lane(sources_, lane_count, options_.name);
  lane_count_ = lane_count;
  lanes_.clear();
  exhausted_.clear();
  for (int64_t l = options_.dp_rank; l < lane_count; l += options_.dp_degree)
    lanes_.push_back(std::make_unique<Lane>(static_cast<uint32_t>(l), static_cast<uint32_t>(lane_count), sources_,
                                            tokenizer_, options_, malformed_));
  served_state_.clear();
  for (const auto& lane : lanes_) served_state_.push_back(lane->state());
}

Batch DataLoader::produce(std::vector<LaneState>& snapshot) {
  const int64_t length = options_.seq_len + 1;
  at::Tensor windows = at::empty({options_.batch_size, length}, at::kLong);
  at::Tensor positions;
  if (options_.positions) positions = at::empty({options_.batch_size, length}, at::kLong);
  std::vector<int64_t> padded;  // rows no lane could fill (drain)
  for (int64_t b = 0; b < options_.batch_size; ++b) {
    Lane* lane = nullptr;
    for (const auto& candidate : lanes_)
      if (!exhausted_.count(candidate->id()) && (!lane || candidate->next_global_window() < lane->next_global_window()))
        lane = candidate.get();
    if (!lane) {
      if (b == 0) throw DataExhausted(options_.name + " data: every lane of this rank is exhausted");
      windows[b].fill_(0);
      if (options_.positions) positions[b].fill_(0);
      padded.push_back(b);
      continue;
    }
    try {
      lane->fill(windows.data_ptr<int64_t>() + b * length,
                 options_.positions ? positions.data_ptr<int64_t>() + b * length : nullptr, static_cast<size_t>(length));
    } catch (const DataExhausted&) {
      if (!options_.drain) throw;
      exhausted_.insert(lane->id());  // its partly filled window is dropped, as a lane's last always is
      --b;
    }
  }
  snapshot.clear();
  for (const auto& lane : lanes_) snapshot.push_back(lane->state());
  Batch batch{windows.narrow(1, 0, options_.seq_len).contiguous(), windows.narrow(1, 1, options_.seq_len).contiguous(), {}};
  for (const int64_t b : padded) batch.labels[b].fill_(kIgnoreIndex);
  if (options_.positions) batch.positions = positions.narrow(1, 0, options_.seq_len).contiguous();
  return batch;
}

void DataLoader::worker_loop() {
  try {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || static_cast<int64_t>(queue_.size()) < options_.prefetch_batches; });
        if (stop_) return;
      }
      Item item;
      item.batch = produce(item.state);
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(item));
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    worker_error_ = std::current_exception();
    cv_.notify_all();
  }
}

void DataLoader::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  stop_ = false;
  queue_.clear();
  worker_error_ = nullptr;
}

void DataLoader::rewind_reported_position(std::vector<LaneState> position) {
  served_state_ = std::move(position);
  rewound_ = true;
}

Batch DataLoader::next() {
  if (rewound_) fail("internal: the data loader's reported position was rewound for a final save; it serves no more batches");
  const double start = now_seconds();
  Batch batch;
  if (options_.prefetch_batches <= 0) {
    batch = produce(served_state_);
  } else {
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !queue_.empty() || worker_error_; });
    if (queue_.empty()) std::rethrow_exception(worker_error_);
    batch = std::move(queue_.front().batch);
    served_state_ = std::move(queue_.front().state);
    queue_.pop_front();
    cv_.notify_all();
  }
  wait_seconds_ += now_seconds() - start;
  return batch;
}

std::string DataLoader::state_dict() const {
  nlohmann::json j;
  j["version"] = 1;
  j["lanes"] = lane_count_;
  j["dp_rank"] = options_.dp_rank;
  j["dp_degree"] = options_.dp_degree;
  nlohmann::json lanes = nlohmann::json::array();
  for (const auto& s : served_state_) {
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& l : s.layers) layers.push_back(layer_json(l));
    nlohmann::json stream;
    to_json(stream, s.stream);
    lanes.push_back({{"id", s.id}, {"stream", stream}, {"offset", s.offset}, {"windows", s.windows}, {"layers", layers}});
  }
  j["lane_states"] = lanes;
  return j.dump();
}

void DataLoader::load_state_dict(const std::vector<std::string>& rank_states) {
  stop_worker();
  if (rank_states.empty()) fail("load_state_dict: no dataloader states given");
  int64_t saved_lanes = -1;
  std::map<uint32_t, LaneState> saved;
  for (size_t r = 0; r < rank_states.size(); ++r) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(rank_states[r]);
      if (j.at("version").get<int>() != 1) fail("dataloader state version ", j.at("version").dump(), " is not 1");
      const int64_t lanes = j.at("lanes").get<int64_t>();
      if (saved_lanes >= 0 && lanes != saved_lanes)
        fail("dataloader states disagree on the lane count (", saved_lanes, " and ", lanes, ")");
      saved_lanes = lanes;
      for (const auto& x : j.at("lane_states")) {
        LaneState s;
        s.id = x.at("id").get<uint32_t>();
        s.stream = stream_state_from_json(x.at("stream"), sources_);
        s.offset = x.at("offset").get<uint64_t>();
        s.windows = x.at("windows").get<uint64_t>();
        for (const auto& l : x.at("layers")) s.layers.push_back(layer_from_json(l));
        if (s.id >= lanes) fail("lane id ", s.id, " out of range");
        if (!saved.emplace(s.id, s).second) fail("lane ", s.id, " appears in two dataloader states");
      }
    } catch (const nlohmann::json::exception& e) {
      fail("malformed dataloader state #", r, ": ", e.what());
    }
  }
  if (static_cast<int64_t>(saved.size()) != saved_lanes)
    fail("the dataloader states cover ", saved.size(), " of ", saved_lanes,
         " lanes; pass the states of every rank of the saved run");

  int64_t lane_count = options_.lanes > 0 ? options_.lanes
                       : saved_lanes % options_.dp_degree == 0 ? saved_lanes
                                                               : options_.dp_degree;
  build_lanes(lane_count);
  uint64_t max_doc = 0;
  const LaneState* earliest = &saved.begin()->second;
  // max_doc: the first document no old lane had drawn (an open document was drawn; the next one was not).
  for (const auto& [id, s] : saved) {
    max_doc = std::max(max_doc, s.stream.doc + (s.offset > 0 ? 1 : 0));
    if (s.stream.doc < earliest->stream.doc) earliest = &s;
  }
  if (lane_count == saved_lanes) {
    for (auto& lane : lanes_) lane->restore(saved.at(lane->id()));
  } else {
    Layer layer;
    layer.lanes = static_cast<uint32_t>(saved_lanes);
    for (const auto& [id, s] : saved) {
      layer.cursor.push_back(s.stream.doc);
      layer.offset.push_back(s.offset);
    }
    layer.end = max_doc;
    LaneState start;
    start.stream = earliest->stream;
    start.layers = earliest->layers;
    start.layers.push_back(layer);
    for (auto& lane : lanes_) {
      start.id = lane->id();
      lane->restore(start);
    }
    log::info("dataloader: ", saved_lanes, " saved lane(s) re-dealt to ", lane_count, " from document ",
              earliest->stream.doc, "; documents already consumed up to ", max_doc, " are skipped");
  }
  // A new seed, and new mixture weights, apply from the first document no old lane had reached: a document begun
  // before the stop is finished from the source it was drawn from.
  for (auto& lane : lanes_) {
    lane->add_seed(max_doc, options_.stream.seed);
    lane->add_configured_weights(max_doc);
  }
  served_state_.clear();
  for (const auto& lane : lanes_) served_state_.push_back(lane->state());
}

}  // namespace titan::data
