#include "titan/components/data/document_stream.h"

#include <nlohmann/json.hpp>
#include <numeric>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"

namespace titan::data {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t hash(std::initializer_list<uint64_t> values) {
  uint64_t h = 0x243f6a8885a308d3ULL;
  for (uint64_t v : values) h = mix(h ^ mix(v));
  return h;
}

double unit_interval(uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53; }

// Fisher-Yates driven by a splitmix sequence: identical on every platform and standard library.
template <typename T>
void seeded_shuffle(std::vector<T>& items, uint64_t seed) {
  for (size_t i = items.size(); i > 1; --i) {
    seed = mix(seed);
    const size_t j = static_cast<size_t>(seed % i);
    std::swap(items[i - 1], items[j]);
  }
}

// Salts keep the different draws independent.
enum : uint64_t { kSaltShards = 1, kSaltRows = 2, kSaltMixture = 3, kSaltReseed = 4 };

}  // namespace

void to_json(nlohmann::json& j, const StreamState& s) {
  j = nlohmann::json::object();
  j["doc"] = s.doc;
  j["seeds"] = s.seeds;
  if (!s.weights.empty()) j["weights"] = s.weights;
  nlohmann::json sources = nlohmann::json::array();
  for (const auto& src : s.sources)
    sources.push_back({{"epoch", src.epoch},
                       {"order", src.order},
                       {"block_start", {src.block_start.row, src.block_start.offset, src.block_start.line}},
                       {"block_seed", src.block_seed},
                       {"block_pos", src.block_pos},
                       {"epoch_rows", src.epoch_rows},
                       {"rows_served", src.rows_served},
                       {"exhausted", src.exhausted}});
  j["sources"] = sources;
}

StreamState stream_state_from_json(const nlohmann::json& j, const std::vector<SourceSpec>& sources) {
  StreamState s;
  try {
    s.doc = j.at("doc").get<uint64_t>();
    s.seeds = j.at("seeds").get<std::vector<std::pair<uint64_t, uint64_t>>>();
    if (j.contains("weights")) {
      s.weights = j.at("weights").get<std::vector<std::pair<uint64_t, std::vector<double>>>>();
      for (const auto& [from, w] : s.weights)
        if (w.size() != sources.size()) fail("the dataloader state's weights name ", w.size(), " source(s), not ", sources.size());
    }
    const auto& list = j.at("sources");
    if (list.size() != sources.size())
      fail("the dataloader state has ", list.size(), " data source(s) but the config has ", sources.size(),
           "; resume with the same training.datasets");
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& x = list[i];
      SourceState src;
      src.epoch = x.at("epoch").get<int64_t>();
      src.order = x.at("order").get<std::vector<uint32_t>>();
      auto bs = x.at("block_start").get<std::vector<uint64_t>>();
      if (bs.size() != 3) fail("malformed block_start");
      src.block_start = {bs[0], bs[1], bs[2]};
      src.block_seed = x.at("block_seed").get<uint64_t>();
      src.block_pos = x.at("block_pos").get<uint64_t>();
      src.epoch_rows = x.at("epoch_rows").get<uint64_t>();
      src.rows_served = x.at("rows_served").get<uint64_t>();
      src.exhausted = x.at("exhausted").get<bool>();
      for (uint32_t shard : src.order)
        if (shard >= sources[i].shards.size())
          fail("the dataloader state refers to file #", shard, " of source ", quote(sources[i].name), ", which now has ",
               sources[i].shards.size(), " file(s); resume with the same files");
      s.sources.push_back(src);
    }
    if (s.seeds.empty()) fail("no seeds");
  } catch (const nlohmann::json::exception& e) {
    fail("malformed dataloader state: ", e.what());
  }
  return s;
}

struct DocumentStream::Reader {
  std::unique_ptr<ShardRowReader> reader;
  uint32_t shard = UINT32_MAX;
  std::vector<RawRow> block;
  std::vector<uint32_t> perm;
  bool block_loaded = false;
  void reset() {
    reader.reset();
    shard = UINT32_MAX;
    block.clear();
    perm.clear();
    block_loaded = false;
  }
};

