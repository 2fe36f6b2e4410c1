#include "titan/distributed/placement.h"

#include <algorithm>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::distributed {

std::string Placement::str() const {
  switch (kind) {
    case Kind::Shard: return cat("Shard(", dim, ")");
    case Kind::Partial: return "Partial(sum)";
    default: return "Replicate()";
  }
}

Box Box::whole(const std::vector<int64_t>& shape) { return Box{std::vector<int64_t>(shape.size(), 0), shape}; }

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t l : lengths) n *= l;
  return n;
}

std::optional<Box> Box::intersect(const Box& other) const {
  if (offsets.size() != other.offsets.size()) return std::nullopt;
  Box out;
  for (size_t d = 0; d < offsets.size(); ++d) {
    const int64_t a = std::max(offsets[d], other.offsets[d]);
    const int64_t b = std::min(offsets[d] + lengths[d], other.offsets[d] + other.lengths[d]);
    if (b <= a) return std::nullopt;
    out.offsets.push_back(a);
    out.lengths.push_back(b - a);
  }
  return out;
}

std::string Box::str() const {
  std::string out = "[";
  for (size_t d = 0; d < offsets.size(); ++d) out += cat(d ? ", " : "", offsets[d], ":", offsets[d] + lengths[d]);
  return out + "]";
}

Range chunk(int64_t length, int64_t parts, int64_t index) {
  const int64_t capacity = chunk_capacity(length, parts);
  const int64_t begin = std::min(index * capacity, length);
  return {begin, std::clamp<int64_t>(length - begin, 0, capacity)};
}

TensorLayout TensorLayout::then(const std::string& mesh_dim, int64_t size, int64_t coordinate, Placement placement) const {
  if (placement.is_shard()) {
    const int64_t rank = static_cast<int64_t>(global_shape_.size());
    const int64_t d = placement.normalized_dim(rank);
    if (d < 0 || d >= rank)
      fail("placement ", placement.str(), " over mesh dimension ", mesh_dim, " names a dimension a tensor of shape ",
           cat("[", join_ints(global_shape_), "]"), " does not have");
    placement.dim = d;
  }
  if (coordinate < 0 || coordinate >= size) fail("placement over ", mesh_dim, ": coordinate ", coordinate, " outside 0..", size - 1);
  TensorLayout out = *this;
  out.levels_.push_back({mesh_dim, size, coordinate, placement});
  return out;
}

Box TensorLayout::local_box() const {
  Box box = Box::whole(global_shape_);
  for (const auto& level : levels_) {
    if (!level.placement.is_shard()) continue;
    const auto d = static_cast<size_t>(level.placement.dim);
    const Range r = chunk(box.lengths[d], level.size, level.coordinate);
    box.offsets[d] += r.begin;
    box.lengths[d] = r.length;
  }
  return box;
}

std::vector<int64_t> TensorLayout::padded_local_shape() const {
  std::vector<int64_t> shape = global_shape_;
  const Level* last_shard = nullptr;
  for (const auto& level : levels_)
    if (level.placement.is_shard()) last_shard = &level;
  for (const auto& level : levels_) {
    if (!level.placement.is_shard()) continue;
    const auto d = static_cast<size_t>(level.placement.dim);
    shape[d] = &level == last_shard ? chunk_capacity(shape[d], level.size) : chunk(shape[d], level.size, level.coordinate).length;
  }
  return shape;
}

bool TensorLayout::owner() const {
  return std::all_of(levels_.begin(), levels_.end(),
                     [](const Level& l) { return !l.placement.is_replicate() || l.coordinate == 0; });
}

bool TensorLayout::has_partial() const {
  return std::any_of(levels_.begin(), levels_.end(), [](const Level& l) { return l.placement.is_partial(); });
}

std::string TensorLayout::str() const {
  if (levels_.empty()) return "Replicate()";
  std::string out;
  for (const auto& l : levels_) out += cat(out.empty() ? "" : " ", l.placement.str(), "@", l.mesh_dim, "(", l.size, ")");
  return out;
}

}  // namespace titan::distributed