DocumentStream::DocumentStream(const std::vector<SourceSpec>& sources, StreamOptions options)
    : sources_(&sources), options_(options) {
  if (sources.empty()) fail("the dataset mixture has no sources");
  state_.seeds = {{0, options.seed}};
  state_.weights = {{0, configured_weights()}};
  for (uint32_t s = 0; s < sources.size(); ++s) {
    SourceState st;
    st.order.resize(sources[s].shards.size());
    std::iota(st.order.begin(), st.order.end(), 0u);
    if (options_.shuffle_shards) seeded_shuffle(st.order, hash({options.seed, kSaltShards, s, 0}));
    state_.sources.push_back(st);
    readers_.push_back(std::make_unique<Reader>());
  }
}

DocumentStream::~DocumentStream() = default;
DocumentStream::DocumentStream(DocumentStream&&) noexcept = default;
DocumentStream& DocumentStream::operator=(DocumentStream&&) noexcept = default;

uint64_t DocumentStream::seed_at(uint64_t doc) const {
  uint64_t seed = state_.seeds.front().second;
  for (const auto& [from, s] : state_.seeds)
    if (from <= doc) seed = s;
  return seed;
}

const std::vector<double>& DocumentStream::weights_at(uint64_t doc) const {
  const std::vector<double>* weights = &state_.weights.front().second;
  for (const auto& [from, w] : state_.weights)
    if (from <= doc) weights = &w;
  return *weights;
}

std::vector<double> DocumentStream::configured_weights() const {
  std::vector<double> weights;
  for (const auto& source : *sources_) weights.push_back(source.weight);
  return weights;
}

void DocumentStream::restore(const StreamState& state) {
  if (state.sources.size() != state_.sources.size()) fail("dataloader state does not match the data sources");
  state_ = state;
  if (state_.weights.empty()) state_.weights = {{0, configured_weights()}};
  for (auto& r : readers_) r->reset();
}

void DocumentStream::add_configured_weights(uint64_t from) {
  const std::vector<double> weights = configured_weights();
  if (weights_at(from) == weights) return;
  if (from < state_.doc) fail("internal: weight change at document ", from, " is in the past (at ", state_.doc, ")");
  while (!state_.weights.empty() && state_.weights.back().first >= from) state_.weights.pop_back();
  state_.weights.emplace_back(from, weights);
}

void DocumentStream::add_seed(uint64_t from, uint64_t seed) {
  if (seed_at(from) == seed) return;
  if (from < state_.doc) fail("internal: seed change at document ", from, " is in the past (at ", state_.doc, ")");
  while (!state_.seeds.empty() && state_.seeds.back().first >= from) state_.seeds.pop_back();
  state_.seeds.emplace_back(from, seed);
}

void DocumentStream::apply_seed_switch(uint64_t seed) {
  // Rows already served stay served: the block in progress finishes in its order and the shard in progress stays
  // first; the shards not started in this epoch are re-ordered with the new seed.
  if (!options_.shuffle_shards) return;
  for (uint32_t s = 0; s < state_.sources.size(); ++s) {
    SourceState& st = state_.sources[s];
    const bool started = st.block_pos > 0 || st.block_start.row > 0;
    const size_t first = started ? 1 : 0;
    if (st.order.size() <= first) continue;
    std::vector<uint32_t> rest(st.order.begin() + static_cast<std::ptrdiff_t>(first), st.order.end());
    std::sort(rest.begin(), rest.end());
    seeded_shuffle(rest, hash({seed, kSaltReseed, s, static_cast<uint64_t>(st.epoch)}));
    std::copy(rest.begin(), rest.end(), st.order.begin() + static_cast<std::ptrdiff_t>(first));
    if (!started) readers_[s]->reset();
  }
}

bool DocumentStream::load_block(uint32_t s, bool fresh) {
  SourceState& st = state_.sources[s];
  Reader& r = *readers_[s];
  const SourceSpec& spec = (*sources_)[s];
  while (true) {
    if (st.order.empty()) {
      if (st.epoch_rows == 0)
        fail("data source ", quote(spec.name), " yields no documents (", spec.shards.size(), " file(s), first ",
             quote(spec.shards.front().path), "); check its path, format and text_field");
      if (!spec.loop) {
        st.exhausted = true;
        return false;
      }
      ++st.epoch;
      st.epoch_rows = 0;
      st.order.resize(spec.shards.size());
      std::iota(st.order.begin(), st.order.end(), 0u);
      if (options_.shuffle_shards)
        seeded_shuffle(st.order, hash({seed_at(state_.doc), kSaltShards, s, static_cast<uint64_t>(st.epoch)}));
      st.block_start = {};
      st.block_pos = 0;
      fresh = true;
    }
    const uint32_t shard = st.order.front();
    if (r.shard != shard) {
      r.reader = std::make_unique<ShardRowReader>(spec.shards[shard], shard, spec.text_field);
      r.shard = shard;
      if (st.block_start.row > 0) r.reader->seek(st.block_start);
    } else if (r.reader->position().row != st.block_start.row) {
      r.reader->seek(st.block_start);
    }
    r.block.clear();
    const size_t block_rows = static_cast<size_t>(std::max<int64_t>(1, options_.shuffle_buffer));
    RawRow row;
    while (r.block.size() < block_rows && r.reader->next(row)) r.block.push_back(std::move(row));
    if (r.block.empty()) {
      st.order.erase(st.order.begin());
      st.block_start = {};
      st.block_pos = 0;
      r.reset();
      fresh = true;
      continue;
    }
    if (fresh) st.block_seed = seed_at(state_.doc);
    r.perm.resize(r.block.size());
    std::iota(r.perm.begin(), r.perm.end(), 0u);
    if (options_.shuffle_buffer > 1)
      seeded_shuffle(r.perm, hash({st.block_seed, kSaltRows, s, shard, st.block_start.row}));
    if (st.block_pos > r.block.size())
      fail("the dataloader state points past the end of ", quote(spec.shards[shard].path),
           "; the file changed since the state was saved");
    r.block_loaded = true;
    return true;
  }
}

const RawRow* DocumentStream::next_row(uint32_t s) {
  SourceState& st = state_.sources[s];
  Reader& r = *readers_[s];
  while (true) {
    if (st.exhausted) return nullptr;
    if (!r.block_loaded && !load_block(s, st.block_pos == 0)) return nullptr;
    if (st.block_pos < r.block.size()) {
      const RawRow* row = &r.block[r.perm[st.block_pos++]];
      ++st.epoch_rows;
      ++st.rows_served;
      return row;
    }
    st.block_start = r.reader->position();
    st.block_pos = 0;
    r.block_loaded = false;
    r.block.clear();
  }
}

bool DocumentStream::advance(Document* doc) {
  const uint64_t g = state_.doc;
  for (size_t i = 1; i < state_.seeds.size(); ++i)
    if (state_.seeds[i].first == g && state_.seeds[i].second != state_.seeds[i - 1].second)
      apply_seed_switch(state_.seeds[i].second);
  const uint64_t seed = seed_at(g);
  const std::vector<double>& weights = weights_at(g);
  const uint32_t n = static_cast<uint32_t>(sources_->size());
  for (uint64_t attempt = 0;; ++attempt) {
    double total = 0;
    for (uint32_t s = 0; s < n; ++s)
      if (!state_.sources[s].exhausted) total += weights[s];
    if (total <= 0) return false;
    uint32_t pick = n;
    if (n == 1) {
      pick = 0;
    } else {
      double u = unit_interval(hash({seed, kSaltMixture, g, attempt})) * total;
      for (uint32_t s = 0; s < n; ++s) {
        if (state_.sources[s].exhausted) continue;
        pick = s;
        u -= weights[s];
        if (u < 0) break;
      }
    }
    const RawRow* row = next_row(pick);
    if (!row) continue;  // the source just ran out (loop = false): draw again among the rest
    state_.doc = g + 1;
    if (doc) {
      doc->index = g;
      doc->source = pick;
      doc->row = *row;
    }
    return true;
  }
}

bool DocumentStream::next(Document& doc) { return advance(&doc); }
bool DocumentStream::skip() { return advance(nullptr); }

}  // namespace titan::data
